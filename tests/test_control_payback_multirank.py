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


def _rank_body(rank: int, world_size: int, row_us: int, hot: int, penalty_ms: float) -> dict:
    import time

    import eplb_graph
    from eplb_graph import EplbRuntime, GroupRing, RuntimeSettings
    from tests.movement_fixtures import expert_payloads, rank_views, slot_mismatches

    placement = eplb_graph.Placement.default(LAYERS, EXPERTS, world_size, world_size)
    state = eplb_graph.EplbState(placement, rank=rank, offset_seed=0)
    payloads = [expert_payloads("unquantized", layer, EXPERTS) for layer in range(LAYERS)]
    views = rank_views("unquantized", placement.phy2log, rank, world_size, payloads)
    runtime = EplbRuntime(
        state,
        views,
        RuntimeSettings(
            window_size=16,
            step_interval=16,
            rearrange="when_it_pays",
            use_async=False,
            exchange_timeout_s=30,
        ),
        GroupRing(size=1, timeout_s=30),
        rank,
        record_load=rank == 0,  # replicated routing: every rank routes the same tokens
    )
    generator = torch.Generator().manual_seed(3)  # the same tokens on every rank
    experts = torch.arange(hot)  # experts 0-3 all live on rank 0 under the default layout
    per_rank = state.num_slots // world_size
    for step in range(STEPS):
        jitter = 1.0 if rank == 0 else (1.15 if step % 2 else 0.85)
        # What the model cannot see: under any moved placement every call takes penalty_ms more.
        moved = not torch.equal(state.placement.phy2log, placement.phy2log)
        penalty_us = int(1000 * penalty_ms) if moved else 0
        # The first windows serve every expert alike (nothing to move; the starting placement is
        # measured once a rank's first steps are past), then the skew begins.
        pool = experts if step >= EVEN_STEPS else torch.arange(EXPERTS)
        ids = pool[torch.randint(0, len(pool), (32, 2), generator=generator)]
        runtime.begin_step(has_prefill=False, num_valid_tokens=32)
        busiest_us = 0.0
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
            # A kernel whose time is rows and active slots: every rank's share (the same on
            # every rank), this rank's written into the op's own counters, with this rank's
            # noise; the step lasts as long as the busiest rank (the combine waits for it).
            times = []
            for owner in range(world_size):
                local = (physical // per_rank) == owner
                rows = int(local.sum())
                active = int(torch.unique(physical[local]).numel())
                times.append(20 + row_us * rows + 300 * active + penalty_us)
                if owner == rank:
                    micros = int(jitter * times[-1])
                    state.expert_stats[layer] += torch.tensor([rows, 1000 * micros, active])
            busiest_us += max(times)
        time.sleep(busiest_us / 1e6)
        runtime.end_step()
    gate = runtime.planner.gate.published
    runtime.close()
    return {
        "model": gate["model"],
        "moves": gate["moves"],
        "accuracy": gate["accuracy"],
        "decisions": [(d["step"], d["action"], d["reason"]) for d in gate["decisions"]],
        "placement": state.placement.phy2log.tolist(),
        "mismatches": slot_mismatches(views, state.placement.phy2log, rank, world_size, payloads),
    }


EVEN_STEPS = 36
STEPS = 116
DEFAULT = [[*range(EXPERTS), 0, 1] for _ in range(LAYERS)]


def _agreed(results: list[dict]) -> dict:
    first = results[0]
    assert first["model"] is not None
    assert all(r["model"] == first["model"] for r in results)
    assert all(r["decisions"] == first["decisions"] for r in results)
    assert all(r["placement"] == first["placement"] for r in results)
    assert all(not r["mismatches"] for r in results)  # the weights follow every placement
    return first


@pytest.mark.multiprocess
def test_a_plan_that_repays_its_move_is_applied_and_kept_on_every_rank():
    # Rows dominate and rank 0 holds every hot expert: moving half of them repays at once.
    first = _agreed(run_ranks(_rank_body, 2, 200, 4, 0.0))
    actions = [action for _, action, _ in first["decisions"]]
    assert "applied" in actions and "rollback" not in actions
    assert first["placement"] != DEFAULT


@pytest.mark.multiprocess
def test_a_balanced_load_whose_time_is_weight_reads_is_never_moved():
    # Every expert hot on both ranks' slots alike: no placement is predicted faster.
    first = _agreed(run_ranks(_rank_body, 2, 0, EXPERTS, 0.0))
    actions = [action for _, action, _ in first["decisions"]]
    assert "applied" not in actions and first["placement"] == DEFAULT


@pytest.mark.multiprocess
def test_a_plan_measured_slower_than_the_placement_before_it_is_undone_on_every_rank():
    # The model predicts a gain, but under any moved placement every expert call takes 10 ms
    # more (what a misfit model would not see): the ranks measure it under the same load, and
    # every rank plans the old placement back at the same window.
    first = _agreed(run_ranks(_rank_body, 2, 200, 4, 10.0))
    actions = [action for _, action, _ in first["decisions"]]
    assert actions.count("applied") >= 1 and actions.count("rollback") >= 1
    # Each plan applied is undone at the first window measured under it.
    for index, action in enumerate(actions[:-1]):
        if action == "applied":
            assert actions[index + 1] == "rollback", first["decisions"]
    assert actions[-1] != "applied" and first["placement"] == DEFAULT
    # Each move that was undone measured a negative net: it cost more than it saved.
    undone = [m for m in first["moves"] if m["candidate"] != "initial" and m["net_ms"] is not None]
    assert undone and all(m["net_ms"] < 0 for m in undone[::2])
