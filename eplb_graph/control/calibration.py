"""What each placement measured, by the load it served: how the gate compares placements on
the load served now.

A window measures the committed placement only (each rank's expert-op time per layer). To say
what another placement would take under the same load, the gate predicts it with the expert
cost model, scaled by how that placement measured against the model under a load like this one
(:data:`SIMILAR_LOAD`) or, for a placement never measured under such a load, by how the
committed one does. So a measurement is reused only where it applies: a placement measured slow
under one traffic is not presumed slow under another. A window that measured a placement far
from what it measured before under a load like this one (:data:`DISTURBED`) was disturbed by
something else on the host: it calibrates nothing, once.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "DISTURBED",
    "SIMILAR_LOAD",
    "Calibrations",
    "Measurement",
    "load_distance",
    "load_shares",
]

SIMILAR_LOAD = 0.15
"""A placement's calibration holds for loads whose expert shares are within this total-variation
distance (averaged over layers) of the load it was measured under: a placement measured slow
under one traffic says nothing about another."""
CALIBRATION_WEIGHT = 0.5
"""Each measured window moves a placement's measured time halfway to the new measurement."""
MAX_AGE = 32
"""Windows after which a calibration no longer holds: the engine, and what else runs beside it,
change; a placement measured long ago is predicted by the model again."""
CALIBRATIONS = 16
"""Calibrations kept (the newest)."""
DISTURBED = 0.3
"""A window whose measurement of a placement is more than 30% above, or 30% below, what that
placement measured under a load like this one (carried to this load by the model) was disturbed:
the host stalled, or the calibration was made in a stall. On the drift benchmark one placement's
window-to-window change stayed within 26% (378 windows of 21 runs on an EPYC Zen 4) but for
three stalls of 1.5-1.8x, which the gate took as the placement's speed: one, on a 3-copy step,
charged that step 1.3 s it did not lose. A disturbed window calibrates nothing and credits no
move; a second in a row is the new normal and does both."""


@dataclass
class _Calibration:
    """What one placement measured (expert µs per step) under a load (rows per step)."""

    placement: torch.Tensor
    load: torch.Tensor
    shares: torch.Tensor
    measured_us: float
    windows: int = 1
    updated: int = 0
    """The window it was last measured in (:attr:`Calibrations.window`)."""


@dataclass(frozen=True)
class Measurement:
    """What a window's measurement of a placement was worth (:meth:`Calibrations.measure`)."""

    against_calibration: float | None
    """Measured over what the placement's calibration under a load like this one expected
    (``None`` where it had none)."""
    disturbed: bool = False
    """Too far from it (:data:`DISTURBED`): the window calibrated nothing."""


class Calibrations:
    """What each placement measured, by the load it served.

    Kept as measured times, not as ratios to a prediction: the model is refitted every window,
    and a ratio to an old fit would carry that fit's errors. A placement's ratio is recomputed
    against the current model each time it is read (:meth:`ratio`), so the model only carries a
    measurement across the small difference between the load it was made under and this one.
    """

    def __init__(self, step_us: Callable[[torch.Tensor, torch.Tensor], float]) -> None:
        self.step_us = step_us
        self.entries: deque[_Calibration] = deque(maxlen=CALIBRATIONS)
        self.window = 0
        """The current window's number (the gate advances it)."""
        self._disturbed_last = False

    def find(self, placement: torch.Tensor, shares: torch.Tensor | None) -> _Calibration | None:
        """The calibration of ``placement`` nearest to ``shares``, if within SIMILAR_LOAD."""
        best, best_distance = None, SIMILAR_LOAD
        if shares is None:
            return None
        for entry in self.entries:
            if self.window - entry.updated > MAX_AGE:
                continue
            if torch.equal(entry.placement, placement):
                distance = load_distance(entry.shares, shares)
                if distance <= best_distance:
                    best, best_distance = entry, distance
        return best

    def ratio(self, entry: _Calibration) -> float | None:
        """Measured over what the current model predicts for the same placement and load."""
        predicted = self.step_us(entry.placement, entry.load)
        return entry.measured_us / predicted if predicted > 0 else None

    def measure(
        self, placement: torch.Tensor, load: torch.Tensor, shares: torch.Tensor, measured: float
    ) -> Measurement:
        """Calibrate ``placement`` on what a window measured under ``load``, unless the window
        was disturbed (:data:`DISTURBED`; not two in a row)."""
        entry = self.find(placement, shares)
        expected = None if entry is None else self._carried(entry, load)
        against = measured / expected if expected else None
        disturbed = (
            against is not None
            and not self._disturbed_last
            and not 1 / (1 + DISTURBED) <= against <= 1 + DISTURBED
        )
        self._disturbed_last = disturbed
        if not disturbed:
            self._record(entry, expected, placement, load, shares, measured)
        return Measurement(against, disturbed)

    def _record(
        self,
        entry: _Calibration | None,
        carried: float | None,
        placement: torch.Tensor,
        load: torch.Tensor,
        shares: torch.Tensor,
        measured: float,
    ) -> None:
        """A new calibration, or ``entry``'s measurement (``carried`` to this load by the model)
        moved toward the new one."""
        if entry is None or carried is None:
            entry = _Calibration(placement.clone(), load, shares, measured, updated=self.window)
            self.entries.append(entry)
            return
        entry.measured_us = carried + CALIBRATION_WEIGHT * (measured - carried)
        entry.load, entry.shares = load, shares  # it follows a load that drifts slowly
        entry.windows += 1
        entry.updated = self.window
        # The newest last (by identity: a calibration holds tensors, so no == between them).
        self.entries = deque(
            [e for e in self.entries if e is not entry] + [entry], maxlen=CALIBRATIONS
        )

    def _carried(self, entry: _Calibration, load: torch.Tensor) -> float:
        """What ``entry``'s placement measured, carried by the model to ``load``."""
        before = self.step_us(entry.placement, entry.load)
        return entry.measured_us * self.step_us(entry.placement, load) / before if before else 0.0

    def latest(self) -> float | None:
        fresh = [e for e in self.entries if self.window - e.updated <= MAX_AGE]
        return self.ratio(fresh[-1]) if fresh else None


def load_shares(per_step: torch.Tensor) -> torch.Tensor:
    """Each layer's expert shares of its rows (``[L, N]``, rows summing to 1 where any)."""
    totals = per_step.sum(dim=1, keepdim=True)
    return torch.where(totals > 0, per_step / totals.clamp(min=1e-300), torch.zeros_like(per_step))


def load_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Total-variation distance of two loads' shares, averaged over layers."""
    if a.shape != b.shape:
        return math.inf
    return float(np.mean(0.5 * (a - b).abs().sum(dim=1).numpy()))
