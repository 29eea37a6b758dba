"""A whole team deployment on one machine: ``make cluster``.

Starts Debian's ``redis-server`` on a local port, N Celery workers and the app, all
pointing at that Redis, and stops them all on Ctrl-C. The tests and ``make bench-serve``
start the same processes through :class:`Cluster`.

    python -m webapp.cluster [--port 8050] [--redis-port 6390] [--workers 2]
    python -m webapp.cluster --worker NAME     (make worker: one worker, nothing else)
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from .settings import BROKER_ENV
from .team import live_workers

ROOT = Path(__file__).resolve().parents[1]


class ClusterError(RuntimeError):
    """A process of the cluster could not be started."""


class Cluster:
    """redis-server, Celery workers and (optionally) the app as child processes.

    Args:
        folder: logs, Redis's working folder and (unless ``env`` says otherwise) the
            app's cache and home.
        redis_port: where Redis listens on 127.0.0.1.
        env: extra environment for the workers and the app.
        torch_threads: torch threads per worker (default: the cores shared out).
    """

    def __init__(
        self,
        folder: Path,
        redis_port: int,
        env: dict | None = None,
        torch_threads: int | None = None,
    ):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.redis_port = redis_port
        self.url = f"redis://127.0.0.1:{redis_port}/0"
        self.env = dict(
            os.environ,
            PYTHONUNBUFFERED="1",
            **{BROKER_ENV: self.url},
            **(env or {}),
        )
        self.env.setdefault("KRYPTON_CACHE_DIR", str(self.folder / "cache"))
        self.torch_threads = torch_threads
        self.redis: subprocess.Popen | None = None
        self.workers: dict[str, subprocess.Popen] = {}
        self.app: subprocess.Popen | None = None
        self._logs: list = []

    def _log(self, name: str):
        handle = open(self.folder / f"{name}.log", "a+")
        self._logs.append(handle)
        return handle

    def log_text(self, name: str) -> str:
        path = self.folder / f"{name}.log"
        return path.read_text() if path.exists() else ""

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.redis_port, socket_timeout=5)

    def start_redis(self) -> None:
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        if not Path(binary).exists():
            raise ClusterError(
                "redis-server is not installed: apt-get install redis-server (Debian's package)"
            )
        self.redis = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.redis_port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.folder),
            ],  # fmt: skip
            stdout=self._log("redis"),
            stderr=subprocess.STDOUT,
        )
        self._wait(lambda: self.client().ping(), "redis-server", self.redis, "redis")

    def start_worker(self, name: str, timeout: float = 120) -> subprocess.Popen:
        """One worker (``make worker``'s command), returned once it announced itself."""
        env = dict(self.env)
        threads = self.torch_threads or max(
            1, (os.cpu_count() or 1) // max(1, len(self.workers) + 1)
        )
        env.setdefault("KRYPTON_TORCH_THREADS", str(threads))
        process = subprocess.Popen(
            worker_command(name),
            cwd=ROOT,
            env=env,
            stdout=self._log(f"worker-{name}"),
            stderr=subprocess.STDOUT,
        )
        self.workers[name] = process
        self._wait(
            lambda: any(w.startswith(f"{name}@") for w in live_workers(self.client())),
            f"worker {name}",
            process,
            f"worker-{name}",
            timeout,
        )
        return process

    def start_app(
        self, port: int, host: str = "127.0.0.1", timeout: float = 120
    ) -> subprocess.Popen:
        import requests

        self.app = subprocess.Popen(
            [sys.executable, "app.py", "--host", host, "--port", str(port)],
            cwd=ROOT,
            env=self.env,
            stdout=self._log("app"),
            stderr=subprocess.STDOUT,
        )

        def answering() -> bool:
            return requests.get(f"http://127.0.0.1:{port}/_dash-layout", timeout=2).ok

        self._wait(answering, "the app", self.app, "app", timeout)
        return self.app

    def kill_worker(self, name: str) -> None:
        """SIGKILL: the worker gets no chance to hand anything back."""
        process = self.workers.pop(name)
        process.send_signal(signal.SIGKILL)
        process.wait()

    def stop(self) -> None:
        """Workers first (they finish nothing), then the app, then Redis."""
        for process in [*self.workers.values(), self.app, self.redis]:
            if process is not None and process.poll() is None:
                process.terminate()
        for process in [*self.workers.values(), self.app, self.redis]:
            if process is None:
                continue
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.workers.clear()
        for handle in self._logs:
            handle.close()
        self._logs.clear()

    def _wait(self, ready, what: str, process, log: str, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if process.poll() is not None:
                raise ClusterError(f"{what} exited: {self.log_text(log)[-2000:]}")
            try:
                if ready():
                    return
            except Exception:
                pass
            time.sleep(0.3)
        raise ClusterError(f"{what} did not start in {timeout:.0f} s: {self.log_text(log)[-2000:]}")


def worker_command(name: str) -> list[str]:
    """The command ``make worker`` runs (pool choice: webapp/worker.py)."""
    return [
        sys.executable, "-m", "celery", "-A", "webapp.worker:celery_app", "worker",
        "--pool", "threads", "--concurrency", "1", "--hostname", f"{name}@%h",
        "--loglevel", "INFO", "--without-gossip", "--without-mingle",
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Redis + Celery workers + the app, on one box")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8050)
    parser.add_argument("--redis-port", type=int, default=6390)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--worker", metavar="NAME", help="instead: run one worker (make worker) and nothing else"
    )
    args = parser.parse_args(argv)
    if args.worker:
        os.chdir(ROOT)
        command = worker_command(args.worker)
        os.execv(command[0], command)
    folder = Path(os.environ.get("KRYPTON_CLUSTER_DIR") or tempfile.mkdtemp(prefix="krypton-"))
    threads = max(1, (os.cpu_count() or 1) // args.workers)
    cluster = Cluster(folder, args.redis_port, torch_threads=threads)
    try:
        cluster.start_redis()
        print(f"redis-server on {cluster.url}", flush=True)
        for index in range(1, args.workers + 1):
            cluster.start_worker(f"worker{index}")
            print(f"worker{index} ready ({threads} torch threads)", flush=True)
        cluster.start_app(args.port, args.host)
        print(
            f"Krypton (team mode, {args.workers} workers) is running at "
            f"http://{args.host}:{args.port}/ — logs in {folder} (Ctrl+C stops everything)",
            flush=True,
        )
        while all(
            p.poll() is None for p in [cluster.redis, cluster.app, *cluster.workers.values()]
        ):
            time.sleep(1)
        print("a process of the cluster exited; stopping the rest", file=sys.stderr)
        raise SystemExit(1)
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print("stopping…", flush=True)
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
