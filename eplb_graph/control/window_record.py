"""Every closed window's reduced inputs and the decision made on them, as JSON lines.

Why: a decision of the payback gate is a pure function of the windows it saw (every input is a
sum from the window reduction), so a file of those windows is enough to replay an engine's
decisions offline (``eplb-graph simulate --windows``): to see why EPLB moved or kept still, or
how another setting would have decided on the same traffic. One rank writes it (every rank
decides alike). The first line describes the cluster and the settings; every later line holds
one window: its step, committed placement, logical load per time bucket, executed slot load,
serving feedback (the reduced vector) and the decision (and plan) made on it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eplb_graph.control.feedback import WindowFeedback
from eplb_graph.control.window import WindowLoad

__all__ = ["WINDOWS_FILE", "RecordedWindow", "WindowRecorder", "read_windows"]

WINDOWS_FILE = "windows.jsonl"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class RecordedWindow:
    load: WindowLoad
    decision: dict | None
    plan: torch.Tensor | None


class WindowRecorder:
    """Appends windows to ``path`` (the header first, once)."""

    def __init__(self, path: str | Path, header: dict[str, Any]) -> None:
        self.path = Path(path)
        self.header = {"format_version": FORMAT_VERSION, **header}
        self._started = False

    def write(self, load: WindowLoad, decision: dict | None, plan: torch.Tensor | None) -> None:
        feedback = None if load.feedback is None else load.feedback.to_vector().tolist()
        record = {
            "step": load.step,
            "committed": load.committed.tolist(),
            "logical": load.logical.tolist(),
            "physical": load.physical.tolist(),
            "feedback": feedback,
            "decision": decision,
            "plan": None if plan is None else plan.tolist(),
        }
        mode = "a" if self._started else "w"
        with self.path.open(mode) as file:
            if not self._started:
                file.write(json.dumps(self.header) + "\n")
            file.write(json.dumps(record, default=_plain) + "\n")
        self._started = True


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return float(value)


def read_windows(path: str | Path) -> tuple[dict, list[RecordedWindow]]:
    """``(header, windows)`` of a file :class:`WindowRecorder` wrote.

    Raises:
        ValueError: the file is not such a record (its first line names the defect).
    """
    lines = Path(path).read_text().splitlines()
    if not lines:
        raise ValueError(f"{path}: empty; expected a window record (header line first)")
    header = json.loads(lines[0])
    if not isinstance(header, dict) or header.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: not a window record of format {FORMAT_VERSION}")
    windows = []
    for number, line in enumerate(lines[1:], start=2):
        try:
            record = json.loads(line)
            feedback = record["feedback"]
            load = WindowLoad(
                step=int(record["step"]),
                logical=torch.tensor(record["logical"], dtype=torch.int64),
                physical=torch.tensor(record["physical"], dtype=torch.int64),
                committed=torch.tensor(record["committed"], dtype=torch.int64),
                feedback=None
                if feedback is None
                else WindowFeedback.parse(torch.tensor(feedback, dtype=torch.int64)),
            )
            plan = record["plan"]
            windows.append(
                RecordedWindow(
                    load, record["decision"], None if plan is None else torch.tensor(plan)
                )
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{path}:{number}: not a window: {error}") from None
    return header, windows
