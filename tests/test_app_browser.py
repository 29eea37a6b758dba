"""The web app in a real (headless) Chromium, through dash[testing].

upload -> drag a region -> run -> heatmap with progress; cancel; refinement reuses cells;
a bad upload shows its message; a user model registered by upload. The first test saves
the screenshot the README shows into out/screenshot.png (ignored by git; copy it to
docs/screenshot.png to update README's picture).
"""

import re
import time
from pathlib import Path

import pytest
import torch
import torchvision
from conftest import FUNDUS_SAMPLE
from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.browser


SAMPLE = FUNDUS_SAMPLE  # one planted exudate (the fundus_png fixture, conftest.py)


def gallery_sample(name="fundus-exudates.png"):
    """A generated gallery sample, regenerated with its lesions' positions."""
    from demo.fundus.train import GALLERY
    from krypton.synthetic.fundus import FundusGenerator

    seed, plant = GALLERY[name]
    return FundusGenerator(seed=seed).sample(rendering="colour", **plant)


def around_lesion(margin=34, sample=None):
    """Drag fractions for a region around the (first) planted lesion."""
    sample = sample or SAMPLE
    lesion, size = sample.lesions[0], sample.image.shape[0]
    low = [max(0.02, (v - margin) / size) for v in (lesion.x, lesion.y)]
    high = [min(0.98, (v + margin) / size) for v in (lesion.x, lesion.y)]
    return tuple(low), tuple(high)


def upload(dash_duo, selector, path):
    dash_duo.find_element(f"{selector} input[type=file]").send_keys(str(path))


def _settled_rect(dash_duo, element, timeout=20):
    """The element's on-screen box once the page is quiet: no Dash callback pending and
    the box unchanged for 0.3 s (a late callback can still shift the layout under a drag)."""
    deadline = time.time() + timeout
    previous = None
    while time.time() < deadline:
        idle = dash_duo._wait_for_callbacks()
        rect = dash_duo.driver.execute_script(
            "const r = arguments[0].getBoundingClientRect();"
            "return [r.left, r.top, r.width, r.height];",
            element,
        )
        if idle and rect == previous:
            return rect
        previous = rect
        time.sleep(0.3)
    return previous


