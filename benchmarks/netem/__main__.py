"""``python -m benchmarks.netem``: see :mod:`benchmarks.netem.harness`."""

import sys

from benchmarks.netem.harness import main

sys.exit(main())
