"""Spawn real ``torch.distributed`` gloo process groups on this machine for multi-rank tests.

A thin test wrapper over :func:`eplb_graph.launch.spawn_ranks` (the demo's launcher): each rank
runs ``fn(rank, world_size, *args)`` in a fresh spawned process inside an initialized default
gloo group; any rank's exception fails the test with that rank's traceback, and a timeout turns
a hang into a failure instead of a stuck suite.
"""

from __future__ import annotations

from collections.abc import Callable

from eplb_graph.launch import RankFailed, spawn_ranks


def run_ranks(fn: Callable, world_size: int, *args, timeout_s: float = 120.0) -> list:
    """Run ``fn`` on ``world_size`` spawned gloo ranks; returns each rank's result in order."""
    try:
        return spawn_ranks(fn, world_size, *args, timeout_s=timeout_s)
    except RankFailed as failure:
        raise AssertionError(str(failure)) from None
