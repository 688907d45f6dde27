"""``rearrange="when_it_pays"`` on real gloo ranks: one model, one decision, everywhere.

Each rank times its own expert op with noise of its own (rank 1's calls alternate 15% fast and
slow here, rank 0's do not), so a model fitted from one rank's calls alone would differ between
ranks and so would their plans. The
moments ride in the window reduction, so every rank must fit the same model, decide the same
thing each window, and end on the same placement; a skewed load on a kernel whose time is rows
makes the gate apply a plan that moves the hot experts, and the weights must follow it.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks

LAYERS, EXPERTS = 2, 8


def _rank_body(rank: int, world_size: int, row_us: int, steps: int) -> dict:
    import eplb_graph
    from eplb_graph import ControlSettings, EplbRuntime, GroupRing, MovementSettings
    from tests.movement_fixtures import expert_payloads, rank_views, slot_mismatches

    placement = eplb_graph.Placement.default(LAYERS, EXPERTS, world_size, world_size)
    state = eplb_graph.EplbState(placement, rank=rank, offset_seed=0)
    payloads = [expert_payloads("unquantized", layer, EXPERTS) for layer in range(LAYERS)]
    views = rank_views("unquantized", placement.phy2log, rank, world_size, payloads)
    runtime = EplbRuntime(
        state,
        views,
        ControlSettings(window_size=16, step_interval=16, rearrange="when_it_pays"),
        GroupRing(size=1, timeout_s=30),
        rank,
        use_async=False,
        movement=MovementSettings(exchange_timeout_s=30),
        record_load=rank == 0,  # replicated routing: every rank routes the same tokens
    )
    generator = torch.Generator().manual_seed(3)  # the same tokens on every rank
    hot = torch.tensor([0, 1, 2, 3])  # all on rank 0 under the default layout
    for step in range(steps):
        jitter = 1.0 if rank == 0 else (1.15 if step % 2 else 0.85)
        ids = hot[torch.randint(0, 4, (32, 2), generator=generator)]
        runtime.begin_step(has_prefill=False, num_valid_tokens=32)
        per_rank = state.num_slots // world_size
        for layer in range(LAYERS):
            physical = torch.ops.eplb_graph.map_and_record(
                ids,
                state.log2phy[layer],
                state.replica_count[layer],
                state.offset,
                state.load[layer],
                state.num_valid_tokens,
                state.record_enabled,
            )
            # The expert op's own counters: rows, ns and active slots of this rank's share.
            local = (physical // per_rank) == rank
            rows = int(local.sum())
            active = int(torch.unique(physical[local]).numel())
            micros = int(jitter * (20 + row_us * rows + 300 * active))
            state.expert_stats[layer] += torch.tensor([rows, 1000 * micros, active])
        runtime.end_step()
    gate = runtime.planner.gate.published
    runtime.close()
    return {
        "model": gate["model"],
        "decisions": [(d["step"], d["action"], d["reason"]) for d in gate["decisions"]],
        "placement": state.placement.phy2log.tolist(),
        "mismatches": slot_mismatches(views, state.placement.phy2log, rank, world_size, payloads),
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("row_us", [200, 0], ids=["rows_dominate", "reads_only"])
def test_every_rank_fits_one_model_and_takes_the_same_decisions(row_us):
    results = run_ranks(_rank_body, 2, row_us, 64)
    first = results[0]
    assert first["model"] is not None
    assert all(r["model"] == first["model"] for r in results)
    assert all(r["decisions"] == first["decisions"] for r in results)
    assert all(r["placement"] == first["placement"] for r in results)
    assert all(not r["mismatches"] for r in results)
    actions = [action for _, action, _ in first["decisions"]]
    moved = first["placement"] != [[*range(EXPERTS), 0, 1] for _ in range(LAYERS)]
    if row_us:
        # Rows dominate and rank 0 holds every hot expert: a plan repays and is applied.
        assert "applied" in actions and moved
    else:
        # Time is weight reads only, and both ranks already read their active experts: keeping
        # is predicted as fast as any move, which would cost copies.
        assert "applied" not in actions and not moved
