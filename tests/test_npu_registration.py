"""NPU registration against fakes of the torch_npu/torchair *interface* (no NPU here).

These tests prove only that the import guards hold and that the registration code calls the
interfaces it should; they do not verify anything on Ascend hardware.
"""

from __future__ import annotations

import subprocess
import sys
import types

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


class _RecordingGe:
    """Stands in for ``torchair.ge``: every op call returns a node naming the op."""

    def __init__(self):
        self.calls: list[str] = []

    def __getattr__(self, name):
        def op(*args, **kwargs):
            self.calls.append(name)
            return _Node(name)

        return op


class _Node:
    def __init__(self, name):
        self.name = name

    def __getitem__(self, index):
        return _Node(f"{self.name}[{index}]")


def test_torchair_converter_registration_uses_the_converter_interface():
    registered = {}
    ge = _RecordingGe()

    def register_fx_node_ge_converter(target):
        def decorator(fn):
            registered[target] = fn
            return fn

        return decorator

    torchair = types.SimpleNamespace(
        ge=ge, register_fx_node_ge_converter=register_fx_node_ge_converter
    )
    names = npu.register_torchair_converters(torchair)
    assert names == ["map_to_physical"]
    converter = registered[torch.ops.eplb_graph.map_to_physical.default]
    log2phy = types.SimpleNamespace(symsize=(8, 3))
    ids = _Node("ids")
    ids.dtype = torch.int64
    converter(ids, log2phy, _Node("count"), _Node("offset"))
    # The IR mirrors the reference: hash, modulo, two gathers, torn-row fallback, invalid -> -1.
    assert ge.calls.count("GatherV2") == 3
    assert "FloorMod" in ge.calls
    assert ge.calls.count("Select") == 3
