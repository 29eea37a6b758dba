"""The front of ``make serve``: Debian's nginx between the network and waitress.

Waitress counts a socket before it knows who sent it and lets each wait for its headers:
1,010 sockets from one address, each sending a header byte every 10 s, filled its 1,000
connections and the server answered nobody. The front (deploy/nginx-front.conf) caps the
connections of each address at accept, before a byte is read, bounds how long headers and
bodies may take, and buffers bodies before waitress sees them; waitress listens on a unix
socket in a private folder that only this front reaches, and takes the client's address
from the front's X-Forwarded-For.
"""

from __future__ import annotations

import ctypes
import getpass
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .settings import ServerSettings, SettingsError

__all__ = ["Front", "find_nginx", "front_wanted", "FRONT_ENV", "TEMPLATE"]

FRONT_ENV = "KRYPTON_FRONT"  # "nginx" (the default) or "none": waitress alone, as before
TEMPLATE = Path(__file__).resolve().parents[1] / "deploy" / "nginx-front.conf"
INSTALL_HINT = "apt-get install nginx libnginx-mod-stream"
_STREAM_MODULES = (
    Path("/usr/lib/nginx/modules/ngx_stream_module.so"),
    Path("/usr/share/nginx/modules/ngx_stream_module.so"),
)


def front_wanted() -> bool:
    """Whether make serve puts nginx in front (``KRYPTON_FRONT`` is not 'none')."""
    return os.environ.get(FRONT_ENV, "nginx").strip().lower() != "none"


def find_nginx() -> tuple[str, str]:
    """(nginx's path, the load_module line its stream module needs, '' when built in);
    :class:`SettingsError` saying how to install it when it is missing."""
    found = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )
    if not found:
        raise SettingsError(
            f"make serve puts nginx in front of the app and nginx is not installed: "
            f"{INSTALL_HINT} (or set {FRONT_ENV}=none to serve with waitress alone, behind "
            f"a front of your own)"
        )
    built = subprocess.run([found, "-V"], capture_output=True, text=True, timeout=10).stderr
    if re.search(r"--with-stream(\s|$)", built):
        return found, ""
    module = next((m for m in _STREAM_MODULES if m.exists()), None)
    if module is None:
        raise SettingsError(f"nginx's stream module is not installed: {INSTALL_HINT}")
    return found, f"load_module {module};"


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """The front ends when the app's process does, however it ends (Linux prctl)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Front:
    """nginx listening on ``host``:``port`` for the waitress socket :attr:`app_socket`."""

    host: str
    port: int
    settings: ServerSettings
    max_body: int
    folder: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="krypton-front-")))
    process: subprocess.Popen | None = None

    @property
    def app_socket(self) -> Path:
        return self.folder / "app.sock"

    def config(self, load_stream: str) -> str:
        """deploy/nginx-front.conf with this server's values."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        values = {
            "run": str(self.folder),
            "load_stream": load_stream,
            "user": f"user {getpass.getuser()};" if os.geteuid() == 0 else "",
            "open_files": "16384",
            "connections": "8192",
            "listen": f"{host}:{self.port}",
            "per_address": str(self.settings.front_connections_per_address),
            "requests_per_address": str(self.settings.front_requests_per_address),
            "idle_timeout": "620",
            "header_timeout": f"{self.settings.header_timeout_seconds:g}",
            "body_timeout": f"{self.settings.read_timeout_seconds:g}",
            "max_body": str(self.max_body),
        }
        return re.sub(r"\{(\w+)\}", lambda m: values[m.group(1)], TEMPLATE.read_text())

    def start(self) -> None:
        """Write the config and start nginx; waits until it listens, or raises
        :class:`SettingsError` with nginx's own words."""
        nginx, load_stream = find_nginx()
        os.chmod(self.folder, 0o700)  # the app's socket: this front's alone
        conf = self.folder / "nginx.conf"
        conf.write_text(self.config(load_stream))
        command = [
            nginx,
            "-p",
            str(self.folder),
            "-c",
            str(conf),
            "-e",
            str(self.folder / "error.log"),
        ]
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=_die_with_parent,
        )
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                error = (
                    self.process.stderr.read().decode(errors="replace")
                    if self.process.stderr
                    else ""
                )
                raise SettingsError(f"the nginx front did not start: {error.strip()[-800:]}")
            if (self.folder / "http.sock").exists() and self._listening():
                return
            time.sleep(0.05)
        self.stop()
        raise SettingsError(f"the nginx front did not listen on {self.host}:{self.port} in 15 s")

    def _listening(self) -> bool:
        import socket

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.settimeout(0.5)
            return probe.connect_ex((self.host, self.port)) == 0

    def stop(self) -> None:
        """Stop nginx (fast shutdown) and remove the private folder."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        shutil.rmtree(self.folder, ignore_errors=True)