def drag_region(
    dash_duo,
    start=(0.2, 0.2),
    end=(0.75, 0.7),
    attempts=5,
    graph="#image-graph",
    region_text="#region-text",
) -> str:
    """Drag a box on a figure (fractions of its plot area), as a mouse would: the image,
    or ``graph`` (a volume's view, whose region shows in ``region_text``); the region text
    it produced.

    The figure re-renders when the prediction arrives and late callbacks can move it; a
    drag that lands mid-render selects nothing, so each try first waits for a quiet page
    and the gesture is repeated until the page shows the region."""
    if graph == "#image-graph":
        dash_duo.wait_for_element("#image-graph .imagelayer image", timeout=30)
    before = dash_duo.find_element(region_text).text
    for _ in range(attempts):
        layer = dash_duo.find_element(f"{graph} .nsewdrag")
        try:
            # the gallery can push the figure below the fold; a drag must happen on screen
            dash_duo.driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", layer)
            left, top, width, height = _settled_rect(dash_duo, layer)
        except StaleElementReferenceException:  # the figure re-rendered: find it again
            continue
        x0, y0 = int(left + width * start[0]), int(top + height * start[1])
        x1, y1 = int(left + width * end[0]), int(top + height * end[1])
        actions = ActionChains(dash_duo.driver)
        pointer = actions.w3c_actions.pointer_action
        pointer.move_to_location(x0, y0)
        pointer.pointer_down()
        pointer.move_to_location((x0 + x1) // 2, (y0 + y1) // 2)
        pointer.move_to_location(x1, y1)
        pointer.pointer_up()
        actions.perform()
        deadline = time.time() + 10
        while time.time() < deadline:
            text = dash_duo.find_element(region_text).text
            if text.startswith("Region") and text != before:
                return text
            time.sleep(0.1)
    raise TimeoutException(f"the drag on {graph} did not change the region (still {before!r})")


def press_run(dash_duo, timeout=60):
    """Press Run once it is enabled, as a user can: right after a run's summary shows, the
    button comes back a moment later (its busy flag clears in the next callback), longer
    on a busy host, and a click on the disabled button does nothing."""
    deadline = time.monotonic() + timeout
    while not dash_duo.find_element("#run").is_enabled() and time.monotonic() < deadline:
        time.sleep(0.1)
    dash_duo.find_element("#run").click()


def choose(dash_duo, dropdown_id, text, prefix=False):
    """Open a dcc.Dropdown and click the option with this text (or starting with it) —
    Dash 4 renders the open list in a portal, outside the dropdown element."""
    dash_duo.find_element(f"#{dropdown_id}").click()
    deadline = time.time() + 10
    while time.time() < deadline:
        for option in dash_duo.driver.find_elements(By.CSS_SELECTOR, ".dash-dropdown-option"):
            label = option.text.strip()
            if option.is_displayed() and (label.startswith(text) if prefix else label == text):
                option.click()
                dash_duo.wait_for_contains_text(f"#{dropdown_id}", text, timeout=10)
                return
        time.sleep(0.2)
    raise AssertionError(f"no option {text!r} in #{dropdown_id}")


def wait_for_result(dash_duo, timeout=240):
    dash_duo.wait_for_contains_text("#result-summary", "positions computed", timeout=timeout)
    return dash_duo.find_element("#result-summary").text


def test_gallery_region_run_shows_heatmap_with_progress(dash_duo, krypton_app):
    """The README screenshot: the gallery's generated exudates sample, a region around
    an exudate, exact (reproducible from the gallery). README's picture was taken at
    stride 2; the test runs stride 4, a quarter of the positions, to keep `make test`
    short, and saves its own screenshot in out/."""
    dash_duo.start_server(krypton_app)
    dash_duo.wait_for_element("#upload", timeout=20)
    dash_duo.find_element("button[id*='fundus-exudates.png']").click()
    dash_duo.wait_for_contains_text("#top5", "EXUDATE", timeout=60)
    # fundus-demo opens with its own default patch (its registry entry's), not 16
    dash_duo.wait_for_contains_text("#patch", "12x12", timeout=10)
    drag_region(dash_duo, *around_lesion(sample=gallery_sample()))
    region = dash_duo.find_element("#region-text").text
    choose(dash_duo, "stride", "4")
    dash_duo.find_element("#run").click()
    progress_seen = ""
    deadline = time.time() + 120
    while (
        time.time() < deadline
        and "positions computed" not in dash_duo.find_element("#result-summary").text
    ):
        status = dash_duo.find_element("#live-status").text
        if " of " in status:
            progress_seen = status
        time.sleep(0.1)
    summary = wait_for_result(dash_duo)
    assert progress_seen, "no progress was shown while the run was going"
    assert "EXUDATE" in summary and "exact" in summary
    assert dash_duo.find_elements("#heatmap-graph .heatmaplayer") or dash_duo.find_elements(
        "#heatmap-graph g.hm"
    )
    assert "Region x" in region
    assert dash_duo.find_element("#run").is_enabled()
    (ROOT / "docs").mkdir(exist_ok=True)
    (ROOT / "out").mkdir(exist_ok=True)
    save_page_screenshot(dash_duo.driver, ROOT / "out" / "screenshot.png")


def save_page_screenshot(driver, path: Path) -> None:
    """The whole page, top to bottom: the drag scrolled the image to the middle of the
    window, which left the heatmap above the visible part of the screenshot."""
    width = driver.get_window_size()["width"]
    height, bars = driver.execute_script(
        "return [document.documentElement.scrollHeight, window.outerHeight - window.innerHeight]"
    )
    driver.set_window_size(width, height + bars)
    driver.execute_script("window.scrollTo(0, 0)")
    time.sleep(0.5)  # let the figures re-layout at the new size
    driver.save_screenshot(str(path))


def test_cancel_stops_the_run_and_keeps_its_cells_as_a_partial_heatmap(
    dash_duo, krypton_app, fundus_png
):
    """Before: a Cancel threw the positions computed away (476 of 2,809 in one run) and
    left the previous run's heatmap or none."""
    dash_duo.start_server(krypton_app)
    dash_duo.wait_for_element("#upload", timeout=20)
    upload(dash_duo, "#upload", fundus_png)
    dash_duo.wait_for_contains_text("#top5", "EXUDATE", timeout=60)
    choose(dash_duo, "stride", "2")
    choose(dash_duo, "patch", "4x4")
    dash_duo.find_element("input[value=naive]").click()  # 12,321 full inferences: long
    dash_duo.find_element("#run").click()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the first chunk (16 positions) is in
        done = re.match(r"([\d,]+) of", dash_duo.find_element("#live-status").text)
        if done and int(done.group(1).replace(",", "")) >= 16:
            break
        time.sleep(0.1)
    dash_duo.find_element("#cancel").click()
    dash_duo.wait_for_contains_text("#message", "Run cancelled", timeout=20)
    # The run stops after the batch in flight: 16 full inferences, which took over 2 s
    # while the other test worker ran 3-D models (a fixed 2 s wait failed once in 505).
    dash_duo.wait_for_contains_text("#message", "Partial heatmap", timeout=40)
    dash_duo.wait_for_contains_text("#result-summary", "Partial heatmap", timeout=20)
    summary = dash_duo.find_element("#result-summary").text
    found = re.search(r"cancelled with ([\d,]+) of ([\d,]+) positions", summary)
    assert found, summary
    known, total = (int(part.replace(",", "")) for part in found.groups())
    assert 16 <= known < total and "Press Run to compute only the rest" in summary
    title = dash_duo.find_element("#heatmap-graph .gtitle").text
    assert "partial: run cancelled" in title, title
    deadline = time.monotonic() + 30
    while not dash_duo.find_element("#run").is_enabled() and time.monotonic() < deadline:
        time.sleep(0.25)
    assert dash_duo.find_element("#run").is_enabled()
    time.sleep(2)  # and nothing arrives after the cancel
    assert dash_duo.find_element("#result-summary").text == summary
    # Run again: it starts from the cells the cancelled run kept
    dash_duo.find_element("#run").click()
    dash_duo.wait_for_contains_text("#live-status", f" of {total} positions", timeout=60)
    first = re.match(r"([\d,]+) of", dash_duo.find_element("#live-status").text)
    assert first and int(first.group(1).replace(",", "")) >= known
    dash_duo.find_element("#cancel").click()
    dash_duo.wait_for_contains_text("#message", "Run cancelled", timeout=20)


def test_refinement_reuses_cells(dash_duo, krypton_app, fundus_png):
    dash_duo.start_server(krypton_app)
    dash_duo.wait_for_element("#upload", timeout=20)
    upload(dash_duo, "#upload", fundus_png)
    dash_duo.wait_for_contains_text("#top5", "EXUDATE", timeout=60)
    drag_region(dash_duo, (0.05, 0.05), (0.6, 0.6))
    choose(dash_duo, "stride", "8")  # ~200 positions a run (stride 4: ~800)
    dash_duo.find_element("#run").click()
    first = wait_for_result(dash_duo)
    drag_region(dash_duo, (0.3, 0.3), (0.95, 0.95))
    press_run(dash_duo)
    dash_duo.wait_for_contains_text("#reuse-info", "Reused", timeout=120)
    reused = int(dash_duo.find_element("#reuse-info").text.split()[1])
    second = wait_for_result(dash_duo)
    computed = int(second.split(" positions computed")[0].split()[-1])
    assert reused > 0 and computed > 0
    assert first != second


def test_bad_upload_shows_message_and_server_keeps_serving(
    dash_duo, krypton_app, tmp_path, fundus_png
):
    dash_duo.start_server(krypton_app)
    dash_duo.wait_for_element("#upload", timeout=20)
    bogus = tmp_path / "scan.png"
    bogus.write_text("this is not an image")
    upload(dash_duo, "#upload", bogus)
    dash_duo.wait_for_contains_text("#message", "is not an image file", timeout=20)
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(fundus_png.read_bytes()[:300])
    upload(dash_duo, "#upload", truncated)
    dash_duo.wait_for_contains_text("#message", "truncated", timeout=20)
    upload(dash_duo, "#upload", fundus_png)  # still works afterwards
    dash_duo.wait_for_contains_text("#top5", "EXUDATE", timeout=60)


def test_a_file_over_the_limit_is_named_with_the_limit(dash_duo, tmp_path, fundus_png):
    """dcc.Upload's max_size dropped such a file without a word: the message of the
    previous file stayed on screen."""
    from app import create_app
    from webapp.settings import ServerSettings

    settings = ServerSettings(max_image_mb=0.05, max_model_mb=0.05)
    dash_duo.start_server(create_app(tmp_path / "cache", settings=settings))
    dash_duo.wait_for_element("#upload", timeout=20)
    bogus = tmp_path / "scan.png"
    bogus.write_text("this is not an image")
    upload(dash_duo, "#upload", bogus)
    dash_duo.wait_for_contains_text("#message", "is not an image file", timeout=20)
    big = tmp_path / "big-scan.png"
    big.write_bytes(bytes(200 * 1024))
    upload(dash_duo, "#upload", big)
    dash_duo.wait_for_contains_text("#message", "big-scan.png is 0.2 MB; the limit is", timeout=20)
    assert "0.05 MB" in dash_duo.find_element("#message").text
    weights = tmp_path / "huge-weights.pt"
    weights.write_bytes(bytes(300 * 1024))
    dash_duo.find_element("#model-upload-details summary").click()  # "Add your own model"
    upload(dash_duo, "#model-upload", weights)
    dash_duo.wait_for_contains_text(
        "#model-upload-name", "huge-weights.pt is 0.3 MB; the limit is 0.05 MB", timeout=20
    )


def test_user_model_upload(dash_duo, krypton_app, tmp_path, monkeypatch, krypton_home):
    registry = tmp_path / "registry"
    registry.mkdir()
    for name in ("fundus-demo.json", "fundus-demo.pt"):
        (registry / name).write_bytes((ROOT / "krypton" / "shipped_models" / name).read_bytes())
    monkeypatch.setenv("KRYPTON_MODELS_DIR", str(registry))
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=4).eval()
    torch.save(model.state_dict(), tmp_path / "oct.pt")
    dash_duo.start_server(krypton_app)
    dash_duo.wait_for_element("#upload", timeout=20)
    dash_duo.find_element("#model-upload-details summary").click()
    upload(dash_duo, "#model-upload", tmp_path / "oct.pt")
    dash_duo.wait_for_contains_text("#model-upload-name", "uploaded: oct.pt", timeout=60)
    dash_duo.find_element("#model-name").send_keys("oct-resnet18")
    choose(dash_duo, "model-architecture", "resnet18")
    dash_duo.find_element("#model-classes").send_keys("CNV, DME, DRUSEN")  # one short
    dash_duo.find_element("#model-register").click()
    dash_duo.wait_for_contains_text("#model-register-message", "fc.weight has shape", timeout=60)
    dash_duo.find_element("#model-classes").send_keys(", NORMAL")
    dash_duo.find_element("#model-register").click()
    dash_duo.wait_for_contains_text(
        "#model-register-message", "registered 'oct-resnet18'", timeout=60
    )
    assert (krypton_home / "models" / "oct-resnet18.json").exists()
    assert not (registry / "oct-resnet18.json").exists()  # shipped models' folder untouched
    dash_duo.wait_for_contains_text("#model", "oct-resnet18", timeout=20)


