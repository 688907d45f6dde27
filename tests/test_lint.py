"""The code base stays ruff-clean (lint and format); CI runs this with the rest of the suite."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]])
def test_ruff_clean(command):
    ruff = shutil.which("ruff")
    assert ruff is not None, "ruff is part of the test extra: pip install -e '.[test]'"
    result = subprocess.run([ruff, *command, "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
