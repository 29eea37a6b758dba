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
from krypton.schedule import INTER, INTRA, Schedule, schedule_options

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


def test_a_decision_keeps_the_expected_schedule_on_a_near_tie():
    assert schedule.decide({TWO: 1.0, WORKERS: 0.6}, [TWO, WORKERS]) == WORKERS
    assert schedule.decide({TWO: 1.0, WORKERS: 0.95}, [TWO, WORKERS]) == TWO  # noise
    assert schedule.decide({WORKERS: 1.0, ONE: 1.5}, [WORKERS, ONE]) == WORKERS


def test_the_load_band_moves_only_past_its_hysteresis(monkeypatch):
    monkeypatch.setattr(host, "_BAND", [])
    monkeypatch.setattr(host.os, "cpu_count", lambda: 2)
    assert host.load_band(None) is None
    assert [host.load_band(load) for load in (0.1, 0.6, 0.74, 0.3)] == [0, 0, 0, 0]
    assert host.load_band(0.8) == 1  # a core's worth of other work
    assert [host.load_band(load) for load in (0.4, 1.6, 1.3)] == [1, 1, 1]
    assert host.load_band(1.8) == 2 and host.load_band(7.0) == 2  # at most every core
    assert host.load_band(0.2) == 0


def _counting_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, stride=2, padding=1),
        nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4),
    ).eval()  # fmt: skip


def test_the_schedule_is_measured_once_and_again_only_in_another_load_band(two_cores):
    """Each run split its batches between the schedules on the noise of the batches it
    timed (mnasnet0_5's naive 3.5 s then 4.7 s for the same call). The decision is now
    measured on one batch, kept, and measured again only when the load changes band."""
    load = two_cores
    explainer = krypton.OcclusionExplainer(_counting_model())
    image = torch.rand(3, 32, 32)
    settings = dict(patch=8, stride=4, batch_size=8, mode="naive", label=0)  # 49 positions
    first = explainer.explain(image, **settings)
    assert explainer.schedules.measurements == 1
    decided = first.extra["host"]["decisions"]["naive"]
    assert decided["measured"] == "in this run" and decided["band"] == 0
    assert set(decided["ms_per_position"]) == {str(TWO), str(WORKERS)}
    assert first.extra["scheduling_seconds"] > 0  # shown, and kept out of the batches' time
    ran = first.extra["host"]["schedules"]
    # never mixed (a last batch of one position is one shard: on one thread)
    assert set(ran) <= {decided["schedule"], "one thread"} and ran[decided["schedule"]] >= 48
    assert sum(ran.values()) == 49
    again = explainer.explain(image, **settings)
    assert explainer.schedules.measurements == 1  # no measurement the second time
    kept = again.extra["host"]["decisions"]["naive"]
    assert kept["measured"].startswith("at ") and kept["schedule"] == decided["schedule"]
    assert "scheduling_seconds" not in again.extra
    assert again.extra["host"]["schedules"] == ran
    load[0] = 0.5  # a wobble within the band: nothing measured
    explainer.explain(image, **settings)
    assert explainer.schedules.measurements == 1
    load[0] = 2.0  # two busy cores: another band, measured there once
    busy = explainer.explain(image, **settings)
    assert explainer.schedules.measurements == 2
    assert busy.extra["host"]["band"] == 2
    assert busy.extra["host"]["decisions"]["naive"]["measured"] == "in this run"
    explainer.explain(image, **settings)
    assert explainer.schedules.measurements == 2
    assert "naive batches on" in host.describe_share(busy.extra["host"])


def test_exact_on_a_naive_plan_runs_naives_schedule(two_cores):
    """Where the plan is naive, exact and naive mode do the same arithmetic: they now run
    it on the one decision for naive batches, not each on its own draw of the noise."""
    explainer = krypton.OcclusionExplainer(_counting_model())
    image = torch.rand(3, 32, 32)
    settings = dict(patch=8, stride=4, batch_size=8, label=0)
    naive = explainer.explain(image, mode="naive", **settings)
    exact = explainer.explain(image, mode="exact", strategy="naive", **settings)
    assert explainer.schedules.measurements == 1
    assert (
        exact.extra["host"]["decisions"]["naive"]["schedule"]
        == (naive.extra["host"]["decisions"]["naive"]["schedule"])
    )
    assert exact.extra["host"]["schedules"] == naive.extra["host"]["schedules"]
    np.testing.assert_array_equal(exact.values, naive.values)


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