def test_two_tabs_running_at_once_keep_their_own_results(dash_duo, krypton_app, fundus_png):
    dash_duo.start_server(krypton_app)
    driver = dash_duo.driver
    first_tab = driver.current_window_handle
    dash_duo.wait_for_element("#upload", timeout=20)
    upload(dash_duo, "#upload", fundus_png)
    dash_duo.wait_for_contains_text("#top5", "EXUDATE", timeout=60)
    drag_region(dash_duo, (0.05, 0.05), (0.5, 0.5))
    driver.switch_to.new_window("tab")
    second_tab = driver.current_window_handle
    driver.get(dash_duo.server_url)
    dash_duo.wait_for_element("#upload", timeout=20)
    upload(dash_duo, "#upload", fundus_png)
    dash_duo.wait_for_contains_text("#top5", "EXUDATE", timeout=60)
    choose(dash_duo, "stride", "16")  # whole image at stride 16: 14 x 14 positions (patch 12)
    dash_duo.find_element("#run").click()
    driver.switch_to.window(first_tab)
    dash_duo.find_element("#run").click()  # region at stride 4: a different grid
    first = wait_for_result(dash_duo)
    driver.switch_to.window(second_tab)
    second = wait_for_result(dash_duo)
    assert "196 positions computed" in second
    assert "196 positions computed" not in first
    driver.switch_to.window(first_tab)
    assert dash_duo.find_element("#result-summary").text == first


def test_out_of_distribution_warning_for_the_cat_not_for_a_generated_fundus(dash_duo, krypton_app):
    dash_duo.start_server(krypton_app)
    dash_duo.wait_for_element("#upload", timeout=20)
    dash_duo.wait_for_contains_text("#model-card", "Out-of-distribution check: on", timeout=30)
    dash_duo.find_element("button[id*='chelsea.png']").click()
    dash_duo.wait_for_contains_text("#top5", "does not look like fundus-demo", timeout=60)
    assert "not meaningful" in dash_duo.find_element("#message").text
    dash_duo.find_element("button[id*='fundus-microaneurysms.png']").click()
    dash_duo.wait_for_contains_text("#top5", "MICROANEURYSM", timeout=60)
    time.sleep(1)
    assert "does not look like" not in dash_duo.find_element("#top5").text
    assert "does not look like" not in dash_duo.find_element("#message").text
