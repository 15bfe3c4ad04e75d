"""``python -m logra.estimate``: the same as ``logra estimate``."""

import sys

from .cli import main

sys.exit(main())
