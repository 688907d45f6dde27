"""An installed package carries the kernel source where the native loader looks for it.

The source lives outside the package (``custom_ops/csrc``), so only the build step puts it into
wheels; an editable install or a checkout reads it in place. Both layouts are checked here so a
packaging change cannot silently leave installed copies on the slower reference kernel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from eplb_graph.ops import native

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "custom_ops" / "csrc" / "eplb_graph_cpu.cpp"
_BUILD_INPUTS = ("eplb_graph", "custom_ops", "setup.py", "pyproject.toml", "README.md")

PROBE = "from eplb_graph.ops import native; print(native.source_file())"


def test_checkout_reads_the_source_in_place():
    assert native.source_file() == SOURCE


def test_built_package_ships_the_source_inside_eplb_graph(tmp_path):
    pytest.importorskip("setuptools")
    tree, built = tmp_path / "tree", tmp_path / "built"
    for name in _BUILD_INPUTS:
        path = ROOT / name
        if path.is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
            shutil.copytree(path, tree / name, ignore=ignore)
        else:
            shutil.copy2(path, tree / name)
    build = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(built)],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr

    shipped = built / "eplb_graph" / "ops" / "csrc" / "eplb_graph_cpu.cpp"
    assert shipped.read_bytes() == SOURCE.read_bytes()
    assert not (built / "custom_ops").exists()  # no second top-level name in site-packages

    env = dict(os.environ, PYTHONPATH=str(built), EPLB_GRAPH_NATIVE="off")
    found = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True, text=True, env=env
    )
    assert found.returncode == 0, found.stderr
    assert Path(found.stdout.strip()) == shipped
