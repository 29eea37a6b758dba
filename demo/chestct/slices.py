"""Train and evaluate the chest-CT slice demo model (chestct-slice-demo: ct2d-small, 2
classes, 64 x 64): the image panel's model for one axial CT slice, as a slice of a CT
series opened from the PACS arrives there.

    python -m demo.chestct.slices train      # ~6 min on 2 cores; writes out/chestct-slices/
    python -m demo.chestct.slices evaluate   # every number of the model card, and the OOD check
    python -m demo.chestct.slices tune       # approximate mode's tau (SSIM over slices)
    python -m demo.chestct.slices save       # weights + registry entry into krypton/shipped_models/
    python -m demo.chestct.slices all        # the four in turn

A slice is an axial plane of a generated chest CT (krypton.synthetic.chestct, 48 x 48 at a
nominal 5 mm: the volume sample and the PACS demo series have that geometry), windowed as
the image panel windows a CT file — the lung window a scanner writes into the file, its
centre and width drawn around it, or a quarter of the time the frame's full range, which
the panel uses for a file without a window — as 8-bit gray, then resized to 64 x 64 as
:meth:`krypton.LoadedModel.preprocess` does. NODULE: the slice cuts a nodule within half
its radius of its centre; NORMAL: no nodule within a voxel of the slice. 30% of the
training slices carry a mid-gray box (the image panel's default occluder), on a nodule
half of those times, and the target follows the share of the nodule's cut left in view,
so occluding a nodule lowers p(NODULE) as it should. Seeded: training volumes from seed 21,
held out from seed 3, pointing from seed 4, the OOD reference from seeds 5 and 6.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from krypton.io.dicom import WINDOW_PRESETS, linear_window
from krypton.registry.architectures import build
from krypton.registry.models import preprocess_picture
from krypton.synthetic.chestct import CLASSES, ChestCTGenerator, VolumeSample

from .train import ROOT, nodule_target, train_step

WORK_DIR = ROOT / "out" / "chestct-slices"
MODEL_DIR = ROOT / "krypton" / "shipped_models"
NAME = "chestct-slice-demo"
ARCHITECTURE = "ct2d-small"
SIDE = 64  # the model's input, pixels a side
MEAN, STD = 0.45, 0.35  # on the [0, 1] picture, every channel alike
HEATMAP_PATCH, HEATMAP_STRIDE = 8, 4  # the card's heatmaps: nodules cut 4-12 pixels across
TRAIN_SEED, TEST_SEED, POINTING_SEED = 21, 3, 4
REFERENCE_SEED, THRESHOLD_SEED, OOD_TEST_SEED = 5, 6, 9
OOD_FILE = f"{NAME}.ood.npz"
LUNG = WINDOW_PRESETS["lung"]  # (centre, width): the window the demo series is written with
FULL_RANGE_SHARE = 0.25  # slices windowed over their own range, as a file without a window
BOX_SIDES = (4, 16)  # the gray boxes drawn during training, input pixels a side


def window_slice(plane: np.ndarray, window: tuple[float, float] | None) -> np.ndarray:
    """An HU plane as the image panel shows a CT frame: 8-bit gray in ``window`` (centre,
    width), or over the plane's own range where None (krypton.io.dicom's rule)."""
    if window is None:
        low, high = float(plane.min()), float(plane.max())
        window = ((low + high) / 2, max(high - low, 1.0))
    return np.round(linear_window(plane, *window, "LINEAR") * 255).astype(np.uint8)


def to_input(gray: np.ndarray) -> torch.Tensor:
    """An 8-bit gray slice as the model's (3, 64, 64) input: the registered model's own
    preprocessing (krypton.registry.models.preprocess_picture)."""
    return preprocess_picture(Image.fromarray(gray, "L"), (SIDE, SIDE), [MEAN] * 3, [STD] * 3)


def fill_value() -> float:
    """The image panel's default occluder (mid-gray) in input space."""
    return (0.5 - MEAN) / STD


def nodule_cut(sample: VolumeSample, z: int) -> list[tuple[float, float, float]]:
    """Each nodule's cut by slice ``z``: (row, column, radius) in input pixels."""
    scale = SIDE / sample.volume.shape[1]
    cuts = []
    for nodule in sample.nodules:
        squared = nodule.radius**2 - (z - nodule.z) ** 2
        if squared > 0:
            cuts.append(((nodule.y + 0.5) * scale - 0.5, (nodule.x + 0.5) * scale - 0.5,
                         float(np.sqrt(squared)) * scale))  # fmt: skip
    return cuts


