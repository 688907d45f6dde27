"""Single-process units of the movement plane: store decisions, vetoes, staging ownership."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
import torch.distributed as dist

from eplb_graph import RuntimeSettings
from eplb_graph.control.planning import PolicyPlanner
from eplb_graph.control.window import WindowLoad
from eplb_graph.movement.commit import StepClock
from eplb_graph.movement.staging import BlockState, StagingOwnershipError, StagingPool
from eplb_graph.movement.transport import StoreAgreement
from eplb_graph.policy import registry
from tests.movement_fixtures import expert_payloads, rank_views


def _agreements(tmp_path, world=2, vote_timeout=5.0):
    store = dist.FileStore(str(tmp_path / "store"), world)
    return [
        StoreAgreement(
            store,
            rank,
            world,
            vote_timeout_s=vote_timeout,
            decision_timeout_s=10.0,
            namespace="test",
        )
        for rank in range(world)
    ]


def _decide_all(agreements, round_key, votes):
    results = [None] * len(agreements)

    def vote(rank):
        results[rank] = agreements[rank].decide(round_key, **votes[rank])

    threads = [threading.Thread(target=vote, args=(r,)) for r in range(len(agreements))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    return results


def test_commit_needs_every_vote_ok_and_takes_the_latest_proposed_step(tmp_path):
    agreements = _agreements(tmp_path)
    decisions = _decide_all(
        agreements, "r1", [dict(ok=True, proposal=10), dict(ok=True, proposal=12)]
    )
    assert all(d.commit and d.step == 12 for d in decisions)
    decisions = _decide_all(
        agreements, "r2", [dict(ok=True, proposal=10), dict(ok=False, proposal=12)]
    )
    assert all(not d.commit for d in decisions)
    assert decisions[0] == decisions[1]
    assert "ranks [1] voted abort" in decisions[0].reason


def test_different_plans_abort_everywhere(tmp_path):
    agreements = _agreements(tmp_path)
    decisions = _decide_all(agreements, "p", [dict(ok=True, digest=1), dict(ok=True, digest=2)])
    assert all(not d.commit and "planned different" in d.reason for d in decisions)


def test_a_veto_before_the_decision_aborts_for_every_rank(tmp_path):
    """Rank 1's vote is late; rank 1's main thread reaches its fence first and vetoes."""
    agreements = _agreements(tmp_path, vote_timeout=5.0)
    results = {}
    coordinator = threading.Thread(
        target=lambda: results.setdefault(0, agreements[0].decide("v", ok=True, proposal=3))
    )
    coordinator.start()
    veto = agreements[1].veto("v")  # main thread of rank 1
    late = agreements[1].decide("v", ok=True, proposal=5)  # its worker, after the veto
    coordinator.join(20)
    assert not veto.commit and "vetoed" in veto.reason
    assert results[0] == veto == late


def test_a_veto_after_a_commit_returns_the_commit(tmp_path):
    agreements = _agreements(tmp_path)
    decisions = _decide_all(agreements, "c", [dict(ok=True, proposal=4), dict(ok=True, proposal=4)])
    assert decisions[0].commit
    assert agreements[1].veto("c") == decisions[0]


def test_clock_fence_vetoes_instead_of_waiting_for_peers():
    clock = StepClock()
    clock.raise_fence(2, "k")
    calls = []

    class Abort:
        commit = False

    def resolve(key):
        calls.append(key)
        return Abort()

    assert clock.enter_step(resolve, timeout_s=0.1)  # step 0 < fence 2: nothing to do
    clock.advance()
    clock.advance()
    assert clock.enter_step(resolve, timeout_s=0.1) and calls == ["k"]
    assert clock.vetoes == 1
    assert clock.enter_step(resolve, timeout_s=0.1) and calls == ["k"]  # resolved once


def test_staging_blocks_are_released_only_once_and_published_only_from_staging():
    pool = StagingPool(2, slots_per_rank=3, slot_nbytes=8)
    first = pool.acquire(layer=0)
    second = pool.acquire(layer=1)
    assert pool.acquire(layer=2, timeout=0.05) is None  # both taken: the worker must wait
    pool.publish(first)
    with pytest.raises(StagingOwnershipError):
        pool.publish(first)
    pool.release(first)
    with pytest.raises(StagingOwnershipError, match="double release"):
        pool.release(first)
    assert pool.states() == [BlockState.FREE, BlockState.STAGING]
    assert not pool.wait_all_free(timeout=0.05)
    pool.release(second)
    assert pool.wait_all_free(timeout=0.05)
    assert first.reads.shape == (3, 8) and first.receives.dtype == torch.uint8


def test_policy_options_are_checked_at_start_up():
    with pytest.raises(TypeError, match=r"policy 'default' has no option\(s\) \['bogus'\]"):
        PolicyPlanner("default", 16, 1, 1, 4, {"bogus": 1})
    PolicyPlanner("churn_aware", 16, 1, 1, 4, {"min_gain": 0.1})


def _window(step: int, logical: torch.Tensor, committed: torch.Tensor) -> WindowLoad:
    return WindowLoad(step, logical, torch.zeros_like(committed), committed)


def test_planner_hands_the_previous_window_to_policies_that_take_it(monkeypatch):
    """The drift hedge needs the load of the window planned before; the planner keeps it, also
    for windows it only observes (a rank that reduced a window but did not plan it)."""
    seen = []

    def with_history(problem, *, previous_weight=None):
        seen.append(None if previous_weight is None else previous_weight.clone())
        return problem.old_phy2log

    def without_history(problem):
        return problem.old_phy2log

    monkeypatch.setitem(registry._POLICIES, "test_history", with_history)
    monkeypatch.setitem(registry._POLICIES, "test_no_history", without_history)
    committed = torch.arange(8).repeat(2, 1)
    loads = [torch.full((1, 2, 8), float(v)) for v in (1, 2, 3)]
    planner = PolicyPlanner("test_history", 8, 1, 1, 2)
    assert planner(_window(10, loads[0], committed)) is None  # unchanged placement
    planner.observe(_window(20, loads[1], committed))
    planner(_window(30, torch.zeros(1, 2, 8), committed))  # empty window: no plan, no history
    planner.observe(_window(40, loads[2], committed))  # the worker observes before planning
    planner(_window(40, loads[2], committed))
    assert seen[0] is None
    assert torch.equal(seen[1], loads[1])
    assert len(seen) == 2
    PolicyPlanner("test_no_history", 8, 1, 1, 2)(_window(10, loads[0], committed))  # no TypeError
    with pytest.raises(TypeError, match=r"previous_weight.*supplied by the planner"):
        PolicyPlanner("churn_aware", 16, 1, 1, 4, {"previous_weight": None})


def test_commit_margin_doubles_after_a_veto_and_shrinks_after_commits():
    """A veto means the decision took longer than the margin; the next one gets twice the
    margin (bounded), and commits bring it back toward the configured one."""
    from eplb_graph.movement.commit import PublishAtAgreedStep, StepClock
    from eplb_graph.movement.transport import VETO_REASON, Decision

    class Scripted:
        def __init__(self, decisions):
            self.decisions = list(decisions)
            self.proposals = []

        def decide(self, round_key, ok, proposal, transport_failed):
            self.proposals.append(proposal)
            return self.decisions.pop(0)

    veto = Decision(False, -1, f"rank 1 {VETO_REASON}")
    other_abort = Decision(False, -1, "ranks [1] voted abort")
    vetoes = [veto] * 8
    commits = [Decision(True, 0, "ok")] * 60
    agreement = Scripted([*vetoes, other_abort, *commits])
    delivery = PublishAtAgreedStep(StepClock(), pool=None, publish=None, commit_margin_steps=4)
    for round_index in range(len(agreement.decisions)):
        delivery.deliver(agreement, f"r{round_index}", [], ok=True, transport_failed=False)
    # The clock stays at step 0, so each proposal is the margin in force for that round.
    assert agreement.proposals[:9] == [4, 8, 16, 32, 64, 128, 256, 256, 256]
    assert agreement.proposals[9] == 256  # an abort that is not a veto changes nothing
    shrinking = agreement.proposals[10:]
    assert shrinking == sorted(shrinking, reverse=True) and shrinking[-1] == 4
    assert delivery.margin == 4


def test_commit_steps_never_go_backwards_when_the_margin_shrinks():
    """Layers are installed in publication order; a later layer decided for an earlier step
    than its predecessor would find that step passed."""
    from eplb_graph.movement.commit import PublishAtAgreedStep, StepClock
    from eplb_graph.movement.transport import Decision

    class MaxOfProposal:
        def __init__(self):
            self.proposals = []

        def decide(self, round_key, ok, proposal, transport_failed):
            self.proposals.append(proposal)
            return Decision(True, proposal, "ok")

    clock = StepClock()
    delivery = PublishAtAgreedStep(clock, pool=None, publish=None, commit_margin_steps=4)
    delivery.margin = 64  # grown by earlier vetoes
    agreement = MaxOfProposal()
    for round_index in range(12):
        clock.advance()
        delivery.deliver(agreement, f"r{round_index}", [], ok=True, transport_failed=False)
    assert agreement.proposals == sorted(agreement.proposals), agreement.proposals
    assert delivery.margin < 64  # it did shrink meanwhile


# -- staging memory: capped by the model, bounded by a budget ------------------------------------


def _runtime(tmp_path, settings):
    """A sync, one-rank runtime over a 2-layer model (nothing is moved: only start-up matters)."""
    from eplb_graph import EplbRuntime, EplbState, Placement

    placement = Placement.default(2, 4, 0, 1)
    payloads = [expert_payloads("unquantized", layer, 4) for layer in range(2)]
    agreement = StoreAgreement(
        dist.FileStore(str(tmp_path / "store"), 1),
        0,
        1,
        vote_timeout_s=1.0,
        decision_timeout_s=1.0,
        namespace="budget",
    )
    return EplbRuntime(
        EplbState(placement, rank=0),
        rank_views("unquantized", placement.phy2log, 0, 1, payloads),
        dataclasses.replace(settings, window_size=4, step_interval=4, use_async=False),
        lambda: None,
        0,
        agreement=agreement,
    ), payloads


def test_layers_per_step_beyond_the_model_sizes_staging_by_the_model(tmp_path):
    runtime, payloads = _runtime(tmp_path, RuntimeSettings(layers_per_step=1024))
    try:
        # 2 layers: at most 2 blocks (not 2 x 1024), each reads + receives 4 slots.
        assert runtime.settings.layers_per_step == 2
        assert len(runtime.pool.blocks) == 2
        assert runtime.pool.nbytes == 2 * 2 * 4 * payloads[0].shape[1]
    finally:
        runtime.close()


@pytest.mark.parametrize(
    ("model", "match"),
    [
        ({"num_experts": 8}, "describe 8 experts but the state holds 4"),
        ({"num_experts": 4, "num_redundant_experts": 4}, "8 physical slots but the state holds 4"),
        ({"ep_size": 2}, "describe 2 EP ranks but the state holds 1"),
    ],
)
def test_a_runtime_refuses_settings_resolved_for_another_model(tmp_path, model, match):
    """Settings carry the model they were resolved for; a state built for another must not run
    under them (its tables and the plans would disagree on every slot)."""
    from eplb_graph.arguments import SettingsError

    with pytest.raises(SettingsError, match=match):
        _runtime(tmp_path, RuntimeSettings(**model))
    runtime, _ = _runtime(tmp_path, RuntimeSettings(num_experts=4, ep_size=1))
    runtime.close()


def test_staging_beyond_its_budget_fails_at_start_naming_the_field_and_the_fix(tmp_path):
    from eplb_graph.movement.staging import StagingBudgetError

    slot_nbytes = int(expert_payloads("unquantized", 0, 4).shape[1])
    needed = 2 * 2 * 4 * slot_nbytes  # default 2 blocks on a 2-layer model
    with pytest.raises(StagingBudgetError, match="raise staging_budget_bytes to at least") as info:
        _runtime(tmp_path, RuntimeSettings(staging_budget_bytes=needed - 1))
    assert (info.value.needed, info.value.budget) == (needed, needed - 1)
    runtime, _ = _runtime(tmp_path, RuntimeSettings(staging_budget_bytes=needed))
    runtime.close()


def test_the_vllm_section_turns_the_budget_error_into_its_own_setting():
    from eplb_graph import ConfigError
    from eplb_graph.integrations.vllm.options import PluginOptions
    from eplb_graph.integrations.vllm.settings import staging_budget_config_error
    from eplb_graph.movement.staging import StagingBudgetError

    assert PluginOptions().staging_budget_mib == 16384
    error = staging_budget_config_error(StagingBudgetError(3 << 20, 1 << 20, 2, 4, 393216))
    assert isinstance(error, ConfigError)
    assert error.field == "additional_config.eplb_graph.staging_budget_mib"
    assert "need 3 MiB" in error.reason and "to at least 3" in error.reason


def test_closing_the_pool_releases_a_worker_waiting_for_installs_that_never_come():
    """At shutdown the main thread installs nothing more: a worker waiting for a published
    block to come back (or for a free one) must give up at once, not after its timeout, so the
    movement thread stops with the runtime."""
    import time

    pool = StagingPool(1, 2, 8, pin=False)
    block = pool.acquire(0)
    pool.publish(block)  # handed to the main thread, which stops serving before installing it
    outcome: dict = {}

    def worker() -> None:
        started = time.monotonic()
        outcome["all_free"] = pool.wait_all_free(timeout=60)
        outcome["acquired"] = pool.acquire(1, timeout=60)
        outcome["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=worker)
    thread.start()
    time.sleep(0.2)
    assert thread.is_alive()  # still waiting: nothing was released
    pool.close()
    thread.join(10)
    assert not thread.is_alive()
    assert outcome == {"all_free": False, "acquired": None, "seconds": outcome["seconds"]}
    assert outcome["seconds"] < 10
