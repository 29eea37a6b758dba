"""The caller's thread setting, exactly: whatever count the caller chose — ``threads=``,
``KRYPTON_TORCH_THREADS``, ``torch.set_num_threads`` before or after ``import krypton``
(equal to torch's default or not), ``OMP_NUM_THREADS`` — is the count a run uses, and a
run changes the count of its own thread only, for its duration: a thread started during
a run (a server's next request) starts with the process's count and keeps it.

A process remembers every ``torch.set_num_threads`` it made, so the cases that depend on
a fresh process run in one (a Python subprocess without the suite's OMP_NUM_THREADS)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from torch import nn

import krypton
from krypton import host, schedule
from krypton.schedule import INTER, Schedule

# a small net, built the same in each subprocess, and a load that leaves one thread
PRELUDE = textwrap.dedent(
    """
    import json, sys, threading
    import torch
    from torch import nn

    def net():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
            nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2),
        ).eval()

    def busy(host):
        host._recent_load = lambda: float(host.os.cpu_count() or 1)  # every core busy
    """
)


def _fresh_process(script: str, **env: str) -> dict:
    """Run ``script`` (after PRELUDE) in a fresh interpreter without the suite's thread
    variables; the JSON it prints last."""
    thread_variables = ("OMP_NUM_THREADS", "KRYPTON_TORCH_THREADS", "MKL_NUM_THREADS")
    clean = {k: v for k, v in os.environ.items() if k not in thread_variables}
    done = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(script)],
        env={**clean, **env}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


needs_two_cores = pytest.mark.skipif(
    (os.cpu_count() or 1) < 2, reason="a busy host's share differs from a count only with 2 cores"
)


@needs_two_cores
@pytest.mark.parametrize("count", ["3", "default"])
def test_a_count_set_before_import_is_kept(count):
    """``torch.set_num_threads(N)`` then ``import krypton``: N is the caller's, however
    busy the host, and equal to torch's default too. Krypton took the count at its import
    as the default, so the usual script order let the load decide (3 became 1)."""
    found = _fresh_process(
        f"""
        count = {count if count != "default" else "torch.get_num_threads()"}
        torch.set_num_threads(count)
        import krypton
        from krypton import host
        busy(host)
        heatmap = krypton.explain(net(), torch.rand(3, 32, 32), patch=8, stride=8)
        print(json.dumps({{"count": count, "host": heatmap.extra["host"],
                           "after": torch.get_num_threads()}}))
        """
    )
    assert found["host"]["threads"] == found["count"] == found["after"]
    assert found["host"]["by"] == "torch.set_num_threads" and found["host"]["load"] is None


@needs_two_cores
def test_an_untouched_process_lets_the_load_decide():
    found = _fresh_process(
        """
        import krypton
        from krypton import host
        busy(host)
        heatmap = krypton.explain(net(), torch.rand(3, 32, 32), patch=8, stride=8)
        print(json.dumps({"host": heatmap.extra["host"], "after": torch.get_num_threads()}))
        """
    )
    assert found["host"]["by"] == "load" and found["host"]["threads"] == 1
    assert found["after"] >= 2  # the process's own count, back


def test_krypton_torch_threads_is_used_as_given_by_the_library():
    """``KRYPTON_TORCH_THREADS=1``: the run's thread computes on one thread. Before, the
    record said "as the caller set (KRYPTON_TORCH_THREADS)" over torch's two threads."""
    found = _fresh_process(
        """
        import krypton
        seen = set()
        heatmap = krypton.explain(
            net(), torch.rand(3, 32, 32), patch=8, stride=8,
            progress=lambda done, total: seen.add(torch.get_num_threads()),
        )
        print(json.dumps({"host": heatmap.extra["host"], "seen": sorted(seen)}))
        """,
        KRYPTON_TORCH_THREADS="1",
    )
    assert found["seen"] == [1]
    assert found["host"]["threads"] == 1 and found["host"]["by"] == "KRYPTON_TORCH_THREADS"
    assert found["host"]["peak_threads"] == 1


def test_krypton_torch_threads_is_used_as_given_by_the_cli(fundus_png, tmp_path):
    clean = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run(
        [sys.executable, "-c", "import sys; from krypton.cli import main; sys.exit(main())",
         "explain", str(fundus_png),
         "--out", str(tmp_path / "h.png"), "--patch", "56", "--stride", "56"],
        env={**clean, "KRYPTON_TORCH_THREADS": "1"}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("threads "))
    assert "1 torch thread: as the caller set (KRYPTON_TORCH_THREADS)" in line


