"""thinwire: distributed deep learning that is cheap on the wire."""

from thinwire import compress, ddp, feedback, optim, schemes
from thinwire.comm import Meter

__version__ = "0.1.0"
__all__ = ["Meter", "compress", "ddp", "feedback", "optim", "schemes"]
