"""``python -m krypton``: see :mod:`krypton.cli`."""

import sys

from .cli import main

sys.exit(main())
