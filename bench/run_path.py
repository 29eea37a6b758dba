"""How many times the app's code enters a module during one run, from the Run click to
the kept result: the length of the road a newcomer follows through the code.

An *entry* is a function of a project module (webapp/ or krypton/) that the app's code
(webapp/) calls from another module, directly or through a library's frames (a
context manager's generator entered by ``with``), counted once however often and from
wherever it is called (a chunk loop enters the explainer once, not once per chunk): the functions a
reader opens to follow the run. What the library then calls within itself is the
library's own road and is not counted. Measured with ``sys.setprofile`` around the
panel's Run callback, called as Dash calls it, after the page has shown its estimate.

    python -m bench.run_path
"""

from __future__ import annotations

import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = (ROOT / "webapp", ROOT / "krypton")


def _module(filename: str) -> str | None:
    """The project module a code file is, as a path from the repository, or None."""
    path = Path(filename)
    if not any(path.is_relative_to(folder) for folder in PROJECT):
        return None
    return str(path.relative_to(ROOT))


def entered_functions(call: Callable[[], object]) -> set[tuple[str, str]]:
    """Entries (functions of a project module called from webapp/ code of another
    module) made while ``call`` runs, as (module, function); each function once, every
    module apart (a package's modules are as many modules). Only the calling thread is
    followed (a run's job runs in it when its callback is called directly)."""
    entered: set[tuple[str, str]] = set()

    def profile(frame, event, _arg):
        if event != "call":
            return
        callee = _module(frame.f_code.co_filename)
        if callee is None:
            return
        caller, back = None, frame.f_back
        while back is not None and caller is None:  # past a library's frames (contextlib
            caller = _module(back.f_code.co_filename)  # entering a `with` block's
            back = back.f_back  # generator, functools' cached properties): who called it
        if caller is None or callee == caller:
            return
        if not caller.startswith("webapp"):
            return
        entered.add((callee, frame.f_code.co_qualname))

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(previous)
    return entered


def module_entries(functions: set[tuple[str, str]]) -> Counter[str]:
    """Entries per module entered."""
    return Counter(module for module, _ in functions)


@contextmanager
def callback_context() -> Iterator[None]:
    """Dash's context of a callback (its request headers), as a background callback has
    it, around a panel callback called directly."""
    from dash._callback_context import context_value
    from dash._utils import AttributeDict

    token = context_value.set(AttributeDict(headers={}, triggered_inputs=[]))
    try:
        yield
    finally:
        context_value.reset(token)


def image_run_functions(services, session: str = "bench") -> set[tuple[str, str]]:
    """The entries (:func:`entered_functions`) of one exact image run of the default
    model's sample, through the image panel's Run callback (its first run: no cells
    known; warmed once before, so the model's loading is not on the road)."""
    from PIL import Image

    from krypton.synthetic.fundus import FundusGenerator
    from webapp.panels.image import ImagePanel

    image = Image.fromarray(FundusGenerator(seed=3).sample(label=1, lesions=1).image)
    record = {"key": services.images.put(image), "name": "fundus.png"}
    panel = ImagePanel(services, None)
    settings = ("fundus-demo", 16, 16, "exact", "gray", None, None, (64, 64, 160, 160),
                0.9, 0.25, 3.0, True, None)  # fmt: skip

    def shown(region) -> dict | None:  # what the page's estimate line keeps for Run
        return ImagePanel(services).estimate_shown(
            "fundus-demo", 16, 16, "exact", region, 0.25, 3.0, None, record, "gray", None
        )[1]

    def click(region, estimate) -> object:
        # the page's controls: patch, stride, mode, colour, custom colour, class, region,
        # quality target, drill-down, speed-up, snap, overlay, Compare, its layer and
        # steps; and the estimate the page showed for them
        values = list(settings)
        values[7] = region
        with callback_context():
            handle, message = panel.run(
                lambda *a: None, 1, session, record, *values, None, None, None, estimate
            )
        if message:
            raise RuntimeError(message)
        return handle

    click((0, 0, 96, 96), None)  # warm: the model loaded, its views materialised
    region = (64, 64, 160, 160)
    estimate = shown(region)
    return entered_functions(lambda: click(region, estimate))


def main() -> None:
    from webapp.services import Services

    services = Services(Path(tempfile.mkdtemp()) / "cache")
    functions = image_run_functions(services)
    entries = module_entries(functions)
    print("| module entered | entries |\n|---|---|")
    for module, count in entries.most_common():
        print(f"| {module} | {count} |")
    print(f"\none image run enters {len(functions)} functions of {len(entries)} modules")


if __name__ == "__main__":
    main()
