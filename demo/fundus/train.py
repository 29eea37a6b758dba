"""Train and evaluate the fundus-lesion demo model (torchvision ResNet18, 3 classes).

    python -m demo.fundus.train train        # 1.5-5 h on 2 cores; writes shipped_models/
    python -m demo.fundus.train third-stage  # stage 3 only, from the two-stage model
    python -m demo.fundus.train fourth-stage # stage 4 only, from the three-stage model
    python -m demo.fundus.train evaluate     # every number of the model card
    python -m demo.fundus.train train --task fundus-hard-demo   # the same recipe on the
                                             # harder generator (look-alikes on every eye),
                                             # into out/harder: make harder

Seeded and reproducible: training images come from FundusGenerator(seed=1), in the
second stage seed 7, in the third seed 11 and in the fourth seed 13 — fresh streams (the
model never sees the same image twice);
held-out test images from seed 3, the pointing-game set from seed 4, the
out-of-distribution reference from seeds 5 (fit) and 6 (calibration), its test from seed
9, multi-lesion images from seed 8;
the independent generator (demo.fundus.independent) and the real samples are never
trained on. Weights are stored as float16 (22 MB).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from demo.fundus.data import (
    HEATMAP_PATCH,
    MODEL_DIR,
    ROOT,
    SECOND_STAGE_SEED,
    TASKS,
    TODAY,
    TRAIN_SEED,
    Task,
    _batch,
    build_model,
)  # fmt: skip
from demo.fundus.evaluate import (
    EVALUATION_PARTS,
    evaluate,
    fit_ood,
    merge_evaluation,
)  # fmt: skip
from demo.fundus.progress import PROGRESS_ROOT, EpochCheckpoint, TrainingProgress
from demo.fundus.progress import discard as discard_progress
from krypton.registry.entries import write_entry
from krypton.registry.models import IMAGENET_MEAN, IMAGENET_STD
from krypton.synthetic.fundus import CLASSES, IMAGE_SIZE, FundusGenerator


def train(
    epochs: int = 6,
    images_per_epoch: int = 2400,
    batch_size: int = 32,
    seed: int = TRAIN_SEED,
    log=print,
    architecture: str = "resnet18",
    label_smoothing: float = 0.1,
    initial_weights: Path | dict | None = None,
    learning_rate: float = 2e-3,
    graded: bool = False,
    partial: bool = False,
    occluded: bool = True,
    occluder: bool = True,
    task: Task = TODAY,
    checkpoint: EpochCheckpoint | None = None,
) -> tuple[torch.nn.Module, dict]:
    """Train from scratch; returns the eval-mode model and a training record. Without
    ``occluded`` no training image carries a gray box and none is drawn (the method
    comparison's first-stage control); without ``occluder`` the boxes are drawn as the
    shipped recipe draws them and left off (:func:`demo.fundus.data._batch`): the same
    images, the occluder alone removed. ``task``: today's generator or the harder one.

    Label smoothing keeps the softmax off its saturated ends, so occluding one of several
    lesions still lowers the probability measurably (a saturated model's heatmap of a
    multi-lesion image is flat: p stays 1.0 in float32 whatever one patch hides).

    With ``checkpoint`` the state after each whole epoch is kept there, and a run that
    finds one saved by the same configuration continues after it (demo.fundus.progress)."""
    torch.manual_seed(seed)
    generator = task.generator(seed)
    model = build_model(architecture)
    if initial_weights is not None:  # warm start: float16 weights load as float32
        state = (
            initial_weights
            if isinstance(initial_weights, dict)
            else torch.load(initial_weights, map_location="cpu", weights_only=True)
        )
        model.load_state_dict(
            {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
        )
    steps_per_epoch = images_per_epoch // batch_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=learning_rate, total_steps=epochs * steps_per_epoch
    )
    config = {
        "epochs": epochs, "images_per_epoch": images_per_epoch, "batch_size": batch_size,
        "seed": seed, "architecture": architecture, "label_smoothing": label_smoothing,
        "learning_rate": learning_rate, "graded": graded, "partial": partial,
        "occluded": occluded, "occluder": occluder, "task": task.name,
    }  # fmt: skip
    saved = checkpoint.load(config) if checkpoint is not None else None
    first_epoch, earlier_seconds = 0, 0.0
    if saved is not None:  # continue after the last whole epoch, exactly as if never stopped
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        schedule.load_state_dict(saved["schedule"])
        torch.set_rng_state(saved["torch_rng"])
        generator.rng.bit_generator.state = saved["generator_rng"]
        first_epoch, earlier_seconds = saved["epoch"] + 1, saved["seconds"]
        log(f"resuming after epoch {first_epoch}/{epochs} (saved {saved['saved_at']})")
    started = time.perf_counter() - earlier_seconds
    for epoch in range(first_epoch, epochs):
        model.train()
        correct = seen = 0
        loss_sum = 0.0
        for _ in range(steps_per_epoch):
            images, labels = _batch(
                generator, batch_size, gray_boxes=occluded, graded=graded, partial=partial,
                occluder=occluder,
            )  # fmt: skip
            logits = model(images)
            loss = (
                F.cross_entropy(logits, labels)  # soft targets carry their own smoothing
                if graded
                else F.cross_entropy(logits, labels, label_smoothing=label_smoothing)
            )
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            loss_sum += float(loss.detach()) * len(labels)
            classes = labels.argmax(1) if graded else labels
            correct += int((logits.argmax(1) == classes).sum())
            seen += len(labels)
        if checkpoint is not None:
            checkpoint.keep(
                config, epoch, epochs, model, optimizer, schedule,
                generator.rng.bit_generator.state, time.perf_counter() - started,
            )  # fmt: skip
        log(
            f"epoch {epoch + 1}/{epochs}: loss {loss_sum / seen:.4f}, train accuracy "
            f"{correct / seen:.3f}, {time.perf_counter() - started:.0f} s"
        )
    record = {
        "architecture": architecture,
        "epochs": epochs,
        "images_per_epoch": images_per_epoch,
        "batch_size": batch_size,
        "seed": seed,
        "generator": "with look-alikes (distractors=True)" if task.distractors else "today's",
        "label_smoothing": None if graded else label_smoothing,
        "gray_boxes": occluded and occluder,
        "targets": (
            "graded by evidence, every lesion visible (the shipped draws, no occluder)"
            if graded and not occluder
            else "graded by evidence, a fifth with one lesion hidden, a fifth with one partly "
            "hidden (target mixed by the share visible)"
            if partial
            else "graded by evidence, a quarter with one lesion hidden"
            if graded
            else "class"
        ),
        "occluder": occluded and occluder,
        "learning_rate": learning_rate,
        "initial_weights": (
            None
            if initial_weights is None
            else "given state"
            if isinstance(initial_weights, dict)
            else str(initial_weights)
        ),
        "train_seconds": round(time.perf_counter() - started, 1),
    }
    return model.eval(), record


@torch.no_grad()
def recalibrate_batch_norm(
    model: torch.nn.Module, batches: int = 30, seed: int = TRAIN_SEED
) -> None:
    """Re-estimate every batch norm's running statistics as exact averages over
    ``batches`` fresh training batches. Nets that keep them with a small momentum
    (torchvision's MobileNetV3: 0.01) have not converged after a short training, and
    then predict one class in eval mode whatever the image."""
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None  # cumulative average
    generator = FundusGenerator(seed=seed + 1)
    model.train()
    for _ in range(batches):
        images, _ = _batch(generator, 32, gray_boxes=True)
        model(images)
    model.eval()


DESCRIPTION = (
    "ResNet18 trained by this project at 224 x 224 on views of the real retina photograph "
    "shipped with scikit-image (crops at many zooms, the optic disc, the macula, the "
    "border, the whole fundus; colour, gray and green-channel renderings) with synthetic "
    "lesions planted at known positions: dark-red round microaneurysm-like dots and "
    "yellow-white irregular exudate-like patches of overlapping sizes, 1-4 per image "
    "(any exudate makes it EXUDATE). It learnt with lesions hidden under gray boxes, the "
    "fill its heatmaps use and Integrated Gradients' baseline, so a method comparison on "
    "it favours occlusion and IG over Grad-CAM; docs/models.md compares it with a control "
    "trained without any box. A demonstration model, not a medical device."
)
HARDER_DESCRIPTION = (
    "The fundus-demo recipe (ResNet18, four stages, lesions hidden under gray boxes) on "
    "the harder generator: every eye, normal ones too, also carries glares, light "
    "reflexes, pigment clumps and drusen as conspicuous as the lesions, which never "
    "decide the class, so a map that follows brightness or edges points at them and "
    "only one that follows the model points at the lesions. For the method comparison; "
    "not shipped. A demonstration model, not a medical device."
)


def registry_fields(task: Task, record: dict) -> dict:
    """The registry entry's fields every model of a fundus ``task`` carries (a control of
    it too, demo.controls): its name, weights file, preprocessing, classes, patch and the
    training ``record``."""
    return {
        "name": task.name,
        "description": DESCRIPTION if task == TODAY else HARDER_DESCRIPTION,
        "architecture": record.get("architecture", "resnet18"),
        "weights": {"source": "file", "path": task.weights_file, "format": "state_dict"},
        "input_size": [IMAGE_SIZE, IMAGE_SIZE],
        "patch": HEATMAP_PATCH,
        "mean": list(IMAGENET_MEAN),
        "std": list(IMAGENET_STD),
        "classes": list(CLASSES),
        "training": record,
    }


def save(
    model: torch.nn.Module,
    record: dict,
    directory: Path = MODEL_DIR,
    evaluation: dict | None = None,
    density=None,
    task: Task = TODAY,
) -> Path:
    """Write float16 weights, the out-of-distribution reference and the registry file of
    ``task``'s model; returns the registry file's path. Only today's task's model is the
    app's default and is chosen for photographs by modality."""
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(half_state(model), directory / task.weights_file)
    path = directory / task.registry_file
    entry = json.loads(path.read_text()) if path.exists() else {}
    entry.update(registry_fields(task, record))
    if task == TODAY:  # photographs: ophthalmic, external camera, or a Secondary Capture (OT)
        entry.update({"default": True, "modalities": ["OP", "XC", "OT"]})
    if evaluation is not None:
        entry["evaluation"] = evaluation
    if density is not None:
        density.save(directory / task.ood_file)
        entry["ood"] = {
            "path": task.ood_file,
            "threshold": density.threshold,
            "reference": density.reference,
        }
    write_entry(path, entry)
    return path


# file: (seed, what is planted); seeds picked for visible lesions, before any model saw them
GALLERY = {
    "fundus-microaneurysms.png": (101, {"kinds": ["MICROANEURYSM"] * 2, "view": "crop"}),
    "fundus-exudates.png": (104, {"kinds": ["EXUDATE"] * 2, "view": "crop"}),
    "fundus-normal-disc.png": (103, {"label": 0, "view": "anatomy"}),
}


def write_gallery(folder: Path = ROOT / "assets" / "samples") -> list[Path]:
    """The app's generated fundus samples (seeded, so the README screenshot can be
    reproduced from the gallery); colour renderings."""
    from PIL import Image

    written = []
    for name, (seed, plant) in GALLERY.items():
        sample = FundusGenerator(seed=seed).sample(rendering="colour", **plant)
        Image.fromarray(sample.image).save(folder / name)
        written.append(folder / name)
    return written


def half_state(model: torch.nn.Module) -> dict:
    """The weights as they are stored (float16)."""
    return {k: (v.half() if v.is_floating_point() else v) for k, v in model.state_dict().items()}


def _train_on(
    model: torch.nn.Module,
    epochs: int,
    images_per_epoch: int,
    seed: int,
    learning_rate: float,
    log,
    **options: Any,
):
    """A later stage: :func:`train` from ``model``'s weights as stored (float16) on the
    fresh image stream ``seed``; ``options`` are train's (``graded``, ``partial``,
    ``occluder``, ``task``, ``checkpoint``)."""
    return train(
        epochs,
        images_per_epoch,
        seed=seed,
        log=log,
        initial_weights=half_state(model),
        learning_rate=learning_rate,
        **options,
    )


THIRD_STAGE_SEED = 11


def train_third_stage(
    model: torch.nn.Module,
    epochs: int = 8,
    images_per_epoch: int = 3200,
    log=print,
    occluder: bool = True,
    task: Task = TODAY,
    checkpoint: EpochCheckpoint | None = None,
):
    """Stage 3, from the two-stage model's float16 weights on a fresh stream (seed 11,
    learning rate 5e-4): targets graded by evidence (:func:`evidence_target`), a quarter of
    the lesion images with one lesion hidden under a gray box. After stages 1-2 the model
    gave one lesion and four the same probability, so occluding one of several changed
    nothing (multi-lesion coverage 55%)."""
    return _train_on(
        model, epochs, images_per_epoch, THIRD_STAGE_SEED, 5e-4, log, graded=True,
        occluder=occluder, task=task, checkpoint=checkpoint,
    )  # fmt: skip


FOURTH_STAGE_SEED = 13


def train_fourth_stage(
    model: torch.nn.Module,
    epochs: int = 5,
    images_per_epoch: int = 3200,
    log=print,
    occluder: bool = True,
    task: Task = TODAY,
    checkpoint: EpochCheckpoint | None = None,
):
    """Stage 4, from the three-stage model's float16 weights on a fresh stream (seed 13,
    learning rate 3e-4): graded targets with lesions partly hidden as well as wholly
    (:func:`_batch` with ``partial``). After stage 3 a patch covering half a lesion already
    took the probability to its floor, so the lowest heatmap cell fell anywhere on a
    plateau up to 13 px from the lesion (strict pointing game 74%)."""
    return _train_on(
        model, epochs, images_per_epoch, FOURTH_STAGE_SEED, 3e-4, log, graded=True, partial=True,
        occluder=occluder, task=task, checkpoint=checkpoint,
    )  # fmt: skip


def train_stages(
    epochs: int = 10,
    images_per_epoch: int = 3200,
    log=print,
    occluder: bool = True,
    later_epochs: tuple[int, int] = (8, 5),
    task: Task = TODAY,
    progress: Path | None = None,
):
    """How the shipped fundus-demo was trained: stage 1 from scratch (seed 1, learning
    rate 2e-3), stage 2 from stage 1's float16 weights on a fresh image stream (seed 7,
    1e-3), each a one-cycle schedule (the training accuracy was still rising steeply at
    the end of stage 1, 93%, and 97% after stage 2), then :func:`train_third_stage` and
    :func:`train_fourth_stage` (``later_epochs``). Without ``occluder``: the same
    schedule, seeds and draws with every gray box left off (the method comparison's
    control, demo.controls). ``task``: the generator every stage draws from.

    ``progress``: a folder where finished stages and each stage's last whole epoch are
    kept (:class:`demo.fundus.progress.TrainingProgress`); a run stopped part way picks
    up there and ends with the weights an unbroken run ends with."""
    schedule = {
        "epochs": epochs, "images_per_epoch": images_per_epoch,
        "later_epochs": list(later_epochs), "occluder": occluder, "task": task.name,
    }  # fmt: skip
    kept = TrainingProgress(progress, schedule) if progress is not None else None
    if kept is not None and (where := kept.describe()):
        log(f"resuming from {progress}: {where}")
    stages = (
        lambda model, **more: train(
            epochs, images_per_epoch, seed=TRAIN_SEED, log=log, occluder=occluder, task=task,
            **more,
        ),
        lambda model, **more: _train_on(
            model, epochs, images_per_epoch, SECOND_STAGE_SEED, 1e-3, log, occluder=occluder,
            task=task, **more,
        ),
        lambda model, **more: train_third_stage(
            model, later_epochs[0], images_per_epoch, log=log, occluder=occluder, task=task,
            **more,
        ),
        lambda model, **more: train_fourth_stage(
            model, later_epochs[1], images_per_epoch, log=log, occluder=occluder, task=task,
            **more,
        ),
    )  # fmt: skip
    model, records = None, []
    for index, stage in enumerate(stages):
        finished = kept.finished_stage(index) if kept is not None else None
        if finished is not None:
            model = build_model()
            model.load_state_dict(finished[0])
            model.eval()
            record = finished[1]
        else:
            more = {"checkpoint": kept.epochs(index)} if kept is not None else {}
            model, record = stage(model, **more)
            if index:
                record["initial_weights"] = f"stage {index} (float16 weights)"
            if kept is not None:
                kept.keep_stage(index, model.state_dict(), record)
        records.append(record)
    return model, stages_record(records)


def stages_record(stages: list[dict]) -> dict:
    """The registry's training record for a model trained in these stages."""
    return {
        "architecture": "resnet18",
        "stages": stages,
        "images": sum(stage["epochs"] * stage["images_per_epoch"] for stage in stages),
        "train_seconds": round(sum(stage["train_seconds"] for stage in stages), 1),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
    }


# command: (how many earlier stages it starts from, the stage's training function)
LATER_STAGES = {"third-stage": (2, train_third_stage), "fourth-stage": (3, train_fourth_stage)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["train", *LATER_STAGES, "evaluate", "gallery"])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--images-per-epoch", type=int, default=3200)
    parser.add_argument("--pointing-images", type=int, default=100)
    parser.add_argument("--multi-images", type=int, default=40)
    parser.add_argument("--pointing-stride", type=int, default=4, help="strict pointing game")
    parser.add_argument(
        "--parts",
        default=",".join(EVALUATION_PARTS),
        help="evaluate: which numbers to re-measure (comma-separated, of "
        f"{', '.join(EVALUATION_PARTS)}); the record keeps the others",
    )
    parser.add_argument(
        "--task", choices=list(TASKS), default=TODAY.name,
        help="fundus-demo (shipped) or fundus-hard-demo (the harder generator, into out/harder)",
    )  # fmt: skip
    parser.add_argument("--dir", type=Path, help="where the model is written / read")
    parser.add_argument("--refit-ood", action="store_true", help="evaluate: refit the OOD check")
    parser.add_argument(
        "--from-dir", type=Path, help="third-stage / fourth-stage: the earlier stages' model"
    )
    args = parser.parse_args(argv)
    task = TASKS[args.task]
    directory = args.dir or task.directory
    if args.command == "gallery":
        print("wrote", ", ".join(str(p) for p in write_gallery()))
        return
    parts = tuple(part.strip() for part in args.parts.split(",") if part.strip())
    if args.command != "evaluate" and set(parts) != set(EVALUATION_PARTS):
        parser.error("--parts applies to evaluate: new weights are measured in full")
    try:
        model, record, density = _weights(args, task, directory)
    except ValueError as error:
        parser.error(str(error))
    evaluation = evaluate(
        model,
        density,
        pointing_images=args.pointing_images,
        multi_images=args.multi_images,
        pointing_stride=args.pointing_stride,
        parts=parts,
        task=task,
    )
    if args.command == "evaluate":
        earlier = json.loads((directory / task.registry_file).read_text()).get("evaluation")
        evaluation = merge_evaluation(earlier, evaluation)
    print(f"wrote {save(model, record, directory, evaluation, density, task)}")
    if args.command == "train":
        discard_progress(PROGRESS_ROOT / task.name)


def _weights(args, task: Task, directory: Path):
    """(model, training record, out-of-distribution reference) for ``args.command``:
    trained afresh, a later stage on the earlier stages' model, or read to evaluate."""
    from krypton.registry import load_model

    if args.command == "train":  # resumable: out/progress/<name> until the model is written
        progress = PROGRESS_ROOT / task.name
        model, record = train_stages(
            args.epochs, args.images_per_epoch, task=task, progress=progress
        )
        return model, record, fit_ood(model, task=task)
    if args.command in LATER_STAGES:
        source = args.from_dir or task.directory
        kept, train_stage = LATER_STAGES[args.command]
        earlier = json.loads((source / task.registry_file).read_text())["training"]
        if len(earlier["stages"]) < kept:
            raise ValueError(f"{args.command} needs a model of at least {kept} stages in {source}")
        model, stage = train_stage(load_model(task.name, source).module, task=task)
        stage["initial_weights"] = f"stage {kept} (float16 weights)"
        record = stages_record(earlier["stages"][:kept] + [stage])
        return model, record, fit_ood(model, task=task)
    loaded = load_model(task.name, directory)
    record = json.loads((directory / task.registry_file).read_text())["training"]
    reuse = loaded.ood is not None and not args.refit_ood
    return loaded.module, record, loaded.ood if reuse else fit_ood(loaded.module, task=task)


if __name__ == "__main__":
    main()
