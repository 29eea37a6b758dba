"""The engine takes its share of a busy host for every caller — the library, the CLI, the
drop-ins, batch — not only the app: torch's threads are the caller's where the caller set
them (kept, and restored after the run), else the cores the host's other work leaves
free; the choice and its load are in the run's record. Beside a running test suite
(load ~19 on 2 cores) ResNet18's exact run took 62.1 s with torch's default 2 threads and
17.3 s with one, slower than naive at the default."""

from __future__ import annotations

import pytest
import torch

import krypton
from krypton import host, schedule
from krypton.schedule import INTRA


@pytest.fixture
def model():
    return krypton.registry.load_model("fundus-demo")


@pytest.fixture
def image(model):
    return torch.zeros(3, *model.input_size)


@pytest.fixture
def untouched(monkeypatch):
    """A caller who set no threads: torch at its default, no thread variables."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("KRYPTON_TORCH_THREADS", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setattr(host, "_TORCH_DEFAULT", 2)
    # this test process set torch's count long ago (its fixtures do): a count the test
    # sets from here on is the caller's (a fresh process: tests/test_caller_threads.py)
    monkeypatch.setattr(
        host.torch_threads, "callers_count",
        lambda: None if torch.get_num_threads() == 2 else torch.get_num_threads(),
    )  # fmt: skip
    monkeypatch.setattr(host, "_MAX_THREADS", [2])
    monkeypatch.setattr(host, "_LAST_LOAD", [])
    monkeypatch.setattr(host, "_BAND", [])
    monkeypatch.setattr(host.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(host, "_own_cores", lambda: 0.0)  # the load is other processes'
    # the threads a run takes, seen in its own thread: held to the intra-op schedule (the
    # inter-position one runs its shards on one thread each; tests/test_schedule.py)
    offered = schedule.schedule_options
    monkeypatch.setattr(
        schedule, "schedule_options", lambda *args: [o for o in offered(*args) if o.kind == INTRA]
    )
    yield
    torch.set_num_threads(before)


def _decision(record: dict) -> dict:
    """The threads of a run's host record, who chose them and the load they were chosen at."""
    return {key: record[key] for key in ("threads", "by", "load")}


def _threads_during(model, image, **options) -> tuple[krypton.Heatmap, set[int]]:
    seen: set[int] = set()
    heatmap = krypton.explain(
        model, image, patch=56, stride=56,
        progress=lambda done, total: seen.add(torch.get_num_threads()), **options,
    )  # fmt: skip
    return heatmap, seen


def test_a_busy_host_gets_one_thread_and_the_callers_count_comes_back(
    model, image, untouched, monkeypatch
):
    monkeypatch.setattr(host, "host_load", lambda interval=0.1: 2.0)  # two burners
    heatmap, seen = _threads_during(model, image)
    assert seen == {1}
    assert _decision(heatmap.extra["host"]) == {"threads": 1, "by": "load", "load": 2.0}
    assert heatmap.extra["host"]["budget"] == 2  # the shards' workers may use both
    assert torch.get_num_threads() == 2  # restored


def test_an_idle_host_keeps_every_core(model, image, untouched, monkeypatch):
    monkeypatch.setattr(host, "host_load", lambda interval=0.1: 0.1)
    heatmap, seen = _threads_during(model, image)
    assert seen == {2} and heatmap.extra["host"]["by"] == "load"


