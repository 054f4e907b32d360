"""``python -m thinwire``."""

import sys

from thinwire.cli import main

sys.exit(main())
