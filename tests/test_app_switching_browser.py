"""A prediction is bound to the image on screen, in a real (headless) Chromium.

After another image was clicked, the old image's top 5 and "Class to explain" stayed
beside the new image for over 4 s on a busy host, with Run enabled: pressed then, Run
explained the new image for the old image's class. Here the page switches image 20
times at random moments — idle, mid-run, right after a run — and is sampled every 50 ms
after each switch: a top 5 or class list on screen is the shown image's (beside the
previous picture for at most one redraw of the plot), and Run is enabled only once the
shown image's own prediction is there."""

import random
import time

import pytest
from test_app_browser import choose

pytestmark = pytest.mark.browser

SAMPLES = (
    "fundus-exudates.png",
    "fundus-normal-disc.png",
    "fundus-microaneurysms.png",
    "retina.jpg",
)

REDRAW = 1.0  # seconds: a Plotly redraw of the picture, slowed by a live heatmap mid-run

PAGE = """
const plot = document.querySelector('#image-graph .js-plotly-plot');
const source = plot && plot.data && plot.data[0] ? String(plot.data[0].source) : '';
const label = document.querySelector('#label');
return {
  image: source.length + ':' + source.slice(-40),
  top5: document.querySelector('#top5').innerText.trim(),
  label: label ? label.innerText.trim() : '',
  run_disabled: document.querySelector('#run').disabled,
  summary: document.querySelector('#result-summary').innerText,
};
"""


def page(dash_duo) -> dict:
    return dash_duo.driver.execute_script(PAGE)


def show(dash_duo, name: str) -> None:
    dash_duo.find_element(f"button[id*='{name}']").click()


def settled(dash_duo, timeout: float = 60) -> dict:
    """The page once the shown image's prediction is on screen."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = page(dash_duo)
        if state["top5"] and not state["run_disabled"]:
            time.sleep(0.3)
            again = page(dash_duo)
            if again["image"] == state["image"] and again["top5"] == state["top5"]:
                return again
        time.sleep(0.1)
    raise AssertionError(f"no prediction within {timeout} s: {page(dash_duo)}")


def test_switching_images_at_random_moments_never_shows_another_images_prediction(
    dash_duo, krypton_app
):
    dash_duo.start_server(krypton_app)
    dash_duo.wait_for_element("#upload", timeout=20)
    choose(dash_duo, "stride", "16")  # short runs: a few seconds each
    expected: dict[str, tuple[str, str]] = {}
    before = page(dash_duo)["image"]
    for name in SAMPLES:
        show(dash_duo, name)
        deadline = time.time() + 30
        while page(dash_duo)["image"] == before and time.time() < deadline:
            time.sleep(0.1)  # the new image is on screen
        state = settled(dash_duo)
        before = state["image"]
        expected[state["image"]] = (state["top5"], state["label"])
    assert len(expected) == len(SAMPLES), "two samples look alike to the test"

    rng = random.Random(7)
    current = SAMPLES[-1]
    seen = {"idle": 0, "mid-run": 0, "after a run": 0}
    for _ in range(20):
        moment = rng.choice(tuple(seen))
        seen[moment] += 1
        if moment != "idle":
            dash_duo.find_element("#run").click()
            if moment == "mid-run":
                time.sleep(rng.uniform(0.2, 1.5))
            else:
                dash_duo.wait_for_contains_text("#result-summary", "p = ", timeout=240)
        current = rng.choice([name for name in SAMPLES if name != current])
        show(dash_duo, current)
        began = time.time()
        mismatch_since = None
        while time.time() - began < 2.5:
            state = page(dash_duo)
            own = expected.get(state["image"])
            assert own is not None, f"an image the test never saw: {state['image']}"
            # a top 5 or class beside another image's picture, or Run enabled without the
            # picture's own prediction; Plotly draws a new picture a few tens of ms after
            # the page's stores say it is on screen, so this may last one redraw, never
            # longer (before: over 4 s, Run enabled)
            stale = (state["top5"] and state["top5"] != own[0]) or (
                not state["run_disabled"] and (state["top5"] != own[0] or state["label"] != own[1])
            )
            if stale:
                mismatch_since = mismatch_since or time.time()
                assert time.time() - mismatch_since < REDRAW, (moment, state, own)
            else:
                mismatch_since = None
            time.sleep(0.05)
        settled(dash_duo)
    assert all(seen.values()), seen
