"""``python -m minisgl_bench``: the same as ``minisgl-bench`` and ``minisgl bench``."""

import sys

from .cli import main

sys.exit(main())