def slice_label(sample: VolumeSample, z: int) -> int | None:
    """1 where the slice cuts a nodule within half its radius of its centre, 0 where no
    nodule comes within a voxel of it, None between (not used)."""
    distances = [abs(z - n.z) / n.radius for n in sample.nodules]
    if any(d <= 0.5 for d in distances):
        return 1
    if all(abs(z - n.z) > n.radius + 1 for n in sample.nodules):
        return 0
    return None


def pick_slice(sample: VolumeSample, rng: np.random.Generator, label: int) -> int | None:
    """A slice of ``label`` in ``sample`` (None where it has none)."""
    depth = sample.volume.shape[0]
    if label == 1:
        if not sample.nodules:
            return None
        nodule = sample.nodules[rng.integers(len(sample.nodules))]
        z = int(round(nodule.z + rng.uniform(-0.5, 0.5) * nodule.radius))
        return z if 0 <= z < depth and slice_label(sample, z) == 1 else None
    for _ in range(8):
        z = int(rng.integers(4, depth - 4))
        if slice_label(sample, z) == 0:
            return z
    return None


def drawn_window(rng: np.random.Generator) -> tuple[float, float] | None:
    """The lung window with its centre and width drawn around it, or the full range."""
    if rng.random() < FULL_RANGE_SHARE:
        return None
    return (LUNG[0] + rng.uniform(-100, 100), LUNG[1] * rng.uniform(0.85, 1.2))


def visible_share(cuts, box) -> float:
    """The largest share of a nodule's cut outside ``box`` (row, column, side) or None."""
    rows, columns = np.mgrid[:SIDE, :SIDE]
    best = 0.0
    for row, column, radius in cuts:
        inside = (rows - row) ** 2 + (columns - column) ** 2 <= radius**2
        if box is not None:
            top, left, side = box
            inside_box = (
                (rows >= top) & (rows < top + side) & (columns >= left) & (columns < left + side)
            )
            seen = (inside & ~inside_box).sum() / max(int(inside.sum()), 1)
        else:
            seen = 1.0 if inside.any() else 0.0
        best = max(best, float(seen))
    return best


def batch(pool: list[VolumeSample], size: int, rng: np.random.Generator, occluded: bool = True):
    """``size`` slices, half NODULE: windowed as the panel does, flipped left-right at
    random, 30% with a mid-gray box (on a nodule half those times); the target follows
    the share of the nodule's cut left in view (demo.chestct.train.nodule_target)."""
    inputs, targets = [], []
    while len(inputs) < size:
        label = len(inputs) % 2
        sample = pool[int(rng.integers(len(pool)))]
        z = pick_slice(sample, rng, label)
        if z is None:
            continue
        plane = sample.volume[z]
        cuts = nodule_cut(sample, z) if label else []
        if rng.random() < 0.5:
            plane = plane[:, ::-1]
            cuts = [(row, SIDE - 1 - column, radius) for row, column, radius in cuts]
        tensor = to_input(window_slice(np.ascontiguousarray(plane), drawn_window(rng)))
        box = None
        if occluded and rng.random() < 0.3:
            side = int(rng.integers(BOX_SIDES[0], BOX_SIDES[1] + 1))
            if cuts and rng.random() < 0.5:
                row, column, _ = cuts[0]
                centre = np.array([row, column]) + rng.uniform(-side / 2, side / 2, 2)
            else:
                centre = rng.uniform(0, SIDE, 2)
            top, left = (int(np.clip(round(c - side / 2), 0, SIDE - side)) for c in centre)
            tensor[:, top : top + side, left : left + side] = fill_value()
            box = (top, left, side)
        nodule = nodule_target(visible_share(cuts, box)) if label else 0.05
        inputs.append(tensor)
        targets.append([1 - nodule, nodule])
    return torch.stack(inputs), torch.tensor(targets, dtype=torch.float32)


SCHEDULE = {"pool_volumes": 2000, "steps": 2400, "batch": 48, "learning_rate": 2e-3}


