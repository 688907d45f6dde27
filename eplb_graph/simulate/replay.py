"""Replay an engine's recorded windows through a fresh planner: ``eplb-graph simulate
--windows FILE``.

The payback gate decides on window sums alone, so the windows an engine recorded
(``record_windows``: :mod:`eplb_graph.control.window_record`) replayed through a planner built
with the same settings must give the same decisions, window by window: what to apply, what to
keep and why. A difference means the decision depended on something outside the windows (a
bug: ranks could then disagree), so the replay says where the first one is. It is also how to
read a run offline: every decision with its figures, without the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from eplb_graph.control.planning import PolicyPlanner
from eplb_graph.control.window_record import read_windows

__all__ = ["ReplayReport", "replay_windows"]


@dataclass
class ReplayReport:
    """Each recorded window's decision next to the replay's."""

    windows: int = 0
    rows: list[dict] = field(default_factory=list)

    @property
    def differences(self) -> list[dict]:
        return [row for row in self.rows if not row["same"]]

    def summary(self) -> dict:
        differences = self.differences
        return {
            "windows": self.windows,
            "decisions": len(self.rows),
            "same_decisions": len(self.rows) - len(differences),
            "first_difference": differences[0] if differences else None,
        }


def replay_windows(path: str | Path) -> ReplayReport:
    """Replay the windows of ``path`` (a record written by ``record_windows``).

    Raises:
        ValueError: the file is not a window record.
        OSError: it cannot be read.
    """
    header, windows = read_windows(path)
    planner = PolicyPlanner(
        header["policy"],
        header["num_replicas"],
        header["num_groups"],
        header["num_nodes"],
        header["num_ranks"],
        dict(header["options"]),
        header["min_gain_percent"],
        rearrange=header["rearrange"],
        max_replicas=header["max_replicas"],
        step_interval=header["step_interval"],
        copy_bytes=header["copy_bytes"],
    )
    report = ReplayReport(windows=len(windows))
    for window in windows:
        plan = planner(window.load)
        decision = planner.last_decision
        if decision is not None and decision["step"] != window.load.step:
            decision = None
        if window.decision is None and decision is None:
            continue
        recorded_plan, same_plan = window.plan, True
        if (recorded_plan is None) != (plan is None):
            same_plan = False
        elif plan is not None:
            same_plan = torch.equal(plan.to(torch.int64), recorded_plan.to(torch.int64))
        same = same_plan and _key(decision) == _key(window.decision)
        report.rows.append(
            {
                "step": window.load.step,
                "engine": _key(window.decision),
                "replay": _key(decision),
                "same": same,
            }
        )
    return report


def _key(decision: dict | None) -> tuple | None:
    if decision is None:
        return None
    return (decision.get("action"), decision.get("candidate"), decision.get("reason"))
