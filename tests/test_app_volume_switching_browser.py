"""A volume result is bound to the volume on screen, in a real (headless) Chromium.

The image panel's switching test, for the volume panel: four chest CTs are uploaded in
turn 20 times at random moments — idle, mid-run, right after a run — and the page is
sampled every 100 ms after each switch. Once the panel names the new volume, no live
picture may be there, and a prediction (the summary's "p = "), heatmap over the views or
enabled download only where the tab's kept result is the new volume's own (a summary
names the volume it explains: the tab keeps one result, often another volume's)."""

import random
import time

import pytest
from test_app_browser import upload
from test_app_volume_browser import write_chest

pytestmark = [pytest.mark.browser, pytest.mark.underload]

# The page's own record of what the user asked for last (VOLUME_PANEL.wanted, set by
# the browser-side rule in the same step that hides the old volume's description and
# disables Run), read from Dash's store in the same script as the page, before it: the
# moment the page has seen the new file. On a starved host the browser takes its time to
# see a file chosen; from then on nothing of the old volume may be offered. (A fixed 0.3 s
# after Selenium chose the file measured the host, not the page.)
PAGE = """
const store = window.store.getState();
let wanted = store.layout;
for (const key of store.paths.strs['volume-wanted']) { wanted = wanted[key]; }
const infoBox = document.querySelector('#volume-info');
const info = infoBox.innerText;
const summaryBox = document.querySelector('#volume-summary');
const plot = document.querySelector('#volume-graph-axial .js-plotly-plot');
const traces = plot && plot._fullData
  ? plot._fullData.filter(t => t.type === 'heatmap').length : 0;
const live = document.querySelector('#volume-live-panel');
const nifti = document.querySelector(".volume-panel button[id*='nifti']");
return {
  wanted: wanted.props.data || null,
  info: info,
  summary: summaryBox.innerText,
  info_shown: infoBox.offsetParent !== null,
  summary_shown: summaryBox.offsetParent !== null && summaryBox.innerText.trim() !== '',
  traces: traces,
  live: live ? getComputedStyle(live).display : 'none',
  download_disabled: nifti ? nifti.disabled : true,
  run_disabled: document.querySelector('#volume-run').disabled,
};
"""


def page(dash_duo) -> dict:
    return dash_duo.driver.execute_script(PAGE)


def test_switching_volumes_at_random_moments_never_shows_another_volumes_result(
    dash_duo, krypton_app, tmp_path, busy_host
):
    files = []
    for seed in (40, 41, 42, 43):
        path = tmp_path / f"chest{seed}.nii.gz"
        write_chest(path, seed=seed)
        files.append(path)
    dash_duo.start_server(krypton_app)
    dash_duo.wait_for_element("#volume-upload", timeout=20)
    stride = dash_duo.find_element("#volume-stride")
    stride.clear()
    stride.send_keys("8")  # 216 positions over the block: a few seconds a run
    current = files[0]
    upload(dash_duo, "#volume-upload", current)
    dash_duo.wait_for_contains_text("#volume-info", current.name, timeout=60)
    dash_duo.wait_for_element("#volume-run:not([disabled])", timeout=30)

    rng = random.Random(11)
    seen = {"idle": 0, "mid-run": 0, "after a run": 0}
    for _ in range(20):
        moment = rng.choice(tuple(seen))
        seen[moment] += 1
        if moment != "idle":
            dash_duo.find_element("#volume-run").click()
            if moment == "mid-run":
                time.sleep(rng.uniform(0.2, 1.5))
            else:
                dash_duo.wait_for_contains_text("#volume-summary", "p = ", timeout=240)
        current = rng.choice([path for path in files if path != current])
        upload(dash_duo, "#volume-upload", current)
        began, samples = time.time(), 0
        while time.time() - began < 120:
            state = page(dash_duo)
            named = state["info_shown"] and state["info"].startswith(current.name)
            if not named and state["wanted"] == f"upload:{current.name}":
                # once the page has seen the new file and until the panel describes it,
                # nothing of another volume's is offered: Run waits, no summary, no
                # description
                assert state["run_disabled"], (moment, state)
                assert not state["summary_shown"], (moment, state)
                assert not state["info_shown"], (moment, state)
            if named and not state["run_disabled"]:
                break
            if state["info"].startswith(current.name):  # the new volume is named
                samples += 1
                assert state["live"] == "none", (moment, state)  # no run of it goes on
                if current.name not in state["summary"]:  # the kept result is another's
                    assert "p = " not in state["summary"], (moment, state)
                    assert state["traces"] <= 1, (moment, state)  # no heatmap over it
                    assert state["download_disabled"], (moment, state)
            time.sleep(0.1)
        # the panel names the new volume and is ready for it
        dash_duo.wait_for_contains_text("#volume-info", current.name, timeout=60)
        dash_duo.wait_for_element("#volume-run:not([disabled])", timeout=60)
        assert samples or page(dash_duo)["info"].startswith(current.name)
        assert page(dash_duo)["wanted"] == f"upload:{current.name}"  # the page saw the file
        state = page(dash_duo)
        if "p = " in state["summary"] or state["traces"] > 1:  # only the shown volume's
            assert current.name in state["summary"], (moment, state)
    assert all(seen.values()), seen


def test_the_old_volume_goes_at_the_click_not_when_the_upload_has_arrived(
    dash_duo, krypton_app, tmp_path, monkeypatch
):
    """The rule that hides the old volume's description and disables Run waits for no
    upload: with the new file's POST held on the server, the page has already hidden
    them (a rule that also listened to the upload's ticket waited for the whole POST:
    seconds for a large series on a busy host, with Run enabled)."""
    import threading

    from webapp.uploads import UploadStore

    files = []
    for seed in (40, 41):
        path = tmp_path / f"chest{seed}.nii.gz"
        write_chest(path, seed=seed)
        files.append(path)
    dash_duo.start_server(krypton_app)
    dash_duo.wait_for_element("#volume-upload", timeout=20)
    upload(dash_duo, "#volume-upload", files[0])
    dash_duo.wait_for_contains_text("#volume-info", files[0].name, timeout=60)
    dash_duo.wait_for_element("#volume-run:not([disabled])", timeout=30)

    held, release, save = threading.Event(), threading.Event(), UploadStore.save

    def slow_save(self, *args, **kwargs):
        held.set()
        release.wait(60)  # the POST of the second file waits for the test
        return save(self, *args, **kwargs)

    monkeypatch.setattr(UploadStore, "save", slow_save)
    upload(dash_duo, "#volume-upload", files[1])
    try:
        assert held.wait(30), "the second file was never posted"
        deadline = time.time() + 30
        while time.time() < deadline:
            state = page(dash_duo)
            if not state["info_shown"] and state["run_disabled"]:
                break
            time.sleep(0.1)
        assert not state["info_shown"] and state["run_disabled"], state
    finally:
        release.set()
    dash_duo.wait_for_contains_text("#volume-info", files[1].name, timeout=60)
