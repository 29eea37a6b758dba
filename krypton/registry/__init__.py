"""Models by name: registry entries and their one atomic, validated writer
(:mod:`.entries`), loading a model (:mod:`.loading`) into a :class:`.models.LoadedModel`,
registering a user's model (:mod:`.registration`), and the out-of-distribution check
(:mod:`.ood`)."""

from . import entries, loading, registration
from .entries import *  # noqa: F403 (re-exported: the names in its __all__)
from .loading import *  # noqa: F403 (re-exported: the names in its __all__)
from .registration import *  # noqa: F403 (re-exported: the names in its __all__)

__all__ = entries.__all__ + loading.__all__ + registration.__all__
