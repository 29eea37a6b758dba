"""What a hostile request costs the server (bench.costs), and the marker for tests of
make serve's nginx front."""

from __future__ import annotations

import pytest

from bench.costs import Cost, light_callback, light_limit, measured
from webapp.front import find_nginx
from webapp.settings import SettingsError

__all__ = ["Cost", "light_callback", "light_limit", "measured", "needs_nginx"]


def _nginx_installed() -> bool:
    try:
        find_nginx()
    except SettingsError:
        return False
    return True


# make serve puts Debian's nginx in front of waitress (.ci/run installs it)
needs_nginx = pytest.mark.skipif(not _nginx_installed(), reason="nginx is not installed")
