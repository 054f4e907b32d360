"""thinwire: distributed deep learning that is cheap on the wire.

The package stands in floors, lowest first; a module imports only from its own
package and from floors below, and packages side by side do not import each other:

    compress
    comm | feedback | launch | progress
    schemes
    optim
    ddp                          (front door 1)
    pipeline | autodiff | ps | local   (front doors 2-5; local: DiLoCo)
    models | data
    jobs
    cli

The contracts in pyproject.toml (``[tool.importlinter]``) hold this and forbid import
cycles inside packages; the tests run them.
"""

from thinwire import compress, ddp, feedback, local, optim, schemes
from thinwire._version import __version__
from thinwire.comm import Meter

__all__ = ["Meter", "__version__", "compress", "ddp", "feedback", "local", "optim", "schemes"]