def train(schedule: dict = SCHEDULE, seed: int = TRAIN_SEED, log=print, occluded: bool = True):
    """Train from scratch; the eval-mode model and its training record."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    started = time.perf_counter()
    generator = ChestCTGenerator(seed=seed, varied=False, varied_nodules=True)
    varied = ChestCTGenerator(seed=seed + 1000, varied=True, varied_nodules=True)
    pool = [(varied if i % 10 < 7 else generator).sample(label=i % 2)
            for i in range(schedule["pool_volumes"])]  # fmt: skip
    log(f"{len(pool)} volumes generated in {time.perf_counter() - started:.0f} s")
    model = build(ARCHITECTURE, len(CLASSES))
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=schedule["learning_rate"], weight_decay=1e-4
    )
    steps = schedule["steps"]
    lr_schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=schedule["learning_rate"], total_steps=steps, pct_start=0.05
    )
    model.train()
    correct = seen = 0
    trained = None
    for step in range(1, steps + 1):
        inputs, targets = batch(pool, schedule["batch"], rng, occluded)
        loss, matched = train_step(model, optimizer, lr_schedule, inputs, targets)
        correct += matched
        seen += len(targets)
        if step % 200 == 0:
            trained = correct / seen
            log(f"step {step}/{steps}: loss {loss:.4f}, train accuracy {trained:.3f}, "
                f"{time.perf_counter() - started:.0f} s")  # fmt: skip
            correct = seen = 0
    record = {
        "architecture": ARCHITECTURE,
        **schedule,
        "seed": seed,
        "pool": "krypton.synthetic.chestct, 7 in 10 from the varied draw, nodules varied",
        "targets": "p(NODULE) 0.95 on a slice through a nodule's middle half, 0.05 on one "
        "no nodule comes within a voxel of; 30% with a mid-gray box of side 4-16; the "
        "target follows the share of the nodule's cut left in view",
        "windows": f"lung (C {LUNG[0]:g} / W {LUNG[1]:g}) with centre +-100 and width x0.85-1.2; "
        f"{FULL_RANGE_SHARE:.0%} the slice's full range",
        "last_train_accuracy": None if trained is None else round(trained, 4),
        "train_seconds": round(time.perf_counter() - started, 1),
        "threads": torch.get_num_threads(),
    }
    return model.eval(), record


def slice_set(count: int, seed: int, independent: bool = False, window=LUNG, nodules=None):
    """``count`` held-out slices (half NODULE) windowed in ``window`` (None: full
    range): [(input, label, the nodules' cuts)]."""
    from .independent import IndependentChestCT

    generator = IndependentChestCT(seed=seed) if independent else ChestCTGenerator(seed=seed)
    rng = np.random.default_rng(seed)
    slices = []
    while len(slices) < count:
        label = len(slices) % 2
        sample = generator.sample(label=label, nodules=nodules if label else None)
        z = pick_slice(sample, rng, label)
        if z is not None:
            gray = window_slice(sample.volume[z], window)
            slices.append((to_input(gray), label, nodule_cut(sample, z)))
    return slices


@torch.inference_mode()
def accuracy(model: torch.nn.Module, slices) -> float:
    """Share of slices classified as their label."""
    inputs = torch.stack([s[0] for s in slices])
    predicted = torch.cat([model(chunk).argmax(1) for chunk in inputs.split(64)])
    return float((predicted == torch.tensor([s[1] for s in slices])).float().mean())


def pointing_game(model: torch.nn.Module, count: int = 100) -> dict:
    """On single-nodule slices through the nodule's middle: the exact heatmap of NODULE;
    a hit when the box at its lowest cell covers the nodule cut's centre."""
    import krypton

    hits, seconds = 0, 0.0
    slices = [s for s in slice_set(2 * count, POINTING_SEED, nodules=1) if s[1] == 1][:count]
    for tensor, _, cuts in slices:
        started = time.perf_counter()
        heatmap = krypton.explain(model, tensor, patch=HEATMAP_PATCH, stride=HEATMAP_STRIDE,
                                  mode="exact", fill=fill_value(), label=1)  # fmt: skip
        seconds += time.perf_counter() - started
        i, j = np.unravel_index(np.nanargmin(heatmap.values), heatmap.values.shape)
        top, left = float(heatmap.ys[i]), float(heatmap.xs[j])
        row, column, _ = cuts[0]
        hits += top - 0.5 <= row <= top + HEATMAP_PATCH - 0.5 and (
            left - 0.5 <= column <= left + HEATMAP_PATCH - 0.5
        )
    return {
        "hit_rate": hits / len(slices),
        "images": len(slices),
        "patch": HEATMAP_PATCH,
        "stride": HEATMAP_STRIDE,
        "seconds_per_slice": round(seconds / len(slices), 3),
    }


def _features(model: torch.nn.Module, tensors) -> tuple[list[str], list[np.ndarray]]:
    from krypton.registry.ood import feature_statistics

    return feature_statistics(model, tensors, batch_size=64)


def ood_reference(count: int = 600) -> str:
    return (f"{count} axial slices of generated chest CT (krypton.synthetic.chestct, seed "
            f"{REFERENCE_SEED}), lung window or full range as trained")  # fmt: skip


def _reference_slices(seed: int, count: int):
    generator = ChestCTGenerator(seed=seed, varied=True, varied_nodules=True)
    rng = np.random.default_rng(seed)
    while count:
        sample = generator.sample(label=count % 2)
        z = pick_slice(sample, rng, count % 2)
        if z is not None:
            count -= 1
            yield to_input(window_slice(sample.volume[z], drawn_window(rng)))


def fit_ood(model: torch.nn.Module, reference: int = 600, held_out: int = 2400):
    """Generated slices fit the densities (seed 5); others calibrate the p-values and
    set the threshold (seed 6)."""
    from krypton.registry.ood import fit_density

    names, fit = _features(model, _reference_slices(REFERENCE_SEED, reference))
    _, calibrate = _features(model, _reference_slices(THRESHOLD_SEED, held_out))
    return fit_density(names, fit, calibrate, ood_reference(reference))


def _outside_slices() -> dict[str, list[torch.Tensor]]:
    """Inputs that are not a chest CT slice: the head phantom's slices, photographs,
    the fundus samples, smooth noise."""
    from scipy import ndimage
    from skimage import data

    from .train import head_phantom

    rng = np.random.default_rng(OOD_TEST_SEED)
    heads = [head_phantom(rng)[int(rng.integers(12, 36))] for _ in range(40)]
    photos = [getattr(data, name)() for name in ("camera", "coins", "moon", "page", "text",
                                                  "brick", "grass", "gravel")]  # fmt: skip
    fundus = sorted((ROOT / "assets" / "samples").glob("fundus-*.png"))
    noise = [ndimage.gaussian_filter(rng.normal(-300, 500, (48, 48)), 2) for _ in range(40)]
    return {
        "head_ct": [to_input(window_slice(h, LUNG)) for h in heads],
        "photographs": [to_input(np.asarray(Image.fromarray(p).convert("L"))) for p in photos],
        "fundus_photographs": [to_input(np.asarray(Image.open(f).convert("L"))) for f in fundus],
        "noise": [to_input(window_slice(n, LUNG)) for n in noise],
    }


def ood_rates(model: torch.nn.Module, density, count: int = 300) -> dict:
    """Flag rates of fresh generated slices (target <= 2%), the independent generator's
    and inputs that are not chest CT slices."""
    rates: dict = {"threshold": round(float(density.threshold), 3)}
    groups = {
        "in_distribution": list(_reference_slices(OOD_TEST_SEED, count)),
        "independent": [s[0] for s in slice_set(count // 2, OOD_TEST_SEED, independent=True)],
        **_outside_slices(),
    }
    for name, tensors in groups.items():
        scores = density.score(_features(model, iter(tensors))[1])
        rates[f"{name}_flagged"] = round(float((scores > density.threshold).mean()), 4)
        rates[f"{name}_images"] = len(tensors)
    return rates


def evaluate(model: torch.nn.Module, log=print) -> dict:
    """Every number of the model card; fits and keeps the OOD check."""
    started = time.perf_counter()
    sets = {
        "held_out": (slice_set(600, TEST_SEED), f"krypton.synthetic.chestct (seed {TEST_SEED}), "
                     "lung window, half NODULE"),
        "held_out_full_range": (slice_set(600, TEST_SEED, window=None), "the same volumes' "
                                "slices over their own range (a file without a window)"),
        "independent": (slice_set(600, TEST_SEED, independent=True), "demo.chestct.independent: "
                        "separately written drawing code, same spec; lung window"),
    }  # fmt: skip
    results: dict = {}
    for key, (slices, what) in sets.items():
        results[key] = {"accuracy": round(accuracy(model, slices), 4), "images": len(slices),
                        "test_set": what}  # fmt: skip
        log(f"{key}: {results[key]} ({time.perf_counter() - started:.0f} s)")
    results["pointing"] = pointing_game(model)
    log(f"pointing: {results['pointing']} ({time.perf_counter() - started:.0f} s)")
    density = fit_ood(model)
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    density.save(WORK_DIR / OOD_FILE)
    results["ood"] = ood_rates(model, density)
    log(f"ood: {results['ood']} ({time.perf_counter() - started:.0f} s)")
    return results


TUNE_SEED, TUNE_HELD_OUT_SEED = 30, 31


def tune(model: torch.nn.Module, count: int = 8, log=print) -> dict:
    """Approximate mode's tau for this model (paper §4.3, krypton.tune.tune_tau) over
    whole-slice heatmaps at the card's patch and stride."""
    from krypton.tune import tune_tau

    def slices(seed: int) -> list[torch.Tensor]:
        return [s[0] for s in slice_set(count, seed)]

    return tune_tau(model, slices(TUNE_SEED), patch=HEATMAP_PATCH, stride=HEATMAP_STRIDE,
                    fill=fill_value(), held_out=slices(TUNE_HELD_OUT_SEED), log=log)  # fmt: skip


DESCRIPTION = (
    "A small 2-D CNN (ct2d-small) trained by this project on single axial slices of "
    "synthetic chest-CT-like volumes (krypton.synthetic.chestct, 48 x 48 at a nominal 5 mm, "
    "shown at 64 x 64): NODULE where the slice cuts a nodule near its middle, NORMAL where "
    "none is near; vessels crossing the slice are the hard negatives. It reads the slice as "
    "the image panel shows a CT file, in the lung window (or the slice's full range where "
    "the file gives no window), and learnt with nodules hidden under mid-gray boxes, the "
    "image panel's default occluder. A demonstration model, not a medical device."
)


def save(record: dict, evaluation: dict, tuning: dict, model: torch.nn.Module) -> Path:
    """Weights (float16) and the registry entry, with the card's numbers."""
    import shutil

    from krypton.registry.entries import write_entry

    state = {k: v.half() if v.is_floating_point() else v for k, v in model.state_dict().items()}
    torch.save(state, MODEL_DIR / f"{NAME}.pt")
    shutil.copyfile(WORK_DIR / OOD_FILE, MODEL_DIR / OOD_FILE)
    entry = {
        "name": NAME, "description": DESCRIPTION, "architecture": ARCHITECTURE,
        "weights": {"source": "file", "path": f"{NAME}.pt", "format": "state_dict"},
        "input_size": [SIDE, SIDE], "mean": [MEAN] * 3, "std": [STD] * 3,
        "classes": list(CLASSES), "patch": HEATMAP_PATCH, "modalities": ["CT"],
        "ood": {"path": OOD_FILE, "threshold": evaluation["ood"]["threshold"],
                "reference": ood_reference()},
        "training": record, "evaluation": evaluation, "tuning": tuning,
    }  # fmt: skip
    path = MODEL_DIR / f"{NAME}.json"
    if path.exists():  # `krypton calibrate`'s record stays
        calibration = json.loads(path.read_text()).get("calibration")
        entry.update({"calibration": calibration} if calibration else {})
    write_entry(path, entry)  # type: ignore[arg-type]
    return path


def load_trained(path: Path = WORK_DIR / "weights.pt") -> torch.nn.Module:
    model = build(ARCHITECTURE, len(CLASSES))
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    return model.eval()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=("train", "evaluate", "tune", "save", "all"))
    step = parser.parse_args(argv).step
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    files = {name: WORK_DIR / f"{name}.json" for name in ("training", "evaluation", "tuning")}
    if step in ("train", "all"):
        model, record = train()
        torch.save(model.state_dict(), WORK_DIR / "weights.pt")
        files["training"].write_text(json.dumps(record, indent=2))
    model = load_trained()
    if step in ("evaluate", "all"):
        files["evaluation"].write_text(json.dumps(evaluate(model), indent=2))
    if step in ("tune", "all"):
        files["tuning"].write_text(json.dumps(tune(model), indent=2))
    if step in ("save", "all"):
        loaded = {name: json.loads(path.read_text()) for name, path in files.items()}
        print(save(loaded["training"], loaded["evaluation"], loaded["tuning"], model))


if __name__ == "__main__":
    main()
