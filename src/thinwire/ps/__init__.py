"""Front door 4: an asynchronous parameter server (ASGD, DC-ASGD, SSGD) on torch RPC.

``build_rule(name, **config)`` gives a server update rule usable on its own;
:class:`ParameterServerCore` is the transport-free server; :func:`run` runs a
method of the comparison (sequential, ssgd, asgd, dc-asgd) with workers in
processes talking TensorPipe RPC over loopback.

Floor: front door, beside pipeline and autodiff (neither imported). Library
code only: the task comes in as a :class:`TaskBuilder`; the experiments'
concrete task is :mod:`thinwire.jobs.ps_task`.
"""

from thinwire.ps.checkpoint import load_checkpoint, save_checkpoint
from thinwire.ps.config import METHODS, AsyncConfig, Task, TaskBuilder
from thinwire.ps.core import AuditEntry, ParameterServerCore, PushResult, Snapshot
from thinwire.ps.launch import RunResult, run
from thinwire.ps.layout import Layout
from thinwire.ps.rules import (
    DCASGD,
    DCConfig,
    SGDConfig,
    UpdateRule,
    build_rule,
    register_rule,
    rule_config_class,
    rule_names,
)
from thinwire.ps.server import ParameterServer
from thinwire.ps.staleness import OUTCOMES, StalenessRecord
from thinwire.ps.wire import MalformedPush, PushCodec

__all__ = [
    "DCASGD",
    "METHODS",
    "OUTCOMES",
    "AsyncConfig",
    "AuditEntry",
    "DCConfig",
    "Layout",
    "MalformedPush",
    "ParameterServer",
    "ParameterServerCore",
    "PushCodec",
    "PushResult",
    "RunResult",
    "SGDConfig",
    "Snapshot",
    "StalenessRecord",
    "Task",
    "TaskBuilder",
    "UpdateRule",
    "build_rule",
    "load_checkpoint",
    "register_rule",
    "rule_config_class",
    "rule_names",
    "run",
    "save_checkpoint",
]
