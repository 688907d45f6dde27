"""What an install gives: the kernel source where the native loader looks for it, and the
extras the docs name.

The source lives outside the package (``custom_ops/csrc``), so only the build step puts it into
wheels; an editable install or a checkout reads it in place. Both layouts are checked here so a
packaging change cannot silently leave installed copies on the slower reference kernel.
"""

from __future__ import annotations

import os
import re
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
    experts = shipped.with_name("eplb_graph_experts_cpu.cpp")  # the expert kernels ship too
    assert experts.read_bytes() == SOURCE.with_name(experts.name).read_bytes()
    assert not (built / "custom_ops").exists()  # no second top-level name in site-packages

    env = dict(os.environ, PYTHONPATH=str(built), EPLB_GRAPH_NATIVE="off")
    found = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True, text=True, env=env
    )
    assert found.returncode == 0, found.stderr
    assert Path(found.stdout.strip()) == shipped


def _extras() -> dict[str, list[str]]:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["optional-dependencies"]


def test_the_testing_docs_install_command_brings_pytest():
    """docs/testing.md says what to install for the kit's fixtures; those extras must bring
    pytest, which the main job's extras (native, plot) do not."""
    section = (ROOT / "docs" / "testing.md").read_text().split("## Install", 1)
    assert len(section) == 2, "docs/testing.md lost its Install section"
    commands = re.findall(r"pip install [^\n`]+", section[1].split("\n## ", 1)[0])
    assert commands, "the Install section of docs/testing.md names no pip install command"
    extras = _extras()
    for command in commands:
        named = {
            name.strip()
            for group in re.findall(r"\[([\w,\s-]+)\]", command)
            for name in group.split(",")
        }
        assert named and named <= extras.keys(), f"{command!r} names unknown extras"
        requirements = [requirement for name in named for requirement in extras[name]]
        assert any(re.match(r"pytest\b", requirement) for requirement in requirements), command
