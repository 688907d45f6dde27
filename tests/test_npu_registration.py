"""NPU registration against fakes of the torch_npu/torchair *interface* (no NPU here).

These tests prove only that the import guards hold and that the registration code calls the
interfaces it should; they do not verify anything on Ascend hardware.
"""

from __future__ import annotations

import subprocess
import sys

import torch

from eplb_graph.ops import npu


def test_cpu_only_import_never_touches_torch_npu():
    code = "import sys, eplb_graph; assert 'torch_npu' not in sys.modules; print('ok')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_broken_torch_npu_is_treated_as_absent(monkeypatch):
    """torch_npu without CANN fails at import (libhccl.so): that means 'no NPU', not a crash."""

    def broken_import(name):
        raise ImportError("libhccl.so: cannot open shared object file")

    monkeypatch.setattr(npu.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(npu.importlib, "import_module", broken_import)
    assert npu._import_optional("torch_npu") is None


def test_privateuse1_kernels_register_for_every_op():
    library = npu.register_privateuse1_kernels()
    try:
        for name in ("map_to_physical", "record_load", "map_and_record"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(
                f"eplb_graph::{name}", "PrivateUse1"
            )
    finally:
        library._destroy()
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(
        "eplb_graph::map_to_physical", "PrivateUse1"
    )


# The torchair GE converters are tested against a fake generated from the pinned wheel's API and
# against the wheel's real modules: tests/test_torchair_converters.py.
