"""The page on a laptop: at 1366×768 (and at 1400×1000 and 1920×1080) the image, Run, the
estimate line and the summary's first lines are visible without scrolling, and nothing
scrolls sideways. At 1366×768 Run sat at y 814-843 below a 768-px fold, the estimate
line was cut mid-sentence and the sample strip scrolled sideways."""

from __future__ import annotations

import pytest
from test_app_browser import choose
from test_app_switching_browser import settled, show

pytestmark = [pytest.mark.browser]

SIZES = ((1366, 768), (1400, 1000), (1920, 1080))
BOXES = """return Object.fromEntries(arguments[0].map(sel => {
    const el = document.querySelector(sel);
    if (!el) return [sel, null];
    const r = el.getBoundingClientRect();
    return [sel, {top: r.top, bottom: r.bottom, left: r.left, right: r.right,
                  width: r.width, height: r.height,
                  clipped: el.scrollWidth > el.clientWidth + 1}];
}));"""
VIEWPORT = "return [window.innerWidth, window.innerHeight, document.documentElement.scrollWidth];"


def boxes(dash_duo, *selectors: str) -> dict:
    return dash_duo.driver.execute_script(BOXES, list(selectors))


def test_image_run_estimate_and_summary_fit_without_scrolling(dash_duo, krypton_app):
    """Each size in one browser and one server (the page is loaded again at each size):
    three servers and browsers cost a minute of the suite for the same page."""
    dash_duo.start_server(krypton_app)
    for size in SIZES:
        _fits_at(dash_duo, *size)


def _fits_at(dash_duo, width: int, height: int) -> None:
    """The page loaded afresh at ``width`` x ``height``: the picture, Run and the estimate
    line above the fold and nothing scrolling sideways before a run, the summary's first
    lines above the fold after it."""
    dash_duo.driver.set_window_size(width, height)
    inner = dash_duo.driver.execute_script("return [window.innerWidth, window.innerHeight];")
    # the browser's own bars: make the page's viewport the size asked for
    dash_duo.driver.set_window_size(2 * width - inner[0], 2 * height - inner[1])
    dash_duo.driver.get(dash_duo.server_url)
    dash_duo.wait_for_element("#upload", timeout=20)
    choose(dash_duo, "stride", "16")
    show(dash_duo, "fundus-exudates.png")
    settled(dash_duo)
    view_width, view_height, page_width = dash_duo.driver.execute_script(VIEWPORT)
    assert (view_width, view_height) == (width, height)
    assert page_width <= view_width, f"the page scrolls sideways: {page_width} > {view_width}"
    gallery = boxes(dash_duo, ".gallery")[".gallery"]
    assert gallery is not None and not gallery["clipped"], "the sample strip scrolls sideways"
    found = boxes(dash_duo, "#image-graph", "#run", "#estimate")
    for selector, box in found.items():
        assert box is not None, selector
        assert box["bottom"] <= view_height and box["right"] <= view_width, (selector, box)
    assert not found["#estimate"]["clipped"], (width, height, "the estimate line is cut")
    dash_duo.find_element("#run").click()
    # the first size's run computes its positions; the next sizes' find them all known
    dash_duo.wait_for_contains_text("#result-summary", "p = ", timeout=300)
    summary = boxes(dash_duo, "#result-summary")["#result-summary"]
    assert summary["top"] + 40 <= view_height, (width, height, summary)  # its first lines
