"""Front door 1: synchronous data parallel through DDP communication hooks."""

from thinwire.ddp.hook import HookState, comm_hook, hook_state, register

__all__ = ["HookState", "comm_hook", "hook_state", "register"]
