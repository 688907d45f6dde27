"""The step state machine across real gloo ranks with different local batch phases."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks


def _rank_body(rank: int, world_size: int, phase: str) -> dict:
    import torch.distributed as dist

    import eplb_graph
    from eplb_graph import RuntimeSettings
    from eplb_graph.control import EplbController, process_group_reducer
    from eplb_graph.control.window import reduce_window
    from eplb_graph.policy.registry import normalize_weight
    from tests.routing import route_and_record

    placement = eplb_graph.Placement.default(2, 8, 8, world_size)
    state = eplb_graph.EplbState(placement, rank=rank)
    eplb_group = dist.new_group(backend="gloo")  # the EPLB group, never the serving group
    calls = []
    reduce = process_group_reducer(eplb_group)

    def counting_reduce(tensor):
        calls.append(tensor.numel())
        return reduce(tensor)

    plans = []

    def planner(load):
        weight = normalize_weight(load.logical).sum(dim=0)
        plans.append(weight.clone())
        return None

    settings = RuntimeSettings(window_size=6, step_interval=24, load_collection_phase=phase)

    def reduce_and_plan(snapshot):  # the rebalance pipeline's first steps, inline
        rows = snapshot.copy_rows()
        args = (snapshot.committed, counting_reduce, state.num_logical, settings.time_samples)
        planner(reduce_window(rows, snapshot, *args))

    controller = EplbController(state, settings, reduce_and_plan)
    generator = torch.Generator().manual_seed(100 + rank)
    local_expected = torch.zeros(2, 8, dtype=torch.int64)
    for step in range(30):
        # Ranks disagree on phase: rank r sees prefill on steps where (step + r) % 3 == 0.
        has_prefill = (step + rank) % 3 == 0
        ids = torch.randint(0, 8, (5, 2), generator=generator)
        controller.begin_step(has_prefill=has_prefill, num_valid_tokens=4)
        route_and_record(state, ids)
        if bool(state.record_enabled) and 6 - 6 <= step < 6:  # closes at step 6 = 24 // 4
            for layer in range(2):
                local_expected[layer] += torch.bincount(ids[:4].flatten(), minlength=8)
        controller.end_step()
    return {
        "calls": calls,
        "plans": [p.tolist() for p in plans],
        "local_expected": local_expected.tolist(),
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("phase", ["decode", "all"])
def test_ranks_reduce_identical_windows_whatever_their_local_phase(world_size, phase):
    results = run_ranks(_rank_body, world_size, phase)
    # Same collectives, same order, on every rank: two window closes (steps 6 and 30).
    assert all(r["calls"] == results[0]["calls"] for r in results)
    assert len(results[0]["calls"]) == 2
    # Every rank hands the policy the same reduced load...
    assert all(r["plans"] == results[0]["plans"] for r in results)
    # ...which is the sum of what each rank recorded in its matching steps.
    total = sum(torch.tensor(r["local_expected"], dtype=torch.float64) for r in results)
    assert torch.equal(torch.tensor(results[0]["plans"][0]), total)
