"""The test suite's CUDA tests (``-m cuda``), run in a child pytest with skips shown (``-rs``).

The device machine runs the checkout from ``PYTHONPATH`` without installing it, so pytest's
entry point for eplb-graph's fixtures (``pytest11``) is not there: the plugin is then named
through ``PYTEST_PLUGINS``, which nested pytester sessions read too.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: The files holding tests marked ``cuda`` (a path list keeps collection to what can run).
CUDA_TEST_FILES = (
    "tests/test_cuda_ops.py",
    "tests/test_graph_capture.py",
    "tests/test_testing_kit.py",
)

_OUTCOME = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)")


def _plugin_installed() -> bool:
    entry_points = importlib.metadata.entry_points(group="pytest11")
    return any(ep.value == "eplb_graph.pytest_plugin" for ep in entry_points)


def run_cuda_tests(timeout_s: float) -> dict:
    """Outcome counts of ``pytest -m cuda`` over :data:`CUDA_TEST_FILES` and the skip lines."""
    env = dict(os.environ)
    env.setdefault("EPLB_GRAPH_NATIVE", "auto")  # the CPU kernel is not what this run checks
    pythonpath = [str(ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    if not _plugin_installed():
        env["PYTEST_PLUGINS"] = "eplb_graph.pytest_plugin"
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-rs", "-q", "-p", "no:cacheprovider"]
    command += list(CUDA_TEST_FILES)
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired as error:
        tail = (error.stdout or b"")[-3000:]
        return {"ok": False, "why": f"timed out after {timeout_s:.0f} s", "tail": str(tail)}
    output = done.stdout + done.stderr
    summary = _summary_line(output)
    counts = {kind.rstrip("s") if kind.startswith("error") else kind: int(n)
              for n, kind in _OUTCOME.findall(summary)}  # fmt: skip
    skips = [line for line in output.splitlines() if line.startswith("SKIPPED")]
    failed = counts.get("failed", 0) + counts.get("error", 0)
    return {
        "ok": done.returncode == 0 and failed == 0 and counts.get("passed", 0) > 0,
        "returncode": done.returncode,
        "counts": counts,
        "skipped": skips,
        "summary": summary,
        "tail": output[-2000:],
    }


def _summary_line(output: str) -> str:
    """pytest's closing count line (``3 passed, 2 skipped in 4.1s``). Not simply the last line:
    an interpreter-shutdown warning of a library can follow it (torch 2.11 printed one)."""
    for line in reversed(output.splitlines()):
        if _OUTCOME.search(line) and re.search(r" in [\d.]+s", line):
            return line.strip("= ")
    return ""
