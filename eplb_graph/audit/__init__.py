"""Graph-safety audit: graph breaks, host syncs, recompiles and unstable EPLB state.

``run_audit(fn, example_args, eplb_state)`` returns an :class:`AuditReport`; the CLI
(``eplb-graph audit``), ``tools/graph_audit.py`` and ``eplb_graph.testing.assert_graph_safe`` are
thin layers over it. See ``docs/testing.md`` for the checks and their blind spots.
"""

from eplb_graph.audit.checks import CHECKS
from eplb_graph.audit.findings import KINDS, Finding
from eplb_graph.audit.placements import alternative_placement, alternative_placements
from eplb_graph.audit.report import SCHEMA_VERSION, AuditReport, CheckResult
from eplb_graph.audit.runner import TargetRaised, run_audit
from eplb_graph.audit.sync_ops import register_op_body
from eplb_graph.audit.target import DEFAULT_TARGET, AuditTarget, TargetError, load_target

__all__ = [
    "CHECKS",
    "DEFAULT_TARGET",
    "KINDS",
    "SCHEMA_VERSION",
    "AuditReport",
    "AuditTarget",
    "CheckResult",
    "Finding",
    "TargetError",
    "TargetRaised",
    "alternative_placement",
    "alternative_placements",
    "load_target",
    "register_op_body",
    "run_audit",
]
