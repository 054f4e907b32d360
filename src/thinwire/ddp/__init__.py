"""Front door 1: synchronous data parallel through DDP communication hooks.

Floor: the lowest front door (the hybrid pipeline builds on it). Library code
only: no model, data set, job or command line.
"""

from thinwire.ddp.amp import LossScale
from thinwire.ddp.clip import LocalClip
from thinwire.ddp.delayed import OneStepDelay
from thinwire.ddp.hold import StepHold
from thinwire.ddp.hook import HookState, comm_hook, hook_state, register

__all__ = ["HookState", "LocalClip", "LossScale", "OneStepDelay", "StepHold", "comm_hook",
           "hook_state", "register"]
