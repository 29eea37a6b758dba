"""Model registry: parsing, unavailable weights, user checkpoints and their errors."""

import json

import numpy as np
import pytest
import torch
import torchvision

import krypton
from krypton.registry import (
    CheckpointError,
    RegistryError,
    available_models,
    load_model,
    read_entry,
    register_model,
)


def write_entry(directory, name, **fields):
    entry = {
        "name": name,
        "architecture": "resnet18",
        "weights": {"source": "file", "path": f"{name}.pt"},
        "classes": ["a", "b"],
        **fields,
    }
    (directory / f"{name}.json").write_text(json.dumps(entry))
    return directory / f"{name}.json"


def test_repository_registry_parses():
    names = {info.name: info for info in available_models()}
    assert {"resnet18", "vgg16", "inception_v3"} <= set(names)
    assert names["inception_v3"].input_size == (299, 299)
    assert len(names["vgg16"].classes) == 1000


def test_every_registry_entry_is_read_as_one_typed_schema(tmp_path):
    """Registry entries were dict[str, Any] in every reader. One schema now
    (krypton.registry.entries.RegistryEntry, type-checked against the registry's readers
    and writers in make lint): each shipped entry holds only fields it names, and a
    minimal file is read with every field it requires, its defaults filled."""
    from typing import get_type_hints

    from krypton.registry.entries import RegistryEntry, VolumeSettings, models_dir, read_entry

    named = set(get_type_hints(RegistryEntry))
    for path in sorted(models_dir().glob("*.json")):
        entry = read_entry(path)
        assert set(entry) <= named, (path.name, set(entry) - named)
        assert RegistryEntry.__required_keys__ <= set(entry), path.name
        if "volume" in entry:
            keys = set(entry["volume"])
            assert VolumeSettings.__required_keys__ <= keys, path.name
            assert keys <= set(get_type_hints(VolumeSettings)), path.name
    minimal = tmp_path / "mine.json"
    minimal.write_text(json.dumps({"weights": {"source": "torchvision"},
                                   "architecture": "resnet18", "classes": ["a", "b"]}))  # fmt: skip
    entry = read_entry(minimal)
    assert set(entry) >= RegistryEntry.__required_keys__
    assert (entry["name"], entry["input_size"], entry["patch"]) == ("mine", [224, 224], 16)


def test_a_model_carries_its_default_patch(tmp_path):
    """A registry entry may name the patch its heatmaps default to (fundus-demo: 12, for
    lesions mostly under 8 px across); without one it is the paper's 16."""
    from demo.fundus.train import HEATMAP_PATCH

    assert load_model("fundus-demo").patch == HEATMAP_PATCH == 12
    model = torchvision.models.resnet18(weights=None, num_classes=2).eval()
    torch.save(model.state_dict(), tmp_path / "plain.pt")
    write_entry(tmp_path, "plain")
    assert load_model("plain", tmp_path).patch == 16
    write_entry(tmp_path, "small", weights={"source": "file", "path": "plain.pt"}, patch=8)
    assert load_model("small", tmp_path).patch == 8


def test_imagenet_models_unavailable_offline_with_reason_and_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    infos = {info.name: info for info in available_models()}
    for name in ("resnet18", "vgg16", "inception_v3"):
        info = infos[name]
        assert not info.available
        assert "not cached" in info.reason and "make models" in info.fix
    with pytest.raises(krypton.WeightsUnavailableError, match="make models"):
        load_model("vgg16")


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"weights": {"source": "http"}}, "source 'torchvision' or 'file'"),
        ({"architecture": "resnet1800"}, "unknown architecture 'resnet1800'"),
        ({"classes": []}, "'classes' must be a non-empty list"),
        ({"input_size": [224]}, "'input_size' must be"),
        ({"std": [0, 1, 1]}, "'std' values must be positive"),
        ({"weights": {"source": "file", "path": "x.pt", "format": "onnx"}}, "format must be"),
        ({"patch": 0}, "'patch' .* must be a whole number of pixels from 1 to 224"),
        ({"patch": 300}, "'patch' .* from 1 to 224"),
        ({"patch": 12.5}, "'patch' .* whole number"),
        ({"patch": True}, "'patch' .* whole number"),
    ],
)
def test_bad_registry_files(tmp_path, fields, message):
    path = write_entry(tmp_path, "broken", **fields)
    with pytest.raises(RegistryError, match=message):
        read_entry(path)
    with pytest.raises(RegistryError, match=message):
        load_model("broken", tmp_path)
    assert "broken" not in {i.name for i in available_models(tmp_path)}


def test_unknown_and_missing(tmp_path):
    write_entry(tmp_path, "nofile")
    (tmp_path / "junk.json").write_text("{not json")
    info = {i.name: i for i in available_models(tmp_path)}["nofile"]
    assert not info.available and "missing" in info.reason
    with pytest.raises(RegistryError, match="no model named 'other'"):
        load_model("other", tmp_path)
    with pytest.raises(RegistryError, match="not valid JSON"):
        load_model("junk", tmp_path)


