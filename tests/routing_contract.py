"""Random cases of the routing-op contract, compared element by element with the ATen reference.

Shared by the Triton kernels' checks: on CPU tensors under Triton's interpreter
(``tests/test_triton_routing.py``) and on a GPU (``tests/test_cuda_ops.py``). Each case draws
ids out of range on both sides, tables with -1 pads and entries beyond P or beyond the output
dtype, counts of 0, -1 and above R, any offset, valid-token counts below 0 and above T, record
on and off, int32/int64 ids, tables and counters, and a strided load (a column of a matrix).
"""

from __future__ import annotations

import torch

from eplb_graph.ops import map_and_record_ref, record_load_ref


def check_against_reference(route, record, device: str, trials: int = 40) -> int:
    """Compare ``route(ids, table, count, offset, load | None, valid | None, flag | None)`` and
    ``record(load, physical, valid, flag)`` with the reference; returns the cases checked.

    Raises ``AssertionError`` naming the trial at the first difference.
    """
    generator = torch.Generator().manual_seed(0)

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high, (1,), generator=generator))

    def on_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
        return [t.to(device) for t in tensors]

    cases = 0
    for trial in range(trials):
        n, width, slots = draw(1, 20), draw(1, 5), draw(1, 40)
        tokens, top_k = draw(0, 1500 if trial == 0 else 50), draw(1, 5)
        for table_dtype in (torch.int32, torch.int64):
            ids_dtype = torch.int32 if trial % 4 == 0 else table_dtype
            ids = torch.randint(-3, n + 3, (tokens, top_k), generator=generator).to(ids_dtype)
            table = torch.randint(-2, slots + 3, (n, width), generator=generator).to(table_dtype)
            if trial % 3 == 0:
                table[0, 0] = 2**40 if table_dtype == torch.int64 else 2**30
            count = torch.randint(-1, width + 3, (n,), generator=generator).to(table_dtype)
            offset = torch.tensor(draw(-(2**62), 2**62))
            valid = torch.tensor(draw(-2, tokens + 3))
            flag = torch.tensor(trial % 5 != 0)
            physical = torch.randint(-2, slots + 2, (tokens, top_k), generator=generator)
            ids, table, count, offset, valid, flag, physical = on_device(
                ids, table, count, offset, valid, flag, physical
            )
            load_ref = torch.zeros(slots, dtype=table_dtype, device=device)
            matrix = torch.zeros(slots, 2, dtype=table_dtype, device=device)  # load: column 0
            expected = map_and_record_ref(ids, table, count, offset, load_ref, valid, flag)
            got = route(ids, table, count, offset, matrix[:, 0], valid, flag)
            mapped = route(ids, table, count, offset, None, None, None)
            assert torch.equal(got, expected), (trial, got, expected)
            assert torch.equal(mapped, expected), trial
            assert torch.equal(matrix[:, 0], load_ref), (trial, matrix[:, 0], load_ref)
            assert not matrix[:, 1].any(), f"trial {trial}: wrote outside the load column"
            recorded_ref = torch.zeros(slots, dtype=table_dtype, device=device)
            recorded = torch.zeros(slots, dtype=table_dtype, device=device)
            record_load_ref(recorded_ref, physical, valid, flag)
            record(recorded, physical, valid, flag)
            assert torch.equal(recorded, recorded_ref), trial
            cases += 1
    return cases


def op_route(ids, table, count, offset, load, valid, flag):
    """``route`` through the registered ops (what dispatch picks for the tensors' device)."""
    if load is None:
        return torch.ops.eplb_graph.map_to_physical(ids, table, count, offset)
    return torch.ops.eplb_graph.map_and_record(ids, table, count, offset, load, valid, flag)


def op_record(load, physical, valid, flag):
    torch.ops.eplb_graph.record_load(load, physical, valid, flag)
