"""One log line per decision that changes something, and a rate-limited one for the rest.

A user must tell "keeping still on purpose" from "broken" from the log alone. So every applied
plan and every step back is logged (they are rare: at most one per window close); a kept
placement is logged when its reason changes, else at most once per :data:`QUIET_S`; a failed
decision is a WARNING the first time its cause is seen, else at most once per :data:`QUIET_S`,
with the number of failures since the last line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

logger = logging.getLogger("eplb_graph.control")

QUIET_S = 60.0


class DecisionLog:
    """Logs decision records (the dicts the gate keeps, or the planner's own).

    Args:
        announce: log applied and kept decisions (one rank of a group does; failures are logged
            on every rank, since one rank's failure is that rank's alone).
        clock: seconds (``time.monotonic``; a test passes its own).
    """

    def __init__(self, announce: bool, clock: Callable[[], float] = time.monotonic) -> None:
        self.announce = announce
        self.clock = clock
        self._kept_reason: str | None = None
        self._kept_at = -float("inf")
        self._kept_silent = 0
        self._causes: set[str] = set()
        self._failed_at = -float("inf")
        self._failed_silent = 0

    def record(self, decision: dict) -> None:
        action = decision.get("action")
        if action == "failed":
            self._failed(decision)
        elif action in ("applied", "rollback"):
            self._moved(decision)
        elif action == "kept":
            self._kept(decision)

    def _moved(self, decision: dict) -> None:
        if not self.announce:
            return
        what = "going back to" if decision["action"] == "rollback" else "applying"
        figures = ""
        if "predicted_step_ms_plan" in decision:
            figures = (
                f": predicted expert time {decision['predicted_step_ms_now']:.2f} -> "
                f"{decision['predicted_step_ms_plan']:.2f} ms per step, "
                f"{decision['copies']} copies ({decision['cost_ms']:.1f} ms), "
                f"net {decision['net_ms']:+.1f} ms over {decision['horizon_steps']} steps"
            )
        logger.info(
            "EPLB step %d: %s the %s placement (%s)%s",
            decision["step"], what, decision.get("candidate", "planned"), decision["reason"],
            figures,
        )  # fmt: skip
        self._kept_reason = None

    def _kept(self, decision: dict) -> None:
        if not self.announce:
            return
        now, reason = self.clock(), decision["reason"]
        if reason == self._kept_reason and now - self._kept_at < QUIET_S:
            self._kept_silent += 1
            return
        repeated = reason == self._kept_reason and self._kept_silent
        since = f" ({self._kept_silent} windows kept for it since the last line)" * bool(repeated)
        logger.info("EPLB step %d: keeping the placement: %s%s", decision["step"], reason, since)
        self._kept_reason, self._kept_at, self._kept_silent = reason, now, 0

    def _failed(self, decision: dict) -> None:
        now, reason = self.clock(), decision["reason"]
        cause = reason.split(":", 1)[0]
        if cause in self._causes and now - self._failed_at < QUIET_S:
            self._failed_silent += 1
            return
        since = f" ({self._failed_silent} more failures since the last warning)" * bool(
            self._failed_silent
        )
        self._causes.add(cause)
        logger.warning(
            "EPLB step %d: deciding failed, the placement is kept and the next window decides "
            "again: %s%s",
            decision["step"], reason, since,
        )  # fmt: skip
        self._failed_at, self._failed_silent = now, 0
