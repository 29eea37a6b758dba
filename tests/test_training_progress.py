"""Fundus training survives a stop (demo.fundus.progress): the four-stage recipe takes
1.5 to 5 hours on two cores, and a stopped run used to start again from nothing."""

from __future__ import annotations

import pytest
import torch

from demo.fundus import train as fundus
from demo.fundus.progress import ProgressMismatch, discard


class _Stop(Exception):
    """The user's Ctrl-C, or a session that ends, after a given epoch's line."""


def _tiny_net(architecture: str = "resnet18") -> torch.nn.Module:
    """A small stand-in for ResNet18 with the parts whose state a resume must carry: a
    convolution, a batch norm with running statistics, a linear head."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 7, stride=8),
        torch.nn.BatchNorm2d(4),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(4, 3),
    )


def _stopping_at(line: str, lines: list[str]):
    def log(message: str) -> None:
        lines.append(message)
        if message.startswith(line):
            raise _Stop(message)

    return log


SCHEDULE = dict(epochs=2, images_per_epoch=32, later_epochs=(1, 2), occluder=False)


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setattr(fundus, "build_model", _tiny_net)


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one reduction order in every run compared
    yield
    torch.set_num_threads(threads)


def test_a_stopped_run_resumes_and_ends_with_the_weights_of_an_unbroken_one(
    tiny, one_thread, tmp_path
):
    unbroken, unbroken_record = fundus.train_stages(**SCHEDULE, log=lambda *_: None)
    progress = tmp_path / "progress"
    lines: list[str] = []

    def run(stop_at: str | None):
        lines.clear()
        log = _stopping_at(stop_at, lines) if stop_at else lines.append
        return fundus.train_stages(**SCHEDULE, log=log, progress=progress)

    with pytest.raises(_Stop):  # stage 1 stopped after its first epoch of two
        run("epoch 1/2")
    with pytest.raises(_Stop):  # resumed: stage 1's second epoch, then stopped
        run("epoch 2/2")
    assert lines[0] == f"resuming from {progress}: stage 1 after epoch 1/2"
    assert lines[1].startswith("resuming after epoch 1/2")
    with pytest.raises(_Stop):  # stage 1 finishes without training; stage 2 stops
        run("epoch 1/2")
    assert (progress / "stage-0.done.pt").exists()
    assert not (progress / "stage-0.epoch.pt").exists()

    resumed, record = run(None)
    assert lines[0] == f"resuming from {progress}: 1 stage(s) finished, stage 2 after epoch 1/2"
    for name, value in unbroken.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name
    assert [s["epochs"] for s in record["stages"]] == [2, 2, 1, 2]
    assert [s["initial_weights"] for s in record["stages"]] == [
        s["initial_weights"] for s in unbroken_record["stages"]
    ]
    assert record["train_seconds"] > 0


def test_progress_of_another_schedule_is_refused_not_mixed_in(tiny, tmp_path):
    progress = tmp_path / "progress"
    with pytest.raises(_Stop):
        fundus.train_stages(**SCHEDULE, log=_stopping_at("epoch 1/2", []), progress=progress)
    with pytest.raises(ProgressMismatch, match="another training schedule"):
        fundus.train_stages(**{**SCHEDULE, "epochs": 3}, log=lambda *_: None, progress=progress)
    discard(progress)
    assert not progress.exists()
    fundus.train_stages(**{**SCHEDULE, "epochs": 1}, log=lambda *_: None, progress=progress)
