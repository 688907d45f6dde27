"""Liveness of async rearrangements on real gloo ranks that are never held in step.

Serving here has no per-step collective (unlike a model whose forward all-reduces), steps take
1-10 ms with per-rank random jitter, and the planner moves to a new placement at every window.
Rearrangements must still make progress: windows that pile up while a job is in flight are
coalesced into one job on the newest window (every rank consuming the same ones), a rank whose
share of a window was overwritten stands in its newest rows instead of aborting everyone, and
no serving step waits for a peer. The counters of ``stats()`` must agree with each other and
with their documentation (``eplb_graph/stats.py``).
"""

from __future__ import annotations

import logging
import random
import time

import pytest
import torch

from eplb_graph import (
    EplbRuntime,
    EplbState,
    GroupRing,
    Placement,
    RuntimeSettings,
)
from tests.distributed import run_ranks
from tests.movement_fixtures import expert_payloads, rank_views, slot_mismatches
from tests.routing import route_and_record

NUM_LAYERS, NUM_EXPERTS = 3, 8


class ShufflingPlanner:
    """A new placement at every window: the slots of the default placement shuffled with a seed
    taken from the window's step, so every rank plans the same one for the same window."""

    def __init__(self, base: torch.Tensor) -> None:
        self.base = base

    def __call__(self, load) -> torch.Tensor:
        generator = torch.Generator().manual_seed(int(load.step))
        return torch.stack(
            [row[torch.randperm(row.numel(), generator=generator)] for row in self.base]
        )


class AbortLog(logging.Handler):
    """Collects this rank's abort reasons from the library's log."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if " aborted on rank " in message:
            self.reasons.append(message)


def _serve(rank, world_size, steps, window, step_ms, extra_ms_on_rank1):
    """Serve ``steps`` jittered steps; return this rank's metrics, commits and timings."""
    torch.set_num_threads(1)
    aborts = AbortLog()
    logging.getLogger("eplb_graph").addHandler(aborts)
    placement = Placement.default(NUM_LAYERS, NUM_EXPERTS, 2 * world_size, world_size)
    state = EplbState(placement, rank=rank)
    payloads = [expert_payloads("unquantized", layer, NUM_EXPERTS) for layer in range(NUM_LAYERS)]
    views = rank_views("unquantized", placement.phy2log, rank, world_size, payloads)
    runtime = EplbRuntime(
        state,
        views,
        RuntimeSettings(window_size=window, step_interval=window),
        GroupRing(size=2, timeout_s=30),
        rank,
        planner=ShufflingPlanner(placement.phy2log.clone()),
    )
    generator = torch.Generator().manual_seed(rank)
    jitter = random.Random(100 + rank)
    low, high = step_ms
    extra_s = extra_ms_on_rank1 / 1000 if rank == 1 else 0.0
    commits, longest_begin_s = [], 0.0
    started = time.perf_counter()
    try:
        for step in range(steps):
            before = time.perf_counter()
            committed = runtime.begin_step(has_prefill=False, num_valid_tokens=16)
            longest_begin_s = max(longest_begin_s, time.perf_counter() - before)
            commits += [(step, layer, tuple(state.phy2log[layer].tolist())) for layer in committed]
            ids = torch.randint(0, NUM_EXPERTS, (16, 2), generator=generator)
            route_and_record(state, ids)
            time.sleep(jitter.uniform(low, high) / 1000 + extra_s)
            runtime.end_step()
        serving_s = time.perf_counter() - started
        metrics = runtime.stats().as_dict()
        mismatches = slot_mismatches(views, state.phy2log, rank, world_size, payloads)
    finally:
        runtime.close()
    return {
        "metrics": metrics,
        "commits": commits,
        "longest_begin_s": longest_begin_s,
        "serving_s": serving_s,
        "mismatches": mismatches,
        "aborts": aborts.reasons,
    }


def _check_counters(metrics: dict) -> None:
    """The relations ``eplb_graph/stats.py`` states for ``EplbStats``."""
    movement = control = metrics
    ended = (
        movement["rearrangements_completed"]
        + movement["rearrangements_aborted"]
        + movement["rearrangements_noop"]
    )
    assert ended <= movement["rearrangements_finished"] <= movement["rearrangements_started"]
    assert movement["rearrangements_completed"] <= movement["layers_committed"], movement
    assert movement["layers_committed"] <= movement["layers_delivered"], movement
    handed_over = movement["windows_committed"] + movement["windows_pending"]
    assert handed_over <= control["windows_closed"], (movement, control)
    assert movement["rearrangements_started"] <= control["windows_closed"], (movement, control)
    assert movement["late_items"] == 0 and movement["fence_timeouts"] == 0, movement


def _check_same_commits(results: list[dict]) -> None:
    """Every rank committed the same rows at the same steps, and holds the weights it routes to
    (every rank serves the same steps, so a commit agreed for one of them happens on all)."""
    first = results[0]["commits"]
    assert all(result["commits"] == first for result in results), "ranks committed differently"
    for result in results:
        assert result["mismatches"] == [], result["mismatches"]


@pytest.mark.parametrize("world_size", [2, 4])
def test_rearrangements_commit_without_ranks_in_step(world_size):
    window, steps = 10, 300
    results = run_ranks(_serve, world_size, steps, window, (1.0, 10.0), 0.0, timeout_s=240)
    for result in results:
        metrics = result["metrics"]
        movement, closed = metrics, metrics["windows_closed"]
        _check_counters(metrics)
        # Windows still queued or in flight when serving stopped have not had their chance.
        finished = closed - movement["windows_pending"]
        assert movement["rearrangements_completed"] >= 3, (movement, result["aborts"])
        assert movement["windows_committed"] >= 0.9 * finished, (closed, movement, result["aborts"])
        assert movement["rearrangements_aborted"] <= 0.1 * closed, result["aborts"]
        assert result["longest_begin_s"] < 0.5, result["longest_begin_s"]
    _check_same_commits(results)


def test_a_slow_rank_never_holds_a_fast_one():
    """Rank 1's steps take 6 ms longer: rank 0 must serve at its own pace (it never waits for
    rank 1 at a step), and layers still commit on both at the same steps."""
    results = run_ranks(_serve, 2, 200, 10, (1.0, 3.0), 6.0, timeout_s=240)
    fast, slow = results
    assert fast["serving_s"] < 0.6 * slow["serving_s"], (fast["serving_s"], slow["serving_s"])
    assert fast["metrics"]["layers_committed"] > 0
    for result in results:
        _check_counters(result["metrics"])
    _check_same_commits(results)


def test_windows_closing_every_step_are_coalesced_and_keep_committing():
    steps = 200
    results = run_ranks(_serve, 2, steps, 1, (1.0, 5.0), 0.0, timeout_s=240)
    for result in results:
        movement = result["metrics"]
        _check_counters(result["metrics"])
        assert not [r for r in result["aborts"] if "worker late" in r], result["aborts"]
        assert movement["windows_coalesced"] > 0, movement
        assert movement["rearrangements_completed"] >= 3, movement
        late_commits = [c for c in result["commits"] if c[0] >= steps * 2 // 3]
        assert late_commits, "layers stopped committing in the last third of the run"
    _check_same_commits(results)
