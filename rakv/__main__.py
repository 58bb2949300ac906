"""``python -m rakv``: the ``rakv`` command."""

import sys

from .cli import main

sys.exit(main())
