"""Train and evaluate the fundus-lesion demo model (torchvision ResNet18, 3 classes).

    python -m krypton.train_fundus train     # ~15 min on 2 CPU cores; writes models/
    python -m krypton.train_fundus evaluate  # held-out accuracy and pointing game

Seeded and reproducible: training images come from FundusGenerator(seed=1), a fresh
stream every epoch (so the model never sees the same image twice), held-out test images
from seed 3 and the pointing-game set from seed 4. Weights are stored as float16 (22 MB).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import torchvision

from .fundus import CLASSES, IMAGE_SIZE, FundusGenerator, Sample
from .models import IMAGENET_MEAN, IMAGENET_STD

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "models"
WEIGHTS_FILE = "fundus-demo.pt"
REGISTRY_FILE = "fundus-demo.json"
TRAIN_SEED, TEST_SEED, POINTING_SEED = 1, 3, 4


def to_tensor(images: np.ndarray) -> torch.Tensor:
    """(N, H, W, 3) uint8 -> normalised (N, 3, H, W) float tensor."""
    tensor = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255.0
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return (tensor - mean) / std


def build_model(architecture: str = "resnet18") -> torch.nn.Module:
    """A torchvision architecture with random weights and one output per class."""
    return torchvision.models.get_model(architecture, weights=None, num_classes=len(CLASSES))


def _batch(
    generator: FundusGenerator, size: int, gray_boxes: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    samples = [generator.sample(label=i % len(CLASSES)) for i in range(size)]
    images = np.stack(
        [
            generator.gray_box(s) if gray_boxes and generator.rng.random() < 0.5 else s.image
            for s in samples
        ]
    )
    labels = torch.tensor([s.label for s in samples])
    return to_tensor(images), labels


def train(
    epochs: int = 6,
    images_per_epoch: int = 2400,
    batch_size: int = 32,
    seed: int = TRAIN_SEED,
    log=print,
    architecture: str = "resnet18",
) -> tuple[torch.nn.Module, dict]:
    """Train from scratch; returns the eval-mode model and a training record."""
    torch.manual_seed(seed)
    generator = FundusGenerator(seed=seed)
    model = build_model(architecture)
    steps_per_epoch = images_per_epoch // batch_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=2e-3, total_steps=epochs * steps_per_epoch
    )
    started = time.perf_counter()
    for epoch in range(epochs):
        model.train()
        correct = seen = 0
        loss_sum = 0.0
        for _ in range(steps_per_epoch):
            images, labels = _batch(generator, batch_size, gray_boxes=True)
            logits = model(images)
            loss = F.cross_entropy(logits, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            loss_sum += float(loss) * len(labels)
            correct += int((logits.argmax(1) == labels).sum())
            seen += len(labels)
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


@torch.inference_mode()
def accuracy(model: torch.nn.Module, count: int = 600, seed: int = TEST_SEED) -> float:
    """Accuracy on held-out generated images (balanced over the classes)."""
    generator = FundusGenerator(seed=seed)
    correct = 0
    for begin in range(0, count, 50):
        images, labels = _batch(generator, min(50, count - begin), gray_boxes=False)
        correct += int((model(images).argmax(1) == labels).sum())
    return correct / count


def pointing_set(count: int, seed: int = POINTING_SEED) -> list[Sample]:
    """Held-out images with exactly one planted lesion, alternating the lesion classes."""
    generator = FundusGenerator(seed=seed)
    return [generator.sample(label=1 + i % 2, lesions=1) for i in range(count)]


def pointing_game(
    model: torch.nn.Module, samples: list[Sample], patch: int = 16, stride: int = 8
) -> float:
    """Fraction of images whose most sensitive heatmap cell lies on the lesion.

    The heatmap explains the true class; a hit is when the occluder at the cell with the
    lowest probability touches the planted lesion.
    """
    import krypton

    gray = tuple((0.5 - m) / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD))
    hits = 0
    for sample in samples:
        image = to_tensor(sample.image[None])[0]
        heatmap = krypton.explain(
            model, image, patch=patch, stride=stride, fill=gray, label=sample.label
        )
        row, col = np.unravel_index(np.nanargmin(heatmap.values), heatmap.values.shape)
        x0, y0 = int(heatmap.xs[col]), int(heatmap.ys[row])
        hits += sample.lesions[0].covered_by(x0, y0, patch)
    return hits / len(samples)


def save(model: torch.nn.Module, record: dict, directory: Path = MODEL_DIR) -> Path:
    """Write float16 weights and the registry file; returns the registry file's path."""
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: (v.half() if v.is_floating_point() else v) for k, v in model.state_dict().items()}
    torch.save(state, directory / WEIGHTS_FILE)
    entry = {
        "name": "fundus-demo",
        "description": (
            "ResNet18 trained by this project on crops of the real retina "
            "photograph shipped with scikit-image, with synthetic lesions "
            "planted at known positions: small dark microaneurysm-like dots "
            "and bright exudate-like patches. A demonstration model, not a "
            "medical device."
        ),
        "architecture": "resnet18",
        "weights": {"source": "file", "path": WEIGHTS_FILE, "format": "state_dict"},
        "input_size": [IMAGE_SIZE, IMAGE_SIZE],
        "mean": list(IMAGENET_MEAN),
        "std": list(IMAGENET_STD),
        "classes": list(CLASSES),
        "default": True,
        "training": record,
    }
    path = directory / REGISTRY_FILE
    path.write_text(json.dumps(entry, indent=2) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["train", "evaluate"])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--images-per-epoch", type=int, default=2400)
    parser.add_argument("--pointing-images", type=int, default=100)
    args = parser.parse_args(argv)
    if args.command == "train":
        model, record = train(args.epochs, args.images_per_epoch)
    else:
        from .registry import load_model

        loaded = load_model("fundus-demo")
        model = loaded.module
        record = json.loads((MODEL_DIR / REGISTRY_FILE).read_text())["training"]
    started = time.perf_counter()
    record["held_out_accuracy"] = round(accuracy(model), 4)
    record["held_out_images"] = 600
    record["pointing_game"] = round(pointing_game(model, pointing_set(args.pointing_images)), 4)
    record["pointing_images"] = args.pointing_images
    record["evaluated"] = datetime.date.today().isoformat()
    record["machine"] = f"{platform.machine()}, {torch.get_num_threads()} threads"
    print(
        f"held-out accuracy {record['held_out_accuracy']:.3f}, pointing game "
        f"{record['pointing_game']:.3f} ({time.perf_counter() - started:.0f} s)"
    )
    if args.command == "train":
        print(f"wrote {save(model, record)}")
    else:
        entry = json.loads((MODEL_DIR / REGISTRY_FILE).read_text())
        entry["training"] = record
        (MODEL_DIR / REGISTRY_FILE).write_text(json.dumps(entry, indent=2) + "\n")


if __name__ == "__main__":
    main()
