"""Fundus training that survives an interruption.

The four-stage recipe takes 1.5 to 5 hours on two cores, and a laptop that sleeps or a
session that ends would otherwise throw it all away. A :class:`TrainingProgress` folder
keeps each finished stage (its float32 weights, from which the next stage takes its
float16 start as an unbroken run does, and its record) and, inside a stage, the state
after its last whole epoch: the weights, the optimiser's and the learning-rate schedule's
state, torch's and the image generator's random states and the seconds spent. A run
started again with the same schedule picks up after that epoch and ends with the same
weights as one that was never stopped (tests/test_training_progress.py); one started with
another schedule is refused, not mixed in.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
# where a training run keeps its progress until its model is written: out/progress/<name>
PROGRESS_ROOT = ROOT / "out" / "progress"
# what each epoch checkpoint and finished stage is stored as, inside the folder
EPOCH_FILE = "stage-{index}.epoch.pt"
STAGE_FILE = "stage-{index}.done.pt"
SCHEDULE_FILE = "schedule.json"


class ProgressMismatch(ValueError):
    """Saved progress belongs to another schedule than the one asked for."""


def _atomic_save(payload: object, path: Path) -> None:
    """Write ``path`` whole or not at all: a run killed mid-write leaves the last epoch."""
    partial = path.with_name(path.name + ".partial")
    torch.save(payload, partial)
    os.replace(partial, path)


def discard(folder: Path) -> None:
    """Remove a run's saved progress (its model is written); nothing there is fine."""
    if not folder.exists():
        return
    for path in folder.iterdir():
        path.unlink()
    folder.rmdir()


class TrainingProgress:
    """One training run's saved progress in ``folder``, for the run described by
    ``schedule`` (a JSON-able dict: what the run trains, on what, for how long)."""

    def __init__(self, folder: Path, schedule: dict) -> None:
        self.folder = Path(folder)
        self.schedule = schedule
        saved = self.folder / SCHEDULE_FILE
        if saved.exists():
            kept = json.loads(saved.read_text())
            if kept != json.loads(json.dumps(schedule)):
                raise ProgressMismatch(
                    f"{self.folder} holds progress of another training schedule ({kept}); "
                    "delete that folder to start this one afresh"
                )

    def _start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / SCHEDULE_FILE).write_text(json.dumps(self.schedule, sort_keys=True))

    def finished_stage(self, index: int) -> tuple[dict, dict] | None:
        """Stage ``index``'s weights (float32, as it ended) and training record, if it
        finished."""
        path = self.folder / STAGE_FILE.format(index=index)
        if not path.exists():
            return None
        saved = torch.load(path, map_location="cpu", weights_only=False)
        return saved["state"], saved["record"]

    def keep_stage(self, index: int, state: dict, record: dict) -> None:
        """Stage ``index`` finished: keep its weights and record, drop its epoch state."""
        self._start()
        _atomic_save(
            {"state": state, "record": record}, self.folder / STAGE_FILE.format(index=index)
        )
        (self.folder / EPOCH_FILE.format(index=index)).unlink(missing_ok=True)

    def epochs(self, index: int) -> EpochCheckpoint:
        """Where stage ``index`` keeps its state after each whole epoch."""
        return EpochCheckpoint(self, self.folder / EPOCH_FILE.format(index=index))

    def describe(self) -> str | None:
        """Where a resumed run stands, in words; None when nothing is saved."""
        if not self.folder.exists():
            return None
        done = sorted(p.name for p in self.folder.glob(STAGE_FILE.format(index="*")))
        epoch_files = sorted(self.folder.glob(EPOCH_FILE.format(index="*")))
        words = [f"{len(done)} stage(s) finished"] if done else []
        for path in epoch_files:
            saved = torch.load(path, map_location="cpu", weights_only=False)
            stage = int(path.name.split(".")[0].split("-")[1]) + 1  # files count from 0
            words.append(f"stage {stage} after epoch {saved['epoch'] + 1}/{saved['epochs']}")
        return ", ".join(words) or None


class EpochCheckpoint:
    """One stage's state after its last whole epoch (see the module's docstring)."""

    def __init__(self, progress: TrainingProgress, path: Path) -> None:
        self.progress = progress
        self.path = path

    def load(self, config: dict) -> dict | None:
        """The saved state of the stage trained with ``config``, or None to start it."""
        if not self.path.exists():
            return None
        saved = torch.load(self.path, map_location="cpu", weights_only=False)
        if saved["config"] != config:
            raise ProgressMismatch(
                f"{self.path} was saved by a stage trained otherwise ({saved['config']}); "
                f"delete {self.progress.folder} to start afresh"
            )
        return saved

    def keep(
        self,
        config: dict,
        epoch: int,
        epochs: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        schedule: torch.optim.lr_scheduler.LRScheduler,
        generator_state: Mapping[str, Any],
        seconds: float,
    ) -> None:
        """Keep the state after ``epoch`` (0-based) of ``epochs``."""
        self.progress._start()
        _atomic_save(
            {
                "config": config,
                "epoch": epoch,
                "epochs": epochs,
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "schedule": schedule.state_dict(),
                "torch_rng": torch.get_rng_state(),
                "generator_rng": generator_state,
                "seconds": seconds,
                "saved_at": time.strftime("%Y-%m-%d %H:%M:%S"),
            },
            self.path,
        )
