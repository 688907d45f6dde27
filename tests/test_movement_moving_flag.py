"""Real gloo ranks, async: which steps a rearrangement's cost is measured on.

Every window close hands the worker a job (reduce, plan), so the worker is busy after every
close; only a job that moves weights costs what a copy costs. The payback gate divides the
measured cost by the copies applied, so steps of windows that were merely planned must never
count as moving (they once tripled a copy's measured price within an hour of serving), and the
steps of a real move must, up to the one that installs its last layer.
"""

from __future__ import annotations

import pytest

from tests.distributed import run_ranks

LAYERS, EXPERTS = 2, 8


def _body(rank: int, world_size: int) -> dict:
    import time

    import torch
    import torch.distributed as dist

    import eplb_graph
    from eplb_graph import RuntimeSettings
    from eplb_graph.movement.transport import GroupRing
    from eplb_graph.runtime import EplbRuntime
    from tests.movement_fixtures import expert_payloads, random_placement, rank_views

    placement = eplb_graph.Placement.default(LAYERS, EXPERTS, world_size, world_size)
    state = eplb_graph.EplbState(placement, rank=rank)
    payloads = [expert_payloads("unquantized", layer, EXPERTS) for layer in range(LAYERS)]
    views = rank_views("unquantized", placement.phy2log, rank, world_size, payloads)
    runtime = EplbRuntime(
        state,
        views,
        # A window every 8 steps, each planned and kept (no plan cuts the load by 99%).
        RuntimeSettings(
            window_size=8,
            step_interval=8,
            min_gain_percent=99,
            layers_per_step=1,
            exchange_timeout_s=30,
        ),
        GroupRing(size=1, timeout_s=30),
        rank,
    )
    lockstep = torch.zeros(1)

    def step() -> tuple[bool, bool, list[int]]:
        busy, moving = runtime.busy, runtime.moving
        committed = runtime.begin_step(has_prefill=False, num_valid_tokens=4)
        time.sleep(0.002)  # the forward
        lockstep.fill_(float(runtime.busy))
        dist.all_reduce(lockstep)  # the serving collective: ranks in lockstep
        runtime.end_step()
        return busy, moving, committed

    try:
        planned_only = [step() for _ in range(40)]
        moving_steps_after_planning = runtime.controller.feedback.movement_steps_all
        new = random_placement(torch.Generator().manual_seed(5), LAYERS, EXPERTS, state.num_slots)
        runtime.rearrange_to(new)
        moved = []
        for _ in range(2000):
            moved.append(step())
            if lockstep.item() == 0 and not runtime.moving:
                break
        moved.extend(step() for _ in range(3))
        moving_steps_after_move = runtime.controller.feedback.movement_steps_all
        noop = runtime.pipeline.stats.rearrangements_noop
        arrived = torch.equal(state.placement.phy2log, new)
    finally:
        runtime.close()
    return {
        "planned_only": planned_only,
        "moved": moved,
        "moving_steps_after_planning": moving_steps_after_planning,
        "moving_steps_after_move": moving_steps_after_move,
        "noop": noop,
        "arrived": arrived,
    }


@pytest.mark.multiprocess
def test_only_steps_while_weights_move_are_a_moves_cost():
    for result in run_ranks(_body, 2):
        planned = result["planned_only"]
        # The worker held each window's job for at least the step after its close ...
        assert result["noop"] >= 4 and sum(busy for busy, _, _ in planned) >= 4
        # ... and none of those steps was a move's.
        assert not any(moving for _, moving, _ in planned)
        assert result["moving_steps_after_planning"] == 0
        assert result["arrived"]
        moved = result["moved"]
        flags = [moving for _, moving, _ in moved]
        installs = [index for index, (_, _, layers) in enumerate(moved) if layers]
        assert len(installs) == LAYERS  # one layer per step (layers_per_step=1)
        first_moving = flags.index(True)
        # Moving from before the first install up to the step that installs the last layer,
        # and not after: the finished marker is consumed in that step.
        assert first_moving <= installs[0]
        assert all(flags[first_moving : installs[-1] + 1])
        assert not any(flags[installs[-1] + 2 :])
        assert result["moving_steps_after_move"] == sum(flags)
