"""``python -m app``: the explorer (``rakv-explorer``)."""

import sys

from app.main import main

sys.exit(main())