@needs_two_cores
def test_a_thread_started_during_a_run_keeps_the_process_count():
    """A thread pool's thread whose first torch work falls inside another thread's run
    (a server's next request) starts with the process's count, keeps it, and its own
    later run is the load's to decide. Before, the run set the count process-wide: the
    new thread ran on one thread for life and its runs said the caller had chosen it."""
    found = _fresh_process(
        """
        from concurrent.futures import ThreadPoolExecutor
        import krypton
        from krypton import host
        default = torch.get_num_threads()
        pool = ThreadPoolExecutor(4)
        inside, during = threading.Event(), []

        def torch_work():
            torch.ones(64, 64) @ torch.ones(64, 64)  # this thread's first torch work
            return torch.get_num_threads()

        def progress(done, total):
            if not inside.is_set():
                inside.set()
                during.append(pool.submit(torch_work).result())  # a new pool thread

        load = [float(host.os.cpu_count() or 1)]
        host._recent_load = lambda: load[0]
        first = pool.submit(
            krypton.explain, net(), torch.rand(3, 32, 32), patch=8, stride=8,
            progress=progress,
        ).result()
        load[0] = 0.0  # then the host is idle: a later request on any pool thread
        later = [pool.submit(
            lambda: (krypton.explain(net(), torch.rand(3, 32, 32), patch=8, stride=8),
                     torch.get_num_threads())).result() for _ in range(4)]
        print(json.dumps({
            "default": default, "first": first.extra["host"], "during": during,
            "later": [h.extra["host"] for h, _ in later], "after": [n for _, n in later],
            "main": torch.get_num_threads(),
        }))
        """
    )
    assert found["first"]["threads"] == 1 and found["first"]["by"] == "load"
    assert found["during"] == [found["default"]]
    assert {record["by"] for record in found["later"]} == {"load"}
    assert {record["threads"] for record in found["later"]} == {found["default"]}
    assert set(found["after"]) == {found["default"]} and found["main"] == found["default"]


def test_krypton_leaves_the_callers_psutil_reading_alone(two_cores):
    """``psutil.cpu_percent(interval=None)`` reads the CPU since the caller's last call in
    its thread; Krypton's own load samples (in the same thread, at a run's start) reset
    that window to the sample's end."""
    psutil = pytest.importorskip("psutil")
    psutil.cpu_percent(interval=None)
    mark = psutil._last_cpu_times.get(threading.current_thread().ident)
    assert mark is not None
    host.host_load()
    host.host_load(interval=None)
    host._others_load(interval=None)
    host._others_load(interval=0.05)
    assert psutil._last_cpu_times.get(threading.current_thread().ident) is mark


def _tiny_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 2),
    ).eval()


def test_positions_on_two_workers_are_not_one_thread(two_cores, monkeypatch):
    """A run beside a busy host takes one intra-op thread, and its positions may run on
    two single-threaded inter-position workers: the record says both."""
    two_cores[0] = 2.0
    monkeypatch.setattr(schedule, "schedule_options", lambda *args: [Schedule(INTER, 2)])
    heatmap = krypton.explain(_tiny_net(), torch.rand(3, 32, 32), patch=8, stride=4)
    record = heatmap.extra["host"]
    assert record["threads"] == 1 and record["peak_threads"] == 2
    assert "2 at once as inter-position workers" in host.describe_share(record)


def test_each_drop_in_says_per_thread_what_ran():
    """``last_host`` and ``last_engine`` belong to the thread that made the call: one
    instance serves a server's threads. Captum's drop-in had no ``last_host``; MONAI's
    was one attribute for every thread."""
    pytest.importorskip("monai")
    from krypton.captum import Occlusion
    from krypton.monai import OcclusionSensitivity

    net = _tiny_net()
    image = torch.rand(1, 3, 32, 32)
    occlusion, sensitivity = Occlusion(net), OcclusionSensitivity(net, mask_size=8, overlap=0.0)

    def call() -> None:
        occlusion.attribute(image, sliding_window_shapes=(3, 8, 8), strides=(3, 8, 8), target=0)
        sensitivity(image)

    worker = threading.Thread(target=call)
    worker.start()
    worker.join()
    assert occlusion.last_host is None and sensitivity.last_host is None  # not this thread's
    assert sensitivity.last_engine is None
    call()
    assert occlusion.last_host["by"] and sensitivity.last_host["threads"] >= 1
    assert sensitivity.last_engine == "krypton"


class _ConvBatches(torch.overrides.TorchFunctionMode):
    """The batch of every 2-D convolution computed inside: the windows per forward."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in (torch.conv2d, torch.nn.functional.conv2d) and args:
            self.sizes.append(int(args[0].shape[0]))
        return func(*args, **(kwargs or {}))


def _most_windows(call) -> int:  # type: ignore[no-untyped-def]
    with _ConvBatches() as seen:
        call()
    return max(seen.sizes)


def test_an_explicit_windows_per_forward_is_heard_even_at_the_default():
    """``perturbations_per_eval=1`` and ``n_batch=16`` passed by the caller bound each
    forward; left out, the engine asks for its own batch (128, within its budget). An
    explicit count equal to the library's default meant 128 windows a forward."""
    pytest.importorskip("monai")
    from krypton.captum import Occlusion
    from krypton.monai import OcclusionSensitivity

    net = _tiny_net()
    image = torch.rand(1, 3, 32, 32)
    windows = {"sliding_window_shapes": (3, 4, 4), "strides": (3, 2, 2), "target": 0}
    explicit = _most_windows(
        lambda: Occlusion(net).attribute(image, perturbations_per_eval=1, **windows)
    )
    left_out = _most_windows(lambda: Occlusion(net).attribute(image, **windows))
    monai = OcclusionSensitivity(net, mask_size=4, overlap=0.5, n_batch=16, verbose=False)
    monai_explicit = _most_windows(lambda: monai(image))
    monai_left_out = _most_windows(
        lambda: OcclusionSensitivity(net, mask_size=4, overlap=0.5, verbose=False)(image)
    )
    assert explicit == 1 and left_out > 16
    assert monai_explicit <= 16 < monai_left_out
