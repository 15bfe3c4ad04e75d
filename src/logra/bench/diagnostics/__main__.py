"""``python -m logra.bench.diagnostics``: the same as ``logra bench diagnostics``."""

import sys

from .cli import main

sys.exit(main())
