"""The native kernel is optional: without a compiler the reference serves CPU calls (warned)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import logging, torch
logging.basicConfig(level=logging.WARNING)
from eplb_graph import ops
from eplb_graph.ops.reference import map_and_record_ref
ids = torch.randint(-1, 9, (64, 2))
table = torch.tensor([[0, 8], [1, -1], [2, -1], [3, -1], [4, -1], [5, -1], [6, -1], [7, 9]])
count = torch.tensor([2, 1, 1, 1, 1, 1, 1, 2])
offset, valid, on = torch.tensor(5), torch.tensor(40), torch.tensor(True)
load, expected_load = torch.zeros(10, dtype=torch.int64), torch.zeros(10, dtype=torch.int64)
got = ops.map_and_record(ids, table, count, offset, load, valid, on)
expected = map_and_record_ref(ids, table, count, offset, expected_load, valid, on)
assert torch.equal(got, expected) and torch.equal(load, expected_load)
print("STATUS", ops.native.status().value)
"""


def _run(env_overrides: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), EPLB_GRAPH_CACHE=str(tmp_path / "cache"))
    env.update(env_overrides)
    return subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300
    )


def test_native_off_uses_reference_without_building(tmp_path):
    result = _run({"EPLB_GRAPH_NATIVE": "off"}, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "STATUS disabled" in result.stdout
    assert not (tmp_path / "cache").exists()


def test_missing_compiler_falls_back_with_a_warning(tmp_path):
    result = _run({"EPLB_GRAPH_NATIVE": "auto", "CXX": "/nonexistent/c++"}, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "STATUS unavailable" in result.stdout
    assert "native CPU kernel unavailable" in result.stderr
    assert "ATen reference" in result.stderr


def test_required_native_build_failure_is_an_error(tmp_path):
    result = _run({"EPLB_GRAPH_NATIVE": "require", "CXX": "/nonexistent/c++"}, tmp_path)
    assert result.returncode != 0
    assert "NativeBuildError" in result.stderr
