"""Krypton imports and works without MONAI; only krypton.monai needs it."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_krypton_imports_without_monai():
    code = (
        "import sys; sys.modules['monai'] = None\n"  # as if MONAI were not installed
        "import krypton, krypton.captum, krypton.monai\n"
        "try:\n"
        "    krypton.monai.OcclusionSensitivity(None)\n"
        "except ImportError as exc:\n"
        "    print('refused:', exc)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "refused: krypton.monai needs MONAI: pip install monai" in result.stdout
