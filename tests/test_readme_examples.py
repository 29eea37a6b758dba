"""The first Python example of README.md and of docs/usage.md runs as written, from the
checkout's folder: README's library line once failed with the image the loader returns
(explain needs the model's normalised tensor, and nothing showed how to get one)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def first_python_block(page: Path) -> str:
    found = re.search(r"```python\n(.*?)```", page.read_text(), re.S)
    assert found, f"{page.name} has no Python example"
    return found.group(1)


@pytest.mark.parametrize("page", ["README.md", "docs/usage.md"])
def test_the_first_python_example_runs_as_written(page):
    code = first_python_block(ROOT / page)
    environment = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=environment,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
