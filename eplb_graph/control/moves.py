"""What each move cost and what it saved, measured: the gate's ledger and its price of a copy.

A move costs serving the time its steps took beyond idle ones while weights moved (the
``movement_cost_us`` the ranks measure: :mod:`eplb_graph.control.feedback`). It saves, in every
window served under it, what the placement before it would have taken under that window's load
(predicted, scaled by what that placement measured against its predictions when it served)
less what the ranks measured under it. Set against the same load, a traffic change is neither
a saving nor a loss; what remains is the move's doing.

What moves realize of what they were predicted to save, under the loads they served, is the
share by which the next plan's predicted saving is discounted (:meth:`MoveLedger.realized`):
a model that flatters plans makes the gate more demanding by exactly as much, and as newer
moves realize more, less demanding again.

The price of one copy, for the next plan, comes from the moves measured so far: the median of
their cost per copy (one move that ran beside a burst of other work does not set the price of
every later one), never below what the copy's bytes cost to move (:data:`FLOOR_BYTES_PER_US`),
and, before any move was measured, a pessimistic prior (:data:`PRIOR_BYTES_PER_US`).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from eplb_graph.control.calibration import SIMILAR_LOAD, load_distance

__all__ = ["FLOOR_BYTES_PER_US", "PRIOR_BYTES_PER_US", "Move", "MoveLedger"]

PRIOR_BYTES_PER_US = 1000.0
"""Before any move was measured, a copy is taken to cost serving 1 µs per 1000 bytes (1 ms per
MiB): it is staged, sent, received and installed on the cores that serve, while steps run. A
profile of a vLLM CPU engine moving 3 MiB bf16 experts (py-spy, both ranks, the whole drift
benchmark) put the movement worker's and the installs' CPU time well under 1 ms per copy. The
prior before, 3.5 ms per MiB (from moves priced by each step's positive extra over an epoch's
mean, which counted step noise as cost), refused on an AMX Xeon every first move of two drift
runs, 17% cuts of the step among them, so nothing was ever measured to correct it. The first
measured move replaces it."""
FLOOR_BYTES_PER_US = 2000.0
"""No copy is priced below 1 µs per 2000 bytes (0.5 ms per MiB): its bytes are read, sent and
written at least once, and nothing on a host moves them faster than memory does. A move whose
steps happened to be no slower than idle ones measured a cost of zero; taken as the price of a
copy, it made every later plan look free (and the search that prices moves refuse to run)."""
PRIOR_COPY_READS = 100.0
"""Where a copy's bytes are unknown, the prior is 100 of its weight reads by the expert kernel
and the floor one read (the fitted model's ``read_us``, or its ``row_us``, at least 1 µs)."""
RECENT_MOVES = 8
"""Moves whose cost per copy sets the price, and whose savings the realized share (the newest)."""
MIN_REALIZED = 0.25
"""The realized share is never taken below a quarter: moves that realized nothing would
otherwise stop every later one, and no later move could then show that the model improved."""
KEPT = 16
"""Moves kept for the metrics files (the newest)."""


@dataclass
class Move:
    """One applied plan, and what measuring it has shown so far."""

    index: int
    step: int
    candidate: str
    copies: int
    before: torch.Tensor
    plan: torch.Tensor
    predicted_saving_us: float
    """Per step, at the window that chose it (the busiest rank's expert time)."""
    cost_us: float = 0.0
    """Signed, as measured: the steps' noise cancels over a move, so it may dip below zero;
    read :attr:`measured_cost_us`."""
    saved_us: float = 0.0
    predicted_us: float = 0.0
    """What the model predicted it would save over the same windows (their served loads)."""
    windows: int = 0
    """Windows measured under its plan (each credited ``saved_us``)."""
    back: str | None = None
    """A step back's reason (``rollback``; ``None`` for a step forward): the placement it left is
    not one to return to."""
    shares: torch.Tensor | None = None
    """The expert shares of the load it was chosen under."""

    @property
    def measured_cost_us(self) -> float:
        """What the move cost serving, never below zero."""
        return max(0.0, self.cost_us)

    def as_dict(self) -> dict[str, Any]:
        measured = self.windows > 0
        return {
            "move": self.index,
            "step": self.step,
            "candidate": self.candidate,
            "copies": self.copies,
            "predicted_saving_ms_per_step": self.predicted_saving_us / 1e3,
            "cost_ms": self.measured_cost_us / 1e3,
            "saved_ms": self.saved_us / 1e3 if measured else None,
            "predicted_saved_ms": self.predicted_us / 1e3 if measured else None,
            "windows_measured": self.windows,
            "net_ms": (self.saved_us - self.measured_cost_us) / 1e3 if measured else None,
        }


class MoveLedger:
    """Moves in order, their measured cost and saving, and the price of a copy they imply.

    Args:
        copy_bytes: bytes of one expert copy (0: unknown; the prior and the floor are then
            counted in the fitted model's weight reads).
    """

    def __init__(self, copy_bytes: int = 0) -> None:
        self.copy_bytes = max(0, int(copy_bytes))
        self.moves: deque[Move] = deque(maxlen=KEPT)
        self._count = 0
        self._cost_seen_us = 0.0

    def applied(
        self,
        step: int,
        candidate: str,
        before: torch.Tensor,
        plan: torch.Tensor,
        copies: int,
        predicted_saving_us: float,
        back: str | None = None,
        shares: torch.Tensor | None = None,
    ) -> Move:
        self._count += 1
        move = Move(self._count, step, candidate, copies, before, plan, predicted_saving_us,
                    back=back, shares=shares)  # fmt: skip
        self.moves.append(move)
        return move

    def movement_cost(self, total_us: float | None) -> None:
        """The ranks' running total of what moving has cost serving (µs, signed): what it
        changed by since the last window is the newest move's (moves run one at a time)."""
        if total_us is None or not math.isfinite(total_us):
            return
        grown = total_us - self._cost_seen_us
        self._cost_seen_us = total_us
        if self.moves:
            self.moves[-1].cost_us += grown

    def credit(
        self, committed: torch.Tensor, saving_us: float, predicted_us: float, steps: int
    ) -> None:
        """A window measured under ``committed``: credit the newest move, if it is that plan,
        with the saving per step it measured and the one the model predicts for this window's
        load, over ``steps``."""
        if not self.moves or not (math.isfinite(saving_us) and math.isfinite(predicted_us)):
            return
        move = self.moves[-1]
        if torch.equal(move.plan, committed):
            move.saved_us += saving_us * steps
            move.predicted_us += predicted_us * steps
            move.windows += 1

    def realized(self) -> float:
        """The share of their predicted saving that the recent measured moves realized, in
        ``[MIN_REALIZED, 1]`` (1 before any move was measured)."""
        recent = [m for m in list(self.moves)[-RECENT_MOVES:] if m.windows and m.predicted_us > 0]
        predicted = sum(move.predicted_us for move in recent)
        if predicted <= 0:
            return 1.0
        share = sum(move.saved_us for move in recent) / predicted
        return min(1.0, max(MIN_REALIZED, share))

    def newest(self) -> Move | None:
        return self.moves[-1] if self.moves else None

    def stepped_back_to(
        self, committed: torch.Tensor, shares: torch.Tensor | None, reason: str
    ) -> bool:
        """Whether the newest move stepped back, for ``reason``, to ``committed`` under a load
        like ``shares`` (:data:`~eplb_graph.control.calibration.SIMILAR_LOAD`)."""
        move = self.newest()
        return (
            move is not None
            and move.back == reason
            and torch.equal(move.plan, committed)
            and shares is not None
            and move.shares is not None
            and load_distance(move.shares, shares) <= SIMILAR_LOAD
        )

    def copy_us(self, read_us: float) -> tuple[float, str]:
        """``(µs, source)``: the price of one copy for the next plan (see the module docstring);
        ``read_us``: the fitted model's cost of one weight read (the unit where bytes are
        unknown). ``source`` is ``prior``, ``measured`` or ``floor``."""
        floor = self.copy_bytes / FLOOR_BYTES_PER_US if self.copy_bytes else max(read_us, 1.0)
        samples = [
            move.measured_cost_us / move.copies
            for move in list(self.moves)[-RECENT_MOVES:]
            if move.windows > 0 and move.copies > 0
        ]
        if not samples:
            prior = (
                self.copy_bytes / PRIOR_BYTES_PER_US
                if self.copy_bytes
                else PRIOR_COPY_READS * max(read_us, 1.0)
            )
            return max(prior, floor), "prior"
        measured = statistics.median(samples)
        return (measured, "measured") if measured > floor else (floor, "floor")

    def figures(self) -> list[dict[str, Any]]:
        return [move.as_dict() for move in self.moves]

    def repaid(self) -> tuple[int, int]:
        """``(moves with a positive measured net, moves measured)``."""
        measured = [move for move in self.moves if move.windows > 0]
        return sum(move.saved_us > move.measured_cost_us for move in measured), len(measured)