def tiny_finetune(images, labels, classes):
    """Fine-tune only the head of a ResNet18 on a few images (the user's workflow)."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None)
    model.fc = torch.nn.Linear(512, classes)
    for name, parameter in model.named_parameters():
        parameter.requires_grad = name.startswith("fc.")
    optimizer = torch.optim.Adam(model.fc.parameters(), lr=1e-2)
    model.train()
    for _ in range(5):
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def test_user_checkpoint_round_trip(tmp_path):
    images = torch.randn(8, 3, 64, 64)
    labels = torch.tensor([0, 1, 2, 3] * 2)
    model = tiny_finetune(images, labels, 4)
    torch.save(
        {"state_dict": {f"module.{k}": v for k, v in model.state_dict().items()}},
        tmp_path / "oct.pt",
    )  # wrapped, DataParallel-prefixed: both unwrapped
    registry = tmp_path / "registry"
    loaded = register_model(
        "oct-resnet18",
        tmp_path / "oct.pt",
        ["CNV", "DME", "DRUSEN", "NORMAL"],
        architecture="resnet18",
        input_size=(64, 64),
        directory=registry,
    )
    assert (registry / "oct-resnet18.json").exists() and (registry / "oct-resnet18.pt").exists()
    assert loaded.classes == ["CNV", "DME", "DRUSEN", "NORMAL"]
    again = load_model("oct-resnet18", registry)
    with torch.inference_mode():
        torch.testing.assert_close(again.module(images), model(images))
    heatmap = krypton.explain(again.module, images[0], patch=16, stride=16)
    naive = krypton.explain(again.module, images[0], patch=16, stride=16, mode="naive")
    np.testing.assert_allclose(heatmap.values, naive.values, atol=1e-4)
    assert {i.name for i in available_models(registry) if i.available} == {"oct-resnet18"}
    with pytest.raises(RegistryError, match="already registered"):
        register_model(
            "oct-resnet18",
            tmp_path / "oct.pt",
            ["a"] * 4,
            architecture="resnet18",
            directory=registry,
        )


def test_torchscript_checkpoint(tmp_path):
    model = torchvision.models.resnet18(weights=None, num_classes=3).eval()
    torch.jit.script(model).save(str(tmp_path / "scripted.ts"))
    loaded = register_model(
        "scripted",
        tmp_path / "scripted.ts",
        ["x", "y", "z"],
        format="torchscript",
        input_size=(64, 64),
        directory=tmp_path / "r",
    )
    image = torch.randn(3, 64, 64)
    assert krypton.explain(
        loaded.module, image, patch=32, stride=32, mode="naive"
    ).values.shape == (2, 2)
    with pytest.raises(krypton.UnsupportedModelError, match="mode='naive'"):
        krypton.explain(loaded.module, image, patch=32, stride=32)


def test_bad_checkpoints_have_clear_messages(tmp_path):
    registry = tmp_path / "registry"
    (tmp_path / "text.pt").write_text("hello")
    with pytest.raises(CheckpointError, match="not a PyTorch checkpoint"):
        register_model(
            "t", tmp_path / "text.pt", ["a", "b"], architecture="resnet18", directory=registry
        )
    torch.save({"weights": [1, 2, 3]}, tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match="not a state_dict"):
        register_model(
            "l", tmp_path / "list.pt", ["a", "b"], architecture="resnet18", directory=registry
        )
    vgg = torchvision.models.vgg11(weights=None, num_classes=2)
    torch.save(vgg.state_dict(), tmp_path / "vgg.pt")
    with pytest.raises(CheckpointError, match="does not match torchvision's resnet18: missing"):
        register_model(
            "v", tmp_path / "vgg.pt", ["a", "b"], architecture="resnet18", directory=registry
        )
    resnet = torchvision.models.resnet18(weights=None, num_classes=4)
    torch.save(resnet.state_dict(), tmp_path / "four.pt")
    with pytest.raises(CheckpointError, match=r"fc.weight has shape \(4, 512\).*class list"):
        register_model(
            "f", tmp_path / "four.pt", ["a", "b", "c"], architecture="resnet18", directory=registry
        )
    with pytest.raises(RegistryError, match="model name"):
        register_model(
            "../evil", tmp_path / "four.pt", ["a"] * 4, architecture="resnet18", directory=registry
        )
    assert not registry.exists() or not list(registry.glob("*.json"))  # nothing written


# a user's state_dict model, as its registry file holds it before any record is added
MINE = {
    "name": "mine",
    "architecture": "resnet18",
    "weights": {"source": "file", "path": "mine.pt", "format": "state_dict"},
    "input_size": [64, 64],
    "classes": ["a", "b"],
}


def test_registry_files_have_one_writer_that_never_shows_half_a_file(tmp_path):
    """Tuning, calibration and the demo's training each wrote the JSON with write_text
    (truncate, then write): a reader in between saw an empty or half file."""
    import json
    import threading

    from krypton.registry.entries import read_entry, update_entry, write_entry

    path = tmp_path / "mine.json"
    entry = {**MINE, "notes": "x" * 200_000}  # a large file takes a while to write
    write_entry(path, entry)
    broken, stop = [], threading.Event()

    def read_while_written():
        while not stop.is_set():
            try:
                json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                broken.append(exc)

    def update(key, rounds=30):
        for index in range(rounds):
            # each a record of its kind (the writer checks them), the round in its numbers
            record = (
                {"coefficients": [0.0, 0.0, float(index)]}
                if key == "tuning"
                else {"models": {}, "round": index}
            )
            update_entry(path, **{key: record})

    reader = threading.Thread(target=read_while_written)
    writers = [threading.Thread(target=update, args=(key,)) for key in ("tuning", "calibration")]
    reader.start()
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    stop.set()
    reader.join()
    assert broken == []
    written = json.loads(path.read_text())
    assert written["tuning"] == {"coefficients": [0.0, 0.0, 29.0]}
    assert written["calibration"] == {"models": {}, "round": 29}
    assert written["notes"] == entry["notes"] and "mean" not in written  # no defaults added
    assert read_entry(path)["classes"] == ["a", "b"]
    with pytest.raises(RegistryError):
        update_entry(path, classes=[])  # validated before anything is written
    assert json.loads(path.read_text())["classes"] == ["a", "b"]


@pytest.mark.parametrize(
    "record, refused",
    [
        ({"tuning": {"round": 3}}, "the 'tuning' record lacks coefficients"),
        ({"tuning": {"coefficients": [1.0, 2.0]}}, "three numbers"),
        ({"ood": {"path": "m.ood.npz"}}, "the 'ood' record lacks threshold"),
        ({"ood": {"path": 3, "threshold": 1.0}}, "a file name 'path'"),
        ({"calibration": {"date": "2026-11-29"}}, "the 'calibration' record lacks models"),
        ({"calibration": []}, "'calibration' must be an object"),
    ],
)
def test_the_writer_refuses_a_record_its_readers_cannot_read(tmp_path, record, refused):
    """A tuning record without its coefficients was written, and then every load of the
    model ended in a KeyError (TauTuning.from_record); the writer checks each record
    against its type (krypton.registry.entry_schema.RECORDS) before writing."""
    import json

    from krypton.registry.entries import update_entry

    path = tmp_path / "mine.json"
    entry = dict(MINE)
    path.write_text(json.dumps(entry))
    with pytest.raises(RegistryError, match=refused):
        update_entry(path, **record)
    assert json.loads(path.read_text()) == entry  # nothing written


def test_a_shipped_model_made_for_other_images_gives_way_to_one_made_for_the_files(
    tmp_path, monkeypatch
):
    """A CT slice opened into the image panel met the fundus model, the page's default,
    whatever the file was. A shipped model that says which DICOM modalities it is made
    for now gives way to an available one made for the file's; a model that says
    nothing, or one a user registered, is kept."""
    from krypton.registry import model_for_modality

    shipped, home = tmp_path / "shipped", tmp_path / "home"
    shipped.mkdir()
    (home / "models").mkdir(parents=True)
    monkeypatch.setenv("KRYPTON_MODELS_DIR", str(shipped))
    monkeypatch.setenv("KRYPTON_HOME", str(home))
    made = {"photos": ["OP", "XC"], "slices": ["CT"], "plain": None, "mri": ["MR"]}
    for name, modalities in made.items():
        fields = {"modalities": modalities} if modalities else {}
        write_entry(shipped, name, **fields)
        if name != "mri":  # its weights are missing: not available
            (shipped / f"{name}.pt").write_bytes(b"weights")
    write_entry(home / "models", "mine", modalities=["OP"])
    (home / "models" / "mine.pt").write_bytes(b"weights")
    assert model_for_modality("CT", "photos") == "slices"
    assert model_for_modality("OP", "slices") == "photos"
    assert model_for_modality("CT", "slices") is None  # made for it
    assert model_for_modality("MR", "photos") is None  # the only one made for MR is missing
    assert model_for_modality("CT", "plain") is None  # says nothing: kept
    assert model_for_modality("CT", "mine") is None  # the user's own: kept
    assert model_for_modality("", "photos") is None  # no modality in the file
    with pytest.raises(RegistryError, match="'modalities' must be a list of DICOM"):
        read_entry(write_entry(tmp_path, "broken", modalities=["ct scan"]))
