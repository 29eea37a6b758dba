"""The analyst's terms on the page carry plain words: every control label that names a
term of the glossary has it as a tooltip, in the image and the volume panels alike."""

import json

import plotly

from webapp.glossary import GLOSSARY
from webapp.layout import build_layout


def _labels(node, found):
    if isinstance(node, dict):
        if node.get("type") == "Label":
            props = node.get("props", {})
            children = props.get("children")
            text = children if isinstance(children, str) else (children or [None])[0]
            found.append((text, props.get("title")))
        for value in node.values():
            _labels(value, found)
    elif isinstance(node, list):
        for value in node:
            _labels(value, found)
    return found


def test_every_term_on_the_page_has_its_plain_words_as_a_tooltip():
    page = json.loads(json.dumps(build_layout([], None), cls=plotly.utils.PlotlyJSONEncoder))
    labels = _labels(page, [])
    shown = {text for text, _ in labels}
    for term in ("Patch size", "Stride", "Mode", "Target SSIM", "Drill-down fraction",
                 "Cube (voxels)", "Display window", "Class to explain"):  # fmt: skip
        assert term in shown, term
    for text, title in labels:
        if text in GLOSSARY:
            assert title == GLOSSARY[text], text
    # the volume panel's Stride and Mode say what the image panel's say
    assert sum(1 for text, title in labels if text == "Stride" and title) == 2
    assert "τ" in GLOSSARY["Target SSIM"] and "share" in GLOSSARY["Target SSIM"]
