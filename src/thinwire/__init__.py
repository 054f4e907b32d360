"""thinwire: distributed deep learning that is cheap on the wire."""

from thinwire import compress, ddp, feedback, optim, schemes
from thinwire._version import __version__
from thinwire.comm import Meter

__all__ = ["Meter", "__version__", "compress", "ddp", "feedback", "optim", "schemes"]
