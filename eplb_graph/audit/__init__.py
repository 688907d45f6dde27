"""Graph-safety audit: graph breaks, host syncs, recompiles and unstable EPLB state.

``run_audit(fn, example_args, eplb_state)`` returns an :class:`AuditReport`; the CLI
(``eplb-graph audit``), ``tools/graph_audit.py`` and ``eplb_graph.testing.assert_graph_safe`` are
thin layers over it. See ``docs/testing.md`` for the checks and their blind spots.
"""

from __future__ import annotations

from eplb_graph.lazy_exports import lazy_exports

DEFAULT_TARGET = "eplb_graph.models:audit_target"
"""The audit's default TARGET, the project's TinyMoE (here, so the CLI's parser needs no torch)."""

_PUBLIC = {
    "CHECKS": "eplb_graph.audit.checks",
    "KINDS": "eplb_graph.audit.findings",
    "Finding": "eplb_graph.audit.findings",
    "alternative_placement": "eplb_graph.audit.placements",
    "alternative_placements": "eplb_graph.audit.placements",
    "SCHEMA_VERSION": "eplb_graph.audit.report",
    "AuditReport": "eplb_graph.audit.report",
    "CheckResult": "eplb_graph.audit.report",
    "TargetRaised": "eplb_graph.audit.runner",
    "run_audit": "eplb_graph.audit.runner",
    "register_op_body": "eplb_graph.audit.sync_ops",
    "AuditTarget": "eplb_graph.audit.target",
    "TargetError": "eplb_graph.audit.target",
    "load_target": "eplb_graph.audit.target",
}
__all__ = sorted([*_PUBLIC, "DEFAULT_TARGET"])
__getattr__, __dir__ = lazy_exports(__name__, globals(), _PUBLIC)