def test_a_runs_own_earlier_work_is_not_a_busy_host(model, image, untouched, monkeypatch):
    """The load read since the last sample counted this process's own earlier runs: a
    loop that alternated exact and naive runs on an idle host saw two busy cores and ran
    exact on one thread (ResNet18 alone 2.34x naive where 3.0x had been measured). Its
    own cores are taken off while none of its runs is in flight; while one is (the app's
    other tab), they are work the new run competes with."""
    import threading

    monkeypatch.setattr(host, "host_load", lambda interval=0.1: 2.0)  # every core busy...
    monkeypatch.setattr(host, "_own_cores", lambda: 1.8)  # ...most of it by this process
    heatmap, seen = _threads_during(model, image)
    assert seen == {2} and heatmap.extra["host"]["load"] == pytest.approx(0.2)

    monkeypatch.setattr(host, "_LAST_LOAD", [])
    inside, leave = threading.Event(), threading.Event()

    def another_run() -> None:
        with host.host_share():
            inside.set()
            leave.wait(30)

    other = threading.Thread(target=another_run)
    other.start()
    try:
        assert inside.wait(30)
        monkeypatch.setattr(host, "_LAST_LOAD", [])
        heatmap, seen = _threads_during(model, image)
    finally:
        leave.set()
        other.join()
    assert seen == {1} and heatmap.extra["host"]["load"] == 2.0


def test_a_callers_own_thread_count_is_kept(model, image, untouched, monkeypatch):
    monkeypatch.setattr(host, "host_load", lambda interval=0.1: 2.0)
    torch.set_num_threads(1)  # the caller's choice, however busy the host is
    heatmap, seen = _threads_during(model, image)
    assert seen == {1}
    assert _decision(heatmap.extra["host"]) == {
        "threads": 1, "by": "torch.set_num_threads", "load": None
    }  # fmt: skip
    assert heatmap.extra["host"]["schedules"] == {"one thread": 16}  # nothing more
    torch.set_num_threads(2)
    heatmap, seen = _threads_during(model, image, threads=2)  # an argument wins
    assert seen == {2} and heatmap.extra["host"]["by"] == "threads="
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("name", ["KRYPTON_TORCH_THREADS", "OMP_NUM_THREADS"])
def test_a_thread_variable_is_the_callers_choice(model, image, untouched, monkeypatch, name):
    monkeypatch.setattr(host, "host_load", lambda interval=0.1: 2.0)
    monkeypatch.setenv(name, "2")
    heatmap, seen = _threads_during(model, image)
    assert seen == {2} and heatmap.extra["host"]["by"] == name


def test_a_bad_thread_count_is_refused(model, image):
    with pytest.raises(ValueError, match="threads must be at least 1"):
        krypton.explain(model, image, patch=56, stride=56, threads=0)


def test_the_cli_says_how_many_threads_it_took(fundus_png, tmp_path, capsys):
    from krypton.cli import main

    assert main(["explain", str(fundus_png), "--out", str(tmp_path / "h.png"), "--stride", "56",
                 "--patch", "56"]) == 0  # fmt: skip
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("threads "))
    assert "torch thread" in line and ("caller set (" in line or "load" in line)


def test_the_drop_ins_take_the_same_share(untouched, monkeypatch):
    """Captum's and MONAI's occlusion through Krypton's drop-ins run the engine beside a
    busy host with the threads it leaves, and give the caller's count back."""
    import torchvision

    from krypton.captum import Occlusion
    from krypton.monai import OcclusionSensitivity

    monkeypatch.setattr(host, "host_load", lambda interval=0.1: 2.0)
    net = torchvision.models.resnet18(num_classes=3).eval()
    image = torch.rand(1, 3, 64, 64)
    seen: set[int] = set()
    hook = net.layer1.register_forward_hook(lambda *a: seen.add(torch.get_num_threads()))
    occlusion = Occlusion(net)
    occlusion.attribute(image, sliding_window_shapes=(3, 16, 16), strides=(3, 16, 16), target=0)
    assert seen == {1} and torch.get_num_threads() == 2
    assert _decision(occlusion.last_host) == {"threads": 1, "by": "load", "load": 2.0}
    seen.clear()
    sensitivity = OcclusionSensitivity(net, mask_size=16, overlap=0.0)
    sensitivity(image)
    hook.remove()
    assert sensitivity.last_engine == "krypton" and seen == {1}
    assert _decision(sensitivity.last_host) == {"threads": 1, "by": "load", "load": 2.0}
    assert torch.get_num_threads() == 2
