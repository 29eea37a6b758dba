"""The viewer most sites put beside Orthanc, to see Krypton's maps where a radiologist
reads: OHIF v3 (npm ``@ohif/app``'s prebuilt ``dist/``, with its Parametric Map
extension) served by Debian's nginx on one origin with the PACS: nginx serves the viewer
and proxies ``/dicom-web/`` to Orthanc, adding the basic-auth header, so the browser
never holds the PACS's password. The proxy passes reads only (GET and HEAD: QIDO and
WADO); a store (STOW-RS POST) or a DELETE through it is refused with HTTP 403, and it
listens on loopback unless ``--host`` names another address: whoever reaches its port
reads the PACS as its user.

    make pacs      # Orthanc with the chest-CT sample, on 127.0.0.1:8042
    make viewer    # OHIF on 127.0.0.1:8043 (python -m demo.viewer)

The viewer is fetched once through npm (:func:`fetch_ohif`, pinned to
:data:`OHIF_VERSION`) into ``cache/ohif``; the tests start the same nginx through
:func:`start_viewer` (tests/test_ohif_browser.py).
"""

from __future__ import annotations

import argparse
import base64
import getpass
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

OHIF_PACKAGE = "@ohif/app"
OHIF_VERSION = "3.13.2"  # the Parametric Map overlay is OHIF's since 3.9
ROOT = Path(__file__).resolve().parent.parent
OHIF_CACHE = ROOT / "cache" / "ohif"
APP_CONFIG = """window.config = {
  name: 'krypton-viewer',
  routerBasename: '/',
  extensions: [],
  modes: [],
  customizationService: {},
  showStudyList: true,
  maxNumberOfWebWorkers: 2,
  showWarningMessageForCrossOrigin: false,
  showCPUFallbackMessage: false,
  showLoadingIndicator: true,
  strictZSpacingForVolumeViewport: true,
  investigationalUseDialog: { option: 'never' },
  defaultDataSourceName: 'orthanc',
  dataSources: [
    {
      namespace: '@ohif/extension-default.dataSourcesModule.dicomweb',
      sourceName: 'orthanc',
      configuration: {
        friendlyName: 'Orthanc (Krypton demo PACS)',
        name: 'orthanc',
        wadoUriRoot: '/dicom-web',
        qidoRoot: '/dicom-web',
        wadoRoot: '/dicom-web',
        qidoSupportsIncludeField: false,
        imageRendering: 'wadors',
        thumbnailRendering: 'wadors',
        enableStudyLazyLoad: true,
        supportsFuzzyMatching: false,
        supportsWildcard: true,
        omitQuotationForMultipartRequest: true,
        bulkDataURI: { enabled: true },
      },
    },
  ],
};
"""
NGINX_CONFIG = """daemon off;
{user}
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 256; }}
http {{
    include /etc/nginx/mime.types;
    types {{ application/wasm wasm; }}
    access_log {prefix}/access.log;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    server {{
        listen {host}:{port};
        root {dist};
        # OHIF's volume viewports use SharedArrayBuffer: the page must be cross-origin
        # isolated
        add_header Cross-Origin-Opener-Policy same-origin always;
        add_header Cross-Origin-Embedder-Policy require-corp always;
        add_header Cross-Origin-Resource-Policy same-origin always;
        location = /app-config.js {{ alias {prefix}/app-config.js; }}
        location /dicom-web/ {{
            # reads only (QIDO and WADO): a store (STOW) or a delete through the viewer
            # would be signed in as the PACS's user for whoever reaches this port
            limit_except GET {{ deny all; }}
            proxy_pass {pacs}/;
            proxy_set_header Authorization "Basic {credentials}";
            proxy_buffering off;
            proxy_read_timeout 120s;
        }}
        location / {{ try_files $uri $uri/ /index.html; }}
    }}
}}
"""


def fetch_ohif(cache: Path = OHIF_CACHE, version: str = OHIF_VERSION) -> Path:
    """OHIF's prebuilt viewer (``dist/``), fetched once through npm into ``cache``; its
    folder."""
    dist = cache / version / "dist"
    if (dist / "index.html").exists():
        return dist
    if shutil.which("npm") is None:
        raise SystemExit("npm is not installed: apt-get install npm (OHIF comes through npm)")
    with tempfile.TemporaryDirectory(prefix="krypton-ohif-") as folder:
        packed = subprocess.run(
            ["npm", "pack", f"{OHIF_PACKAGE}@{version}", "--silent"],
            cwd=folder, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        if packed.returncode != 0:
            raise SystemExit(
                f"npm could not fetch {OHIF_PACKAGE}@{version}: {packed.stderr[-500:]}"
            )
        tarball = Path(folder) / packed.stdout.strip().splitlines()[-1]
        unpacked = Path(folder) / "unpacked"
        with tarfile.open(tarball) as archive:
            archive.extractall(unpacked, filter="data")
        (cache / version).mkdir(parents=True, exist_ok=True)
        shutil.rmtree(dist, ignore_errors=True)
        shutil.move(str(unpacked / "package" / "dist"), dist)
    return dist


def start_viewer(
    dist: Path, folder: Path, port: int, pacs_root: str, user: str, password: str,
    host: str = "127.0.0.1",
) -> tuple[subprocess.Popen, str]:  # fmt: skip
    """nginx serving OHIF's ``dist`` on ``host:port`` with ``pacs_root`` (Orthanc's
    DICOMweb root) proxied at ``/dicom-web/`` under its sign-in: (the process, the
    viewer's address) once it answers."""
    from demo.pacs import wait_answering
    from webapp.front import find_nginx

    nginx, _ = find_nginx()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "app-config.js").write_text(APP_CONFIG)
    credentials = base64.b64encode(f"{user}:{password}".encode()).decode()
    config = NGINX_CONFIG.format(
        prefix=folder, host=host, port=port, dist=dist, pacs=pacs_root.rstrip("/"),
        credentials=credentials,
        # as root, nginx's workers would drop to nobody, who cannot read a private folder
        user=f"user {getpass.getuser()};" if os.geteuid() == 0 else "",
    )  # fmt: skip
    (folder / "nginx.conf").write_text(config)
    (folder / "nginx.conf").chmod(0o600)  # it holds the PACS's sign-in
    log = open(folder / "nginx.out", "w")
    process = subprocess.Popen(
        [nginx, "-p", str(folder), "-c", str(folder / "nginx.conf")], stdout=log, stderr=log
    )
    url = f"http://{host}:{port}"
    wait_answering(process, url + "/app-config.js", 30, "nginx", folder / "error.log")
    return process, url


def main() -> None:
    from demo.pacs import DEMO_PASSWORD, DEMO_USER

    parser = argparse.ArgumentParser(description="OHIF beside the demo PACS (make viewer)")
    parser.add_argument("--port", type=int, default=8043)
    parser.add_argument(
        "--host", default="127.0.0.1",
        help="the address to listen on (loopback by default: whoever reaches the port reads "
        "the PACS as its user)",
    )  # fmt: skip
    parser.add_argument("--pacs", default="http://127.0.0.1:8042/dicom-web")
    parser.add_argument("--folder", default=str(ROOT / "cache" / "viewer"))
    args = parser.parse_args()
    dist = fetch_ohif()
    process, url = start_viewer(
        dist, Path(args.folder), args.port, args.pacs, DEMO_USER, DEMO_PASSWORD, args.host
    )
    print(f"OHIF {OHIF_VERSION} at {url} over the PACS at {args.pacs}; Ctrl-C stops it")
    try:
        process.wait()
    except KeyboardInterrupt:
        process.terminate()


if __name__ == "__main__":
    main()
