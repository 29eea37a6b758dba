"""A run's batches on the schedule its own timings choose (krypton.schedule): intra-op,
one thread, or inter-position (the batch's positions in shards on single-threaded
workers, ZNNi's task-parallel schedule). Every schedule gives naive's values; the choice
follows the measured pace, is in the run's record, and never deadlocks a graph capture."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from torch import nn

import krypton
from krypton import host, schedule
from krypton.engine.capture_lock import CAPTURE_LOCK
from krypton.host import HostShare
from krypton.schedule import INTER, INTRA, Schedule, ScheduleChooser, schedule_options

TWO = Schedule(INTRA, 2)
ONE = Schedule(INTRA, 1)
WORKERS = Schedule(INTER, 2)


def test_the_options_follow_the_share_and_the_batch():
    cpu = torch.device("cpu")
    idle = HostShare(2, "load", 0.0, 2)
    assert schedule_options(idle, 16, cpu) == [TWO, WORKERS]  # one thread: 1.8x slower
    busy = HostShare(1, "load", 2.0, 2)
    assert schedule_options(busy, 16, cpu) == [WORKERS, ONE]  # the workers first
    assert schedule_options(busy, 15, cpu) == [ONE]  # shards must divide the batch
    assert schedule_options(HostShare(1, "threads=", None, 1), 16, cpu) == [ONE]
    assert schedule_options(idle, 16, torch.device("meta")) == [TWO]  # a card: its own


def test_the_chooser_times_each_then_runs_the_fastest_and_looks_again():
    chooser = ScheduleChooser()
    options = [TWO, WORKERS, ONE]
    paces = {TWO: 1.0, WORKERS: 0.6, ONE: 2.0}
    picked = []
    for _ in range(60):
        chosen = chooser.pick(options)
        picked.append(chosen)
        chooser.ran(chosen, 16, 16 * paces[chosen])
    assert picked[:3] == options  # each timed once, in order
    later = picked[3:]
    assert later.count(WORKERS) > 0.8 * len(later)  # the fastest runs
    assert TWO in later  # close enough to look at again
    assert later.count(ONE) <= 2  # far behind: rarely
    paces[WORKERS] = 3.0  # the load changed: the workers now lose
    for _ in range(30):
        chosen = chooser.pick(options)
        chooser.ran(chosen, 16, 16 * paces[chosen])
    assert chooser.pick(options) == TWO


@pytest.fixture
def only(monkeypatch):
    """Make a run offer one schedule (to check each one's values)."""

    def offer(chosen: Schedule):
        monkeypatch.setattr(schedule, "schedule_options", lambda share, batch, device: [chosen])

    return offer


@pytest.mark.parametrize("rank", [2, 3])
def test_every_schedule_gives_naives_values(only, rank):
    torch.manual_seed(0)
    conv, pool = (
        (nn.Conv2d, nn.AdaptiveAvgPool2d) if rank == 2 else (nn.Conv3d, nn.AdaptiveAvgPool3d)
    )
    model = nn.Sequential(
        conv(1, 8, 3, padding=1), nn.ReLU(), conv(8, 8, 3, stride=2, padding=1), nn.ReLU(),
        pool(1), nn.Flatten(), nn.Linear(8, 3),
    ).eval()  # fmt: skip
    image = torch.rand(1, *([12] * rank))
    explainer = krypton.OcclusionExplainer(model)
    settings = dict(patch=4, stride=2, label=1, batch_size=8)
    naive = explainer.explain(image, mode="naive", threads=1, **settings).values
    for chosen in (WORKERS, TWO, ONE):
        only(chosen)
        explainer.forget_plans()
        heatmap = explainer.explain(image, mode="exact", strategy="incremental", **settings)
        assert np.nanmax(np.abs(heatmap.values - naive)) <= 1e-5, chosen
        ran = heatmap.extra["host"]["schedules"]
        assert sum(ran.values()) == heatmap.positions_evaluated
        assert set(ran) <= {str(chosen), "one thread"}  # a last batch of one shard: one thread
        assert ran[str(chosen)] >= heatmap.positions_evaluated - 4
        if rank == 2:  # the drop-ins' path: each position's own pixels
            ys, xs, patches = [0, 4, 8, 2], [8, 4, 0, 6], torch.rand(4, 1, 4, 4)
            own = explainer.occluded_outputs(image, ys, xs, patches, batch_size=2)
            plain = explainer.occluded_outputs(image, ys, xs, patches, mode="naive")
            assert torch.allclose(own, plain, atol=1e-5), chosen


def test_the_record_says_which_schedule_ran_and_the_callers_threads_come_back(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("KRYPTON_TORCH_THREADS", raising=False)
    monkeypatch.setattr(host, "_recent_load", lambda: 2.0)  # a busy host
    monkeypatch.setattr(host, "_MAX_THREADS", [2])
    monkeypatch.setattr(host.os, "cpu_count", lambda: 2)
    before = torch.get_num_threads()
    monkeypatch.setattr(host, "_TORCH_DEFAULT", before)
    model = krypton.registry.load_model("fundus-demo")
    image = torch.zeros(3, *model.input_size)
    heatmap = krypton.OcclusionExplainer(model).explain(
        image, patch=16, stride=16, batch_size=8, strategy="incremental"
    )
    record = heatmap.extra["host"]
    assert record["by"] == "load" and record["budget"] == 2
    assert str(WORKERS) in record["schedules"]  # a busy host: the workers were tried first
    assert sum(record["schedules"].values()) == heatmap.positions_evaluated
    assert "inter-position on 2 threads" in host.describe_share(record)
    assert torch.get_num_threads() == before  # the shards' one thread does not stay


def test_shards_run_while_a_capture_waits():
    """A capture waiting on the lock while a batch runs in shards: the workers compute
    under the batch's own hold, so neither waits for the other forever."""
    release = threading.Event()
    captured = threading.Event()

    def capture():
        with CAPTURE_LOCK.exclusive():
            captured.set()

    def compute(piece: slice) -> torch.Tensor:
        if piece.start == 0:  # the first shard, in the caller's thread, starts the capture
            threading.Thread(target=capture, daemon=True).start()
            time.sleep(0.2)  # the capture is waiting now
            release.set()
        else:
            assert release.wait(5)
            with CAPTURE_LOCK.shared():  # the model's own nested hold
                pass
        return torch.full((piece.stop - piece.start, 1), float(piece.start))

    done: list[torch.Tensor] = []
    runner = threading.Thread(
        target=lambda: done.append(schedule.run_scheduled(WORKERS, slice(0, 8), 8, compute)),
        daemon=True,
    )
    runner.start()
    runner.join(10)
    assert done and done[0][:, 0].tolist() == [0.0] * 4 + [4.0] * 4
    assert captured.wait(5)  # and the capture ran after


def test_no_worker_outlives_its_batch():
    """The inter-position workers were a process-wide pool whose threads lived between
    runs. Dash's test server stops by raising SystemExit in every thread it did not start
    with: the pool's workers died at their next wake-up, each with a shard it had taken,
    and the next run waited for them forever (a PACS browser test's second run hung for
    240 s). A batch's workers now end with it, so no run depends on a thread another
    host's habits may have stopped."""

    def compute(piece: slice) -> torch.Tensor:
        return torch.full((piece.stop - piece.start, 1), float(piece.start))

    for _ in range(3):
        done = schedule.run_scheduled(WORKERS, slice(0, 8), 8, compute)
        assert done[:, 0].tolist() == [0.0] * 4 + [4.0] * 4
        assert not [t for t in threading.enumerate() if t.name.startswith("krypton-shard")]


def test_shards_line_up_with_compiled_batches_or_split_evenly():
    """Incremental shards keep the run's layout (their indices are compiled once); a
    naive batch is split evenly: MONAI's 81 positions in a batch of 128 went as 64 and
    17, one worker waiting for the other, and ran 0.64x MONAI's own speed."""
    assert schedule.shard_length(2, 81, 128, aligned=False) == 41
    assert schedule.shard_length(2, 81, 128, aligned=True) == 64
    assert schedule.shard_length(2, 5, 16, aligned=True) == 8  # a short last batch: one shard
    assert schedule.shards(0, 81, 41) == [slice(0, 41), slice(41, 81)]
