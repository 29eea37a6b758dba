"""``krypton.monai``: the public name of :mod:`krypton.dropins.monai` (the same module
object, so what is patched or read through either name is one thing)."""

import sys

from .dropins import monai as _module

sys.modules[__name__] = _module
