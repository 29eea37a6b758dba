"""What the server says is true and readable: upload errors, the server log."""

import logging

import torch

from krypton.registry import CheckpointError, register_model


def test_a_pickled_object_is_refused_without_unsafe_advice(tmp_path):
    torch.save({"model": torch.nn.Linear(2, 2)}, tmp_path / "whole.pt")  # a whole module
    try:
        register_model("whole", tmp_path / "whole.pt", ["a", "b"], architecture="resnet18")
    except CheckpointError as exc:
        message = str(exc)
    assert "save model.state_dict()" in message
    assert "weights_only" not in message and "arbitrary code" not in message


def test_the_server_log_has_no_line_per_poll():
    from app import QuietPolls

    quiet = QuietPolls()

    def line(text):
        return logging.LogRecord("werkzeug", logging.INFO, "", 0, text, (), None)

    assert not quiet.filter(
        line(
            '127.0.0.1 - - [x] "POST /_dash-update-component?endId=a'
            '&cacheKey=b&job=3 HTTP/1.1" 200 -'
        )
    )
    assert not quiet.filter(line('127.0.0.1 - - [x] "POST /_dash-update-component HTTP/1.1" 204 -'))
    assert quiet.filter(line('127.0.0.1 - - [x] "POST /_dash-update-component HTTP/1.1" 500 -'))
    assert quiet.filter(line('127.0.0.1 - - [x] "GET / HTTP/1.1" 200 -'))


def test_page_messages_controls_and_placeholders_over_http(tmp_path):
    """Small truths of the page, through the real server: a stale 'region too small'
    message goes when the region changes, Cancel does not promise a heatmap it does not
    have, Exact/Approximate are disabled for a model torch.fx cannot capture, and before
    any result the panels say what to do and the downloads are disabled."""
    import json

    from bench.dash_client import Server, Tab, find
    from conftest import FUNDUS_SAMPLE
    from PIL import Image

    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 2, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten()
    ).eval()
    torch.jit.script(model).save(str(tmp_path / "m.ts"))
    register_model(
        "scripted",
        tmp_path / "m.ts",
        ["a", "b"],
        format="torchscript",
        input_size=(64, 64),
        directory=tmp_path / "home" / "models",
    )
    server = Server(tmp_path)
    try:
        tab = Tab(server.url)
        heatmap = find(tab.layout, "heatmap-graph")["props"]["figure"]
        assert heatmap["layout"]["annotations"][0]["text"] == "Press Run to compute the heatmap"
        exports = [
            c
            for c in components(tab.layout)
            if isinstance(c["props"].get("id"), dict) and c["props"]["id"].get("type") == "export"
        ]
        assert len(exports) == 6 and all(c["props"]["disabled"] for c in exports)
        image = tab.upload_image(Image.fromarray(FUNDUS_SAMPLE.image))
        small = tab.run(image, region=[0, 0, 8, 8])
        assert "smaller than the 16-pixel patch" in json.dumps(small["response"])
        cleared = tab.call(
            "message.children",
            {"region-store.data": [0, 0, 64, 64], "patch.value": 16, "stride.value": 16},
        )
        assert cleared.json()["response"]["message"]["children"] == ""
        cancelled = tab.call("message.children", {"cancel.n_clicks": 1, "result-store.data": None})
        assert cancelled.json()["response"]["message"]["children"] == "Run cancelled."
        answer = tab.predict(image, "scripted")
        modes = {o["value"]: o.get("disabled", False) for o in answer["mode"]["options"]}
        assert modes == {"naive": False, "exact": True, "approximate": True}
        assert answer["mode"]["value"] == "naive"
        assert "Only naive mode works" in answer["message"]["children"]
        answer = tab.predict(image, "fundus-demo")
        assert not any(o.get("disabled") for o in answer["mode"]["options"])
    finally:
        server.stop()


def components(node):
    """Every component in a serialised Dash layout."""
    if isinstance(node, dict):
        if "props" in node and "type" in node:
            yield node
        for value in node.values():
            yield from components(value)
    elif isinstance(node, list):
        for value in node:
            yield from components(value)
