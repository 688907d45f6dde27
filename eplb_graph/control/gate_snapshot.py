"""The payback gate's state as plain values: what the metrics files publish after each window.

Kept apart from the gate so the gate reads as the decision alone; the document is rebuilt once
per decision, and the metrics writer's thread reads it as it is (nothing in it is shared).
"""

from __future__ import annotations

from typing import Any

__all__ = ["gate_snapshot"]

LAST_DECISION_KEYS = ("step", "action", "reason", "candidate")
"""What the top level of the metrics says of the last decision (the rest is in ``decisions``)."""


def gate_snapshot(gate: Any) -> dict[str, Any]:
    """The model, the counts, the recent decisions and moves, the model's accuracy, of ``gate``
    (a :class:`~eplb_graph.control.payback.PaybackGate`: not imported, which would be a
    circle)."""
    repaid, measured = gate.ledger.repaid()
    last = gate.last_decision
    return {
        "model": gate.model.as_dict() if gate.model is not None else None,
        "predicted_rank_ms": gate.predicted_rank_ms,
        "measured_rank_ms": gate.measured_rank_ms,
        "accuracy": list(gate.accuracy),
        "copy_ms": gate.copy_us / 1e3 if gate.model is not None else None,
        "copy_ms_source": gate.copy_source,
        **gate.counts,
        "last_decision": None
        if last is None
        else {key: last[key] for key in LAST_DECISION_KEYS if key in last},
        "decisions": list(gate.decisions),
        "moves": gate.ledger.figures(),
        "moves_repaid": repaid,
        "moves_measured": measured,
    }
