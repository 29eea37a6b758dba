"""The page's words for a result: what a radiologist or an instructor reads, with the
detector's and the planner's terms behind "details".

The library's lines (webapp.runs.summary_lines, for images and volumes) stay whole in
the exports and the CLI; the page shows each in two parts, :func:`plain_and_detail`."""

from __future__ import annotations

import re

from dash import html

__all__ = ["plain_and_detail", "summary_children"]

# "Warning: ... (unusualness 2.7 at layer4; the threshold is 1.9)."
_OOD = re.compile(r"^(Warning: .*?) \((unusualness [^)]*)\)\.?$")
# the speed claim's measured basis: "..., the whole run: ... (measured in this run ...)."
_SPEED = re.compile(r"^(.*?(?:faster|slower) than naive|About as fast as naive[^,]*), (.*)$")

_WHOLE = re.compile(r"the whole run: (.+?) here, about (.+?) for a naive run")


def plain_and_detail(line: str) -> tuple[str | None, str | None]:
    """(what the page says in plain words, what goes behind "details") for one summary
    line; a part is None where the line has none."""
    if line.startswith("Plan: "):  # the planner's reasoning: layers, FLOPs, timings
        return None, line
    found = _OOD.match(line)
    if found:
        return (
            f"{found.group(1)}.",  # it says what it means once: not meaningful
            f"Out-of-distribution check: {found.group(2)}.",
        )
    found = _SPEED.match(line)
    if found:
        whole = _WHOLE.search(found.group(2))
        plain = f"{found.group(1)}" + (
            f": {whole.group(1)} here against about {whole.group(2)} for a naive run."
            if whole
            else "."
        )
        return plain, f"Speed: {found.group(2)}"
    if line.startswith(("Ran naive: incremental was", "Switched to ")):
        head, _, rest = line.partition(", measured")
        return f"{head}.", f"Measured{rest}" if rest else None
    return line, None


def summary_children(
    lines: list[str], strong_first: bool = True, ids: dict[str, str] | None = None
) -> list:
    """A summary's lines as the page's children: the plain parts in order (the first
    bold), the details behind one "details" toggle at the end. ``ids``: a component id
    for the line that starts with each key."""
    plain, details = [], []
    for n, line in enumerate(lines):
        text, detail = plain_and_detail(line) if n else (line, None)
        if text:
            plain.append(text)
        if detail:
            details.append(detail)
    children: list = []
    for n, text in enumerate(plain):
        named = next((v for k, v in (ids or {}).items() if text.startswith(k)), None)
        if n == 0 and strong_first:
            children.append(html.Strong(text))
        elif named:
            children.append(html.Div(text, id=named))
        else:
            children.append(html.Div(text))
    if details:
        children.append(
            html.Details(
                [html.Summary("details")] + [html.Div(d, className="help") for d in details],
                className="summary-details",
            )
        )
    return children
