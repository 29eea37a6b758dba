"""Every message a radiologist reads is in plain words, each said once: no library names,
no Python advice, no internal factors. A corrupt .dcm said "Use force=True to force
reading." with pydicom's error class; the colour scale was "Relative scale (paper)"
and "0.75p–min(1, 1.25p)"; the volume estimate read "scaled by 3.26 and widened by this
host's 4 recent runs"; the out-of-distribution warning and the model card each said one
thing twice."""

from __future__ import annotations

import io
import json
import re
import zipfile

import numpy as np
import pytest
from PIL import Image

# what a page message must not carry: library names, a programmer's advice, the
# estimator's and the paper's internal terms, a Python error class
BANNED = re.compile(
    r"force=True|pip install|Traceback|\bPillow\b|\bPIL\b|\bpydicom\b|\bnibabel\b|torch\.fx"
    r"|\(paper\)|0\.75p|scaled by|widened by|\b[A-Z]\w*(?:Error|Exception):"
)


def _png(size: int = 64) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.full((size, size, 3), 128, np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def _bad_files() -> dict[str, bytes]:
    """Files a user drops by mistake, or that arrive damaged."""
    png = _png()
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as written:
        written.writestr("slice1.dcm", b"not a dicom slice at all")
    return {
        "scan.dcm": b"this is a text file with a .dcm name\n" * 4,
        "scan-preamble.dcm": b"\0" * 128 + b"DICM" + b"\x02\x00\x10\x00UI\xff\x7f",
        "photo.png": png[: len(png) // 2],  # truncated
        "notes.png": b"plain text, not a picture",
        "volume.nii": b"\0" * 400,
        "series.zip": archive.getvalue(),
    }


@pytest.mark.parametrize("name", sorted(_bad_files()))
def test_a_file_that_cannot_be_read_is_refused_in_plain_words(name, tmp_path):
    from krypton.io.images import ImageLoadError, load_image
    from krypton.io.volumes import read_volume

    path = tmp_path / name
    path.write_bytes(_bad_files()[name])
    messages = []
    for reader in (load_image, read_volume):
        try:
            reader(path)
        except ImageLoadError as exc:
            messages.append(str(exc))
        except Exception as exc:  # noqa: BLE001 - any other kind is itself the defect
            pytest.fail(f"{reader.__name__}({name}) raised {type(exc).__name__}: {exc}")
    assert messages, f"{name} was read"
    for message in messages:
        assert not BANNED.search(message), message
        assert name in message or path.stem in message, message  # it names the file


def _strings(node) -> list[str]:
    """Every text a serialised Dash layout shows: children, labels, titles, placeholders."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("children", "label", "title", "placeholder") and isinstance(value, str):
                found.append(value)
            found += _strings(value)
    elif isinstance(node, list):
        for value in node:
            found += [value] if isinstance(value, str) else _strings(value)
    return found


def test_the_page_says_nothing_in_a_librarys_or_a_papers_terms(krypton_app):
    served = krypton_app.layout() if callable(krypton_app.layout) else krypton_app.layout
    layout = json.loads(json.dumps(served, cls=_PlotlyEncoder()))
    texts = _strings(layout)
    assert any("Run" in text for text in texts)  # the walk reads the page's words
    offending = [text for text in texts if BANNED.search(text)]
    assert offending == []


def _PlotlyEncoder():
    from plotly.utils import PlotlyJSONEncoder

    return PlotlyJSONEncoder


@pytest.mark.parametrize("name", ["fundus-demo", "chestct-slice-demo"])
def test_the_model_card_says_each_thing_once_in_plain_words(name):
    import krypton
    from webapp.panels.image.estimate import model_card

    card = model_card(krypton.load_model(name))
    card = json.loads(json.dumps(card, cls=_PlotlyEncoder()))
    text = " ".join(_strings(card))
    assert text.count("not a medical device") == 1, text
    assert not BANNED.search(text), BANNED.search(text)


def test_the_colour_scale_and_the_estimates_basis_are_in_plain_words():
    from krypton.estimator import plain_basis
    from krypton.render.overlay import OverlayStyle, styled_heatmap

    label = styled_heatmap(np.array([[0.2, 0.5]]), 0.8, OverlayStyle()).label
    assert not BANNED.search(label) and "75% to 125%" in label
    sources = {
        "calibration (2026-11-27), scaled by 3.26 and widened by this host's 4 recent runs": (
            "from the model's calibration, adjusted to this machine's 4 recent runs"
        ),
        "calibration (2026-11-27)": "from the model's calibration (first runs on this machine)",
        "this host's last 6 runs; range from the errors of this host's last 16 estimates": (
            "from this machine's last 6 runs"
        ),
        "this host's last 1 run, in proportion": "from this machine's last 1 run",
        "this host's last 2 runs with every cell known": (
            "from this machine's last 2 runs with every cell known"
        ),
    }
    for source, said in sources.items():
        assert plain_basis(source) == said
        assert not BANNED.search(said)
