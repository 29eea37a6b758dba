"""The method comparison's controls: each demo architecture trained without occluded inputs.

    python -m demo.controls [--only fundus|chestct] [--dir out/controls]   (make controls)

Both demo models saw occlusion's own fill while they learnt (gray boxes over fundus
images, parenchyma cubes in chest-CT crops), and that fill is also Integrated Gradients'
baseline and the deletion curves' fill, so a comparison on them favours occlusion and IG
by construction. A control is the same architecture trained from scratch on the same
generator with the same targets and optimiser but no occluder in any training input. The
fundus control follows the shipped model's whole schedule (four stages, their seeds,
epochs and learning rates) and its very draws, each gray box drawn and left off, so it
differs from the shipped model in the occluder alone (3,300 steps of 32 images: 88 min
where the shipped model was trained, 1.2 s a step, and 4.9 h on a 2-core host that takes
5.3 s a step; kept in out/progress/ after every epoch so that a stopped run resumes; the
first-stage control it replaces read 95.2% held out against the shipped 98.2%, so the
drop from shipped to control could not be put on the occluder). The chest control is on
a shorter schedule (5-13 min; 93.5-96.3% held out, by the host, against 98.0%). Its entry
(``fundus-control``, ``chestct-control``) sits in ``--dir``, outside the shipped models,
with its training record and its accuracy on the held-out sets the shipped cards use.
``bench.methods --controls DIR`` runs the whole comparison on it beside the shipped model.

The data-randomisation control (``chestct-shuffled``; Adebayo et al., 2018, section 3.2)
is the chest control's network trained to fit shuffled labels: a method whose maps on it
look like its maps on the chest control is not reading what the model learnt from the
labels. It is trained for the chest model only, where it takes minutes.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from demo.fundus.progress import PROGRESS_ROOT
from demo.fundus.progress import discard as discard_progress
from krypton.registry.entries import write_entry

ROOT = Path(__file__).resolve().parents[1]
CONTROL_DIR = ROOT / "out" / "controls"
SHIPPED_DIR = ROOT / "krypton" / "shipped_models"
# shipped model: its control
CONTROLS = {
    "fundus-demo": "fundus-control",
    "fundus-hard-demo": "fundus-hard-control",  # the harder generator's (demo.fundus.data)
    "chestct-demo": "chestct-control",
}
# shipped model: its data-randomisation control (its control's architecture fitted to
# shuffled labels, SHUFFLED_SCHEDULE); the chest model only, where it takes minutes
SHUFFLED = {"chestct-demo": "chestct-shuffled"}
# The controls' schedules: the shipped fundus model's four stages (10, 10, 8 and 5 epochs
# of 3,200 images; 124 s an epoch where the shipped model was trained, 530 s on a slower
# 2-core host), and the chest trainer's
# two-stage shape at a third of its first stage.
FUNDUS_SCHEDULE = {"epochs": 10, "images_per_epoch": 3200, "later_epochs": (8, 5)}
# a control's held-out accuracy within this of the shipped model's: the tables say so
# where it is not (the drop from shipped to control is then partly the accuracy's)
ACCURACY_MATCH = 0.01
CHEST_SCHEDULE = (
    {"crop": 32, "steps": 600, "batch": 32},
    {"crop": 48, "steps": 60, "batch": 16},
)


def train_fundus_control(
    log=print, task=None, progress: Path | None = None, **schedule
) -> tuple[torch.nn.Module, dict]:
    """ResNet18 on the shipped fundus model's schedule and draws with every gray box left
    off (demo.fundus.train.train_stages without the occluder; ``schedule``: its epochs,
    images_per_epoch and later_epochs, default :data:`FUNDUS_SCHEDULE`), on ``task``'s
    generator (default today's); its held-out accuracy (seed 3, 600 images). With
    ``progress`` a stopped run resumes from that folder (demo.fundus.progress)."""
    from demo.fundus import train as fundus
    from demo.fundus.data import TODAY
    from demo.fundus.evaluate import accuracy

    task = task or TODAY
    model, record = fundus.train_stages(**{**FUNDUS_SCHEDULE, **schedule}, log=log,
                                        occluder=False, task=task, progress=progress)  # fmt: skip
    with torch.inference_mode():
        record["held_out_accuracy"] = accuracy(model, task=task)
    return model, record


def train_harder_control(
    log=print, progress: Path | None = None, **schedule
) -> tuple[torch.nn.Module, dict]:
    """:func:`train_fundus_control` on the harder generator (look-alikes on every eye):
    the control of fundus-hard-demo."""
    from demo.fundus.data import HARDER

    return train_fundus_control(log, HARDER, progress, **schedule)


def train_chest_control(log=print) -> tuple[torch.nn.Module, dict]:
    """ct3d-small from scratch on a ChestCTGenerator(seed=1) pool, the first stage's
    targets, no parenchyma cube in any crop; its held-out accuracy (seed 3, 600 volumes)."""
    from demo.chestct import train as chest

    model, record = chest.train(pool_size=1500, stages=CHEST_SCHEDULE, log=log, occluded=False)
    with torch.inference_mode():
        record["held_out_accuracy"] = chest.accuracy(model, chest.held_out())
    return model, record


# The data-randomisation control's schedule: Adebayo et al. train on the permuted labels
# until the network fits them (over 95% of the training set). On the chest control's
# own schedule (1,500 volumes, 32-voxel crops) it fitted nothing (51% on its shuffled
# labels: an untrained network, not a control), so it sees a small pool whole, often.
SHUFFLED_POOL = 96
SHUFFLED_SCHEDULE = ({"crop": 48, "steps": 600, "batch": 16},)


def train_chest_shuffled(log=print) -> tuple[torch.nn.Module, dict]:
    """The data-randomisation control (Adebayo et al., 2018, section 3.2): the chest
    control's architecture, no occluder, trained to fit a small pool's shuffled labels
    (each volume whole, its target its shuffled label); the record says how well it
    fitted them (``last_train_accuracy``) and its held-out accuracy (near chance)."""
    from demo.chestct import train as chest

    model, record = chest.train(
        pool_size=SHUFFLED_POOL, stages=SHUFFLED_SCHEDULE, log=log, occluded=False,
        shuffled=True,
    )  # fmt: skip
    with torch.inference_mode():
        record["held_out_accuracy"] = chest.accuracy(model, chest.held_out())
    return model, record


def write_control(
    shipped: str,
    module: torch.nn.Module,
    record: dict,
    directory: Path = CONTROL_DIR,
    name: str | None = None,
) -> Path:
    """The control's float16 weights and registry entry in ``directory`` (``name``:
    default the shipped model's no-fill control's): the model's preprocessing, classes and
    patch (a fundus task's :func:`demo.fundus.train.registry_fields`, else the shipped
    entry's), with its own name, weights and training record (no evaluation,
    out-of-distribution check or tuning: it is not for use)."""
    directory.mkdir(parents=True, exist_ok=True)
    name = name or CONTROLS[shipped]
    shuffled = name == SHUFFLED.get(shipped)
    from demo.fundus.data import TASKS
    from demo.fundus.train import registry_fields

    task = TASKS.get(shipped)  # a fundus task's fields, shipped or not; else the shipped entry
    if task is not None:
        entry = registry_fields(task, record)
    else:
        entry = json.loads((SHIPPED_DIR / f"{shipped}.json").read_text())
    for kept_apart in ("evaluation", "ood", "tuning", "calibration", "default"):
        entry.pop(kept_apart, None)
    state = {k: v.half() if v.is_floating_point() else v for k, v in module.state_dict().items()}
    torch.save(state, directory / f"{name}.pt")
    entry.update(
        {
            "name": name,
            "description": (
                f"Data-randomisation control for {shipped}: its no-fill control's "
                "architecture fitted to shuffled labels, for the method comparison only."
                if shuffled
                else f"Control for {shipped}: the same architecture trained without "
                "occluded inputs, for the method comparison only."
            ),
            "weights": {"source": "file", "path": f"{name}.pt", "format": "state_dict"},
            "training": record,
        }
    )
    path = directory / f"{name}.json"
    write_entry(path, entry)
    return path


# (shipped model, control, trainer)
TRAINERS = (
    ("fundus-demo", CONTROLS["fundus-demo"], train_fundus_control),
    ("fundus-hard-demo", CONTROLS["fundus-hard-demo"], train_harder_control),
    ("chestct-demo", CONTROLS["chestct-demo"], train_chest_control),
    ("chestct-demo", SHUFFLED["chestct-demo"], train_chest_shuffled),
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", help="the controls whose names start so (fundus, chestct, chestct-shuffled)"
    )
    parser.add_argument("--dir", type=Path, default=CONTROL_DIR)
    parser.add_argument("--force", action="store_true", help="retrain a control already there")
    parser.add_argument(
        "--fundus-epochs",
        type=int,
        default=FUNDUS_SCHEDULE["epochs"],
        help="epochs of 3,200 images in the fundus control's first two stages (10: shipped)",
    )
    args = parser.parse_args(argv)
    chosen = [t for t in TRAINERS if not args.only or t[1].startswith(args.only)]
    if not chosen:
        parser.error(f"no control's name starts with {args.only!r}")
    for shipped, name, trainer in chosen:
        if (args.dir / f"{name}.json").exists() and not args.force:
            print(f"{name}: already in {args.dir} (--force retrains it)")
            continue
        started = time.perf_counter()
        fundus = trainer in (train_fundus_control, train_harder_control)
        progress = PROGRESS_ROOT / name  # the fundus controls' hours survive a stop
        schedule = {"epochs": args.fundus_epochs, "progress": progress} if fundus else {}
        module, record = trainer(**schedule)
        path = write_control(shipped, module, record, args.dir, name)
        discard_progress(progress)
        print(
            f"wrote {path}: held-out accuracy {record['held_out_accuracy']:.3f}, "
            f"{time.perf_counter() - started:.0f} s"
        )


if __name__ == "__main__":
    main()
