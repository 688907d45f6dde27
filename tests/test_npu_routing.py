"""The capturable NPU formulation (``eplb_graph.ops.npu_routing``), run on CPU.

It must pick the same replica as the CPU kernels bit for bit, and be capturable by construction:
no shift, no Python number reaching a tensor op (op-plugin copies those host-to-device per call),
only the aten ops whose aclnn kernels docs/ascend.md lists. No NPU is involved.
"""

from __future__ import annotations

import random
from typing import ClassVar

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from eplb_graph.ops import native, npu_routing
from eplb_graph.ops.reference import replica_hash
from tests.test_op_kernels_agree import (
    ARGS,
    EDGE_SHAPES,
    FAMILIES,
    REFERENCE,
    general_case,
    random_inputs,
    run_kernel,
)

OPS = torch.ops.eplb_graph
NPU = {
    "map_to_physical": npu_routing.map_to_physical_npu,
    "record_load": npu_routing.record_load_npu,
    "map_and_record": npu_routing.map_and_record_npu,
}


@pytest.fixture(scope="module", autouse=True)
def _native_kernel():
    if not native.ensure_loaded():
        pytest.fail(f"native CPU kernel unavailable: {native.failure_reason()}")


def test_hash_equals_the_reference_hash_for_extreme_offsets():
    rows = torch.arange(4096, dtype=torch.int64)
    offsets = [0, 1, 2**16 - 1, 2**16, 2**31, 2**32 - 1, 2**32, -1, -(2**63), 2**63 - 1, 12345678]
    rng = random.Random(7)
    offsets += [rng.randrange(-(2**63), 2**63) for _ in range(50)]
    for value in offsets:
        offset = torch.tensor(value, dtype=torch.int64)
        assert torch.equal(npu_routing.replica_hash_npu(rows, offset), replica_hash(4096, offset))


@pytest.mark.parametrize("op", list(ARGS))
def test_npu_formulation_equals_reference_and_native_on_random_hostile_inputs(op):
    rng = random.Random(f"{op}-npu-formulation")
    compared = 0
    for family in FAMILIES:
        for _ in range(60):
            inputs = general_case(rng, family)
            outcomes = {
                "npu": run_kernel(NPU[op], op, inputs),
                "reference": run_kernel(REFERENCE[op], op, inputs),
                "native": run_kernel(getattr(OPS, op), op, inputs),
            }
            assert outcomes["reference"].error is None, outcomes["reference"].error
            assert outcomes["npu"] == outcomes["reference"] == outcomes["native"], outcomes
            compared += 1
    assert compared == 60 * len(FAMILIES)


@pytest.mark.parametrize("shape", EDGE_SHAPES, ids=lambda s: "-".join(map(str, s.values())))
@pytest.mark.parametrize("op", list(ARGS))
def test_npu_formulation_agrees_on_empty_and_size_one_dimensions(op, shape):
    rng = random.Random(f"{op}-{shape}-npu")
    for family in FAMILIES:
        inputs = random_inputs(rng, family, **shape)
        npu_outcome = run_kernel(NPU[op], op, inputs)
        assert npu_outcome == run_kernel(REFERENCE[op], op, inputs)
        assert npu_outcome == run_kernel(getattr(OPS, op), op, inputs)


def test_npu_formulation_rejects_like_the_reference():
    inputs = general_case(random.Random(3), "int64")
    inputs["topk_ids"] = inputs["topk_ids"].to(torch.float32)
    npu_outcome = run_kernel(NPU["map_to_physical"], "map_to_physical", inputs)
    assert npu_outcome.error is not None
    assert npu_outcome == run_kernel(REFERENCE["map_to_physical"], "map_to_physical", inputs)


# -- capturable by construction ------------------------------------------------------------------


class _OpLog(TorchDispatchMode):
    """Every aten overload called, and every call where a Python number reached a tensor op."""

    # Arguments that are sizes, dims or dtypes by schema, never values combined with data.
    _STRUCTURAL: ClassVar[dict[str, set[str]]] = {
        "aten.arange.default": {"end"},
        "aten.index_select.default": {"dim"},
    }

    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()
        self.number_args: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        self.ops.add(name)
        schema = func._schema
        allowed = self._STRUCTURAL.get(name, set()) | {"dim"}
        named = [*zip((a.name for a in schema.arguments), args, strict=False), *kwargs.items()]
        for arg_name, value in named:
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if number and arg_name not in allowed:
                self.number_args.append(f"{name}({arg_name}={value})")
        return func(*args, **kwargs)


def _traced_ops(op: str, inputs: dict[str, torch.Tensor]) -> _OpLog:
    args = [inputs[name] for name in ARGS[op]]
    npu_routing.prepare(torch.device("cpu"), (args[1].shape[0], args[1].shape[1]))
    NPU[op](*args)  # constants of this shape exist now: the traced call creates none
    with _OpLog() as log:
        NPU[op](*args)
    return log


def test_no_shift_no_python_number_and_only_listed_ops():
    seen = set()
    for family in FAMILIES:
        inputs = general_case(random.Random(f"capturable-{family}"), family)
        for op in ARGS:
            log = _traced_ops(op, inputs)
            assert not log.number_args, f"{op}: host scalar reaches a tensor op: {log.number_args}"
            shifts = {name for name in log.ops if "shift" in name}
            assert not shifts, shifts
            kernels = log.ops - set(npu_routing.VIEW_OPS)
            assert kernels <= set(npu_routing.ATEN_OPS), kernels - set(npu_routing.ATEN_OPS)
            seen |= kernels
    # The other direction: across the dtype families every listed op is used (no stale entry).
    assert seen == set(npu_routing.ATEN_OPS)


def test_the_reference_is_not_capturable_by_these_rules():
    """The audit above can fail: on the reference kernel it finds the shifts and host scalars."""
    inputs = general_case(random.Random(11), "int64")
    args = [inputs[name] for name in ARGS["map_to_physical"]]
    with _OpLog() as log:
        REFERENCE["map_to_physical"](*args)
    assert any("shift" in name for name in log.ops)
    assert log.number_args


def test_constants_are_made_once_and_refused_during_capture(monkeypatch):
    device = torch.device("cpu")
    npu_routing.prepare(device, (5,))
    first = npu_routing.constant(device, 5)
    assert npu_routing.constant(device, 5) is first
    assert first.dtype == torch.int64 and first.dim() == 0 and int(first) == 5
    monkeypatch.setattr(npu_routing, "_capturing", lambda device: True)
    assert npu_routing.constant(device, 5) is first  # prepared: fine during capture
    with pytest.raises(npu_routing.NpuCaptureError, match="prepare"):
        npu_routing.constant(device, 987654321)
