"""``tools/device_check.py`` on a machine without CUDA: the dry run of its CPU half passes, and
its comparison catches a graph that stopped following commits (so a device run can fail)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from device_checks.graphs import _commit_and_step, _Comparison  # noqa: E402
from device_checks.layer import LayerShape, build_layer, example_hidden  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is what a CPU-only machine runs")
def test_dry_run_passes_and_reports_every_section(tmp_path):
    report_path = tmp_path / "device.json"
    done = subprocess.run(
        [sys.executable, "tools/device_check.py", "--json", str(report_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "no CUDA device" in done.stdout and "all checks passed" in done.stdout
    report = json.loads(report_path.read_text())
    sections = report["sections"]
    assert report["environment"]["device"] == "cpu" and report["ok"] is True
    assert set(sections) == {
        "raw_cuda_graph", "load_in_graph", "host_syncs", "compile_inductor", "speed", "suite"
    }  # fmt: skip
    # The CUDA-only sections walked their loops on eager calls and say they did not apply.
    graph = sections["raw_cuda_graph"]
    assert graph["ok"] is None and graph["dry_run"] and graph["replays"] == 18
    assert graph["bitwise_equal_to_eager"] and graph["addresses_stable"]
    assert all(moved > 0 for moved in graph["slots_moved_per_commit"])
    assert sections["load_in_graph"]["total_counted"] == sections["load_in_graph"]["expected_total"]
    compiled = sections["compile_inductor"]
    assert compiled["ok"] and compiled["graph_breaks"] == 0 and compiled["recompiles"] == 0
    assert [row["tokens"] for row in sections["speed"]["rows"]] == [1, 256]
    suite = sections["suite"]
    assert suite["ok"] and suite["counts"]["skipped"] >= 10, suite
    assert any("needs a CUDA device" in line for line in suite["skipped"])


def test_comparison_fails_a_graph_that_froze_the_first_placement():
    """A 'graph' that replays the outputs of the placement it was built on: every commit after
    it must be reported (routing and output), or the device check could not fail."""
    shape = LayerShape()
    layer = build_layer(shape, "cpu")
    hidden = example_hidden(shape, "cpu")
    frozen = tuple(t.clone() for t in layer(hidden))
    comparison = _Comparison(layer, hidden, bitwise=True)
    _commit_and_step(layer, comparison, lambda: frozen, shape)
    assert any("physical ids differ" in m for m in comparison.mismatches)
    assert any("output differs" in m for m in comparison.mismatches)
    assert any("recorded load differs" in m for m in comparison.mismatches)