def test_the_record_says_which_schedule_ran_and_the_callers_threads_come_back(two_cores):
    two_cores[0] = 2.0  # a busy host
    before = torch.get_num_threads()
    model = krypton.registry.load_model("fundus-demo")
    image = torch.zeros(3, *model.input_size)
    heatmap = krypton.OcclusionExplainer(model).explain(
        image, patch=16, stride=16, batch_size=8, strategy="incremental"
    )
    record = heatmap.extra["host"]
    assert record["by"] == "load" and record["budget"] == 2
    decided = record["decisions"]["incremental"]
    # a busy host: the workers are measured against one thread, and the faster one runs
    assert set(decided["ms_per_position"]) == {str(WORKERS), str(ONE)}
    assert decided["schedule"] in record["schedules"]
    assert sum(record["schedules"].values()) == heatmap.positions_evaluated
    assert f"incremental batches on {decided['schedule']}" in host.describe_share(record)
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


def test_the_apps_runtime_log_keeps_each_runs_schedule(two_cores, monkeypatch, tmp_path):
    """The decision is the process's; the per-host runtime log keeps the schedule each of
    the app's runs ran on, its margin, its load band and whether that run measured it."""
    import json

    from PIL import Image

    from krypton.runtime_log import runtime_log_path
    from krypton.synthetic.fundus import FundusGenerator
    from webapp import runs
    from webapp.services import Services

    monkeypatch.setattr(host, "host_load", lambda interval=0.1: 0.0)  # the app's own sample
    monkeypatch.setattr(host, "_TORCH_DEFAULT", 2)
    torch.set_num_threads(2)
    services = Services(tmp_path / "cache")
    image = Image.fromarray(FundusGenerator(seed=3).sample(label=1, lesions=1).image)
    request = runs.RunRequest(
        key=services.images.put(image), name="fundus.png", model="fundus-demo", patch=16,
        stride=8, mode="naive", fill_rgb=(0.5, 0.5, 0.5), region=(0, 0, 96, 96),
    )  # fmt: skip
    runs.execute(services, "schedule-log", request, lambda *args: None)
    rows = [json.loads(line) for line in runtime_log_path().read_text().splitlines()]
    logged = rows[-1]["schedules"]["naive"]
    assert logged["measured"] == "in this run" and logged["band"] == 0
    assert logged["schedule"] in {str(TWO), str(WORKERS)} and logged["margin"] > 0


def test_a_progress_callback_may_stop_a_run_between_a_measurements_runs(two_cores, monkeypatch):
    """The first whole batch of a kind runs on every option twice, alternated; a Cancel
    (the app's progress callback raising) waited for all four runs (5.8 s beside two
    burners, where it had taken 0.9 s). Progress is reported, unchanged, between them."""

    class Cancelled(Exception):
        pass

    runs: list[Schedule] = []
    real = schedule.run_scheduled

    def counted(option: Schedule, *args, **kwargs):  # type: ignore[no-untyped-def]
        runs.append(option)
        return real(option, *args, **kwargs)

    monkeypatch.setattr(schedule, "run_scheduled", counted)
    reports: list[int] = []

    def cancel_at_the_first_report(done: int, total: int) -> None:
        reports.append(done)
        raise Cancelled

    explainer = krypton.OcclusionExplainer(_counting_model())
    with pytest.raises(Cancelled):
        explainer.explain(torch.rand(3, 32, 32), patch=8, stride=4, batch_size=8, mode="naive",
                          label=0, progress=cancel_at_the_first_report)  # fmt: skip
    assert reports == [0] and len(runs) == 1  # stopped after the measurement's first run
    assert explainer.schedules.measurements == 0  # nothing decided on a part-measurement
