"""The payback gate's tolerances (how far apart two placements must be predicted before the
gate acts on the difference) and the reasons it gives where they decide.

One figure, 5%, for three questions, because they are one question: two measurements of one
placement on a shared host differ by as much, and so does the cost model between two placements.
"""

from __future__ import annotations

__all__ = ["BACK_TOLERANCE", "CANNOT_TELL", "CLEARLY_FASTER", "HOME", "MIN_SAVING", "SLOWER"]

BACK_TOLERANCE = 0.05
"""The committed placement must go back when it is more than 5% slower, under the served load,
than the starting placement or the one before the last move: two measurements of one placement
on a shared host differ by as much, and so does the model between two placements (on the drift
benchmark, a 1% threshold went back from a placement the model put 2% slower than the start; the
start then measured 8% slower, and it went forward again: two moves of 31 copies for nothing)."""
CLEARLY_FASTER = 0.05
"""Going back, the gate moves to that placement itself unless another is predicted faster
than it by this much (a placement that served is known; a new one is a prediction)."""
MIN_SAVING = BACK_TOLERANCE
"""A plan must be predicted to cut the step's expert time by at least 5%, the tolerance within
which the gate cannot tell two placements apart (:data:`BACK_TOLERANCE`): below it the
prediction is within the model's error between two placements. On the AMX drift benchmark with
2%, the three moves predicted to save 2.5-5% measured +15, -52 and -205 ms net, while every move
predicted to save more repaid (the moves of the first windows after a shift are predicted at
14-20%); each still costs its copies."""

SLOWER = "slower than before: going back"
"""A step back from a placement slower than where it came from by :data:`BACK_TOLERANCE`."""
HOME = "nothing beats the starting placement under this load: going back to it"
"""A step toward the start from a placement predicted slower than it, where no plan could beat
the start by :data:`MIN_SAVING` (a drift benchmark's chat-tuned placement under mixed traffic:
predicted 1% slower, it served 3-4% slower in one run). Only where it repays its copies within
the interval: the steps the drift benchmark took on differences of 0.2-0.5 ms per step (under
1%, predicted to lose 7-43 ms over the interval) measured -206, +373 and -447 ms net."""
CANNOT_TELL = "no placement can save enough to tell from noise"
"""A window kept without pricing: the floor under every placement is within :data:`MIN_SAVING`
of the committed one."""
