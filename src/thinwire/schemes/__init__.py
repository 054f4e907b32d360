"""Schemes registered by name: ``build("dct-dp", ratio=0.01)``, ``names()``.

Floor: above the core (compress, feedback, comm); below optim and the front doors.
"""

from thinwire.schemes import builtin as _builtin  # noqa: F401  (registers the schemes)
from thinwire.schemes import powersgd as _powersgd  # noqa: F401
from thinwire.schemes import quantised as _quantised  # noqa: F401
from thinwire.schemes import scalecom as _scalecom  # noqa: F401
from thinwire.schemes import sparseloco as _sparseloco  # noqa: F401
from thinwire.schemes.base import Scheme
from thinwire.schemes.kernel import CompressedScheme
from thinwire.schemes.registry import (
    build,
    config_class,
    fingerprint,
    names,
    parse_spelling,
    rebuild,
    register,
    warm_up,
)
from thinwire.schemes.traits import Traits

__all__ = ["CompressedScheme", "Scheme", "Traits", "build", "config_class", "fingerprint",
           "names", "parse_spelling", "rebuild", "register", "warm_up"]
