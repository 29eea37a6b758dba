"""``krypton node``: Krypton as an AI node a PACS routes new series to
(:mod:`krypton.node`), and ``krypton node status``: what it received and what became of
each series.

Settings, each a flag or an environment variable: the AE title (``KRYPTON_NODE_AE``,
KRYPTON), the port (``KRYPTON_NODE_PORT``, 11112), the calling AE titles it accepts
(``KRYPTON_NODE_CALLERS``, comma-separated; none by default: the node refuses to start
without one), the spool folder (``KRYPTON_NODE_SPOOL``, ``~/.krypton/node-spool``), its
quota (``KRYPTON_NODE_QUOTA_MB``, 2048) and the seconds without a new instance after
which a series is explained (``KRYPTON_NODE_STABLE_SECONDS``, 10). Results go to the PACS
of ``KRYPTON_DICOMWEB_URL`` (and its sign-in), as ``--send`` does.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

__all__ = ["add_node_parser", "run_node"]


def _spool_default() -> str:
    from ..registry import krypton_home

    return os.environ.get("KRYPTON_NODE_SPOOL") or str(krypton_home() / "node-spool")


def add_node_parser(commands) -> None:
    """The ``node`` command and its ``status``."""
    node = commands.add_parser("node", help="explain each series a PACS routes to Krypton")
    node.add_argument("action", nargs="?", choices=["serve", "status"], default="serve")
    env = os.environ.get
    node.add_argument("--ae-title", default=env("KRYPTON_NODE_AE", "KRYPTON"))
    node.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    node.add_argument("--port", type=int, default=int(env("KRYPTON_NODE_PORT", "11112")))
    node.add_argument(
        "--allow", nargs="+", default=[c for c in env("KRYPTON_NODE_CALLERS", "").split(",") if c],
        help="the calling AE titles (the PACS's) it accepts",
    )  # fmt: skip
    node.add_argument("--spool", default=None, help="where received instances wait")
    node.add_argument("--quota-mb", type=int, default=int(env("KRYPTON_NODE_QUOTA_MB", "2048")))
    node.add_argument(
        "--stable-seconds", type=float, default=float(env("KRYPTON_NODE_STABLE_SECONDS", "10"))
    )
    node.add_argument("--model", default=None, help="one model for every series")


def run_node(args: argparse.Namespace) -> int:
    """Serve until interrupted, or print the spool's series (``status``)."""
    import logging

    from ..node import Node, NodeSettings, Spool
    from ..pacs.dicomweb import PacsError
    from .pacs import configured_pacs

    spool = Path(args.spool or _spool_default())
    if args.action == "status":
        rows = Spool(spool, args.quota_mb * 2**20, args.stable_seconds).rows()
        if not rows:
            print(f"no series received yet (spool {spool})")
        for row in rows:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row.updated))
            print(f"{when}  {row.state:<9} {row.modality or '-':<3} {row.instances:>4} "
                  f"instances  series {row.series}  {row.reason}")  # fmt: skip
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        pacs = configured_pacs()  # where results go: KRYPTON_DICOMWEB_URL and its sign-in
    except PacsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    settings = NodeSettings(
        ae_title=args.ae_title, host=args.host, port=args.port, callers=tuple(args.allow),
        spool=spool, quota_mb=args.quota_mb, stable_seconds=args.stable_seconds,
        model=args.model,
    )  # fmt: skip
    node = Node(settings, pacs)
    try:
        node.start()
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"node {args.ae_title} on {args.host}:{args.port}, accepting {', '.join(args.allow)}; "
          f"spool {spool}", flush=True)  # fmt: skip
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        node.stop()
    return 0
