"""What the movement worker hands the main thread's commit scheduler, through a queue.

Two kinds of item travel from the worker thread to the main thread, in order: a staged layer
with the step every rank installs it at, and the end marker of a rearrangement. Nothing else
crosses threads except the staging blocks these items carry (see ``staging`` for who owns them).
"""

from __future__ import annotations

from dataclasses import dataclass

from eplb_graph.movement.planner import RankPlan
from eplb_graph.movement.staging import StagingBlock
from eplb_graph.state import PreparedLayer


@dataclass
class PublishedLayer:
    """A staged layer and the step at which every rank installs it (main thread)."""

    generation: int
    layer: int
    commit_step: int
    rank_plan: RankPlan
    block: StagingBlock
    prepared: PreparedLayer
    bytes_received: int


@dataclass(frozen=True)
class RearrangementFinished:
    """End marker of one rearrangement (processed by the main thread as soon as it is reached).

    ``layers_published`` counts the layers this rearrangement handed over; they are ahead of this
    marker in the queue, so when the scheduler reaches it, every one of them is installed.
    ``items_consumed`` counts the submitted windows (or the plan) this job took, several when a
    backlog of windows was coalesced into one job. ``moves_started``: the pipeline's count of jobs
    that started moving weights, this one included, when it finished.
    """

    generation: int
    ok: bool
    error: str | None
    layers_published: int = 0
    items_consumed: int = 1
    moves_started: int = 0
