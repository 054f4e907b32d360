"""thinwire: distributed deep learning that is cheap on the wire.

The package stands in floors, lowest first; a module imports only from its own
package and from floors below, and packages side by side do not import each other:

    compress
    comm | feedback | launch
    schemes
    optim
    ddp                          (front door 1)
    pipeline | autodiff | ps     (front doors 2-4)
    models | data
    jobs
    cli

The contract in pyproject.toml (``[tool.importlinter]``) holds this; the tests run it.
"""

from thinwire import compress, ddp, feedback, optim, schemes
from thinwire._version import __version__
from thinwire.comm import Meter

__all__ = ["Meter", "__version__", "compress", "ddp", "feedback", "optim", "schemes"]
