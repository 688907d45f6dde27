"""``torch.library.opcheck`` for every ``torch.ops.eplb_graph`` op.

opcheck runs the schema, autograd-registration, fake-tensor and AOT-dispatch (dynamic shapes)
checks against the CPU kernel (the fused native one when it is built). Grid: T in {0, 1, 16, 1024}
x K in {1, 2, 8} x index dtypes x {no redundancy (R=1), redundancy (R>1, mixed counts)}, every op.
The dtype axis covers int32 and int64 for ids, tables, counts and load, each alone and mixed.
"""

from __future__ import annotations

import pytest
import torch

from eplb_graph import ops
from eplb_graph.ops import native
from eplb_graph.ops.reference import map_to_physical_ref

NUM_EXPERTS = 8
ROWS = [0, 1, 16, 1024]
TOP_K = [1, 2, 8]
I32, I64 = torch.int32, torch.int64
# name: (topk_ids / physical_ids, log2phy, replica_count, load, num_valid_tokens)
DTYPES = {
    "int32": (I32, I32, I32, I32, I32),
    "int64": (I64, I64, I64, I64, I64),
    "ids32-tables64": (I32, I64, I32, I64, I64),
    "ids64-tables32": (I64, I32, I64, I32, I32),
}
# Replica counts per expert; R = max. With redundancy: counts 1..3 mixed, one torn row.
REDUNDANCY = {
    "R1": [1] * NUM_EXPERTS,
    "R3-mixed": [1, 2, 3, 1, 3, 2, 1, 2],
}


@pytest.fixture(scope="module", autouse=True)
def _native_kernel():
    native.ensure_loaded()


def make_inputs(rows: int, top_k: int, dtypes: str, redundancy: str) -> dict[str, torch.Tensor]:
    ids_dtype, table_dtype, count_dtype, load_dtype, valid_dtype = DTYPES[dtypes]
    counts = REDUNDANCY[redundancy]
    width = max(counts)
    log2phy = torch.full((NUM_EXPERTS, width), -1, dtype=torch.int64)
    next_slot = 0
    for expert, count in enumerate(counts):
        log2phy[expert, :count] = torch.arange(next_slot, next_slot + count)
        next_slot += count
    replica_count = torch.tensor(counts)
    if width > 1:
        replica_count[0] = width  # torn row: count newer than the row (falls back to column 0)
    gen = torch.Generator().manual_seed(rows * 31 + top_k)
    ids = torch.randint(0, NUM_EXPERTS, (rows, top_k), generator=gen)
    if rows > 1:
        ids[0, 0], ids[-1, -1] = -1, NUM_EXPERTS  # invalid ids map to -1
    offset = torch.tensor(rows * 7 + 3, dtype=torch.int64)
    physical = map_to_physical_ref(ids, log2phy, replica_count, offset)
    return {
        "topk_ids": ids.to(ids_dtype),
        "log2phy": log2phy.to(table_dtype),
        "replica_count": replica_count.to(count_dtype),
        "offset": offset,
        "load": torch.randint(0, 4, (next_slot,), generator=gen, dtype=load_dtype),
        "physical_ids": physical.to(ids_dtype),
        "num_valid_tokens": torch.tensor(max(rows - 1, 0), dtype=valid_dtype),
        "record_enabled": torch.tensor(True),
    }


ARGS = {
    "map_to_physical": ("topk_ids", "log2phy", "replica_count", "offset"),
    "record_load": ("load", "physical_ids", "num_valid_tokens", "record_enabled"),
    "map_and_record": (
        "topk_ids",
        "log2phy",
        "replica_count",
        "offset",
        "load",
        "num_valid_tokens",
        "record_enabled",
    ),
}


@pytest.mark.parametrize("redundancy", list(REDUNDANCY))
@pytest.mark.parametrize("dtypes", list(DTYPES))
@pytest.mark.parametrize("top_k", TOP_K)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("op", list(ARGS))
def test_opcheck(op, rows, top_k, dtypes, redundancy):
    inputs = make_inputs(rows, top_k, dtypes, redundancy)
    handle = ops.op_handles()[op]
    # Every check must pass; opcheck raises OpCheckError with the failing check otherwise.
    result = torch.library.opcheck(handle, tuple(inputs[name] for name in ARGS[op]))
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("op", list(ARGS))
def test_opcheck_with_record_disabled_and_padding(op):
    """The record flag and the valid-token count are data, not shape: same checks pass."""
    inputs = make_inputs(16, 2, "int64", "R3-mixed")
    for valid, record in [(0, True), (20, False), (5, True)]:
        inputs["num_valid_tokens"] = torch.tensor(valid)
        inputs["record_enabled"] = torch.tensor(record)
        handle = ops.op_handles()[op]
        result = torch.library.opcheck(handle, tuple(inputs[name] for name in ARGS[op]))
        assert set(result.values()) == {"SUCCESS"}, result


def test_every_routing_op_is_checked():
    """The expert-compute ops have their own opcheck grid in tests/test_local_experts.py."""
    from eplb_graph.ops.registration import EXPERT_OPS

    assert set(ops.op_handles()) - set(EXPERT_OPS) == set(ARGS)
