"""Audit results: the per-check outcome, the human table and the stable JSON schema.

The JSON schema is a contract with CI scripts (``schema_version`` bumps on any breaking change):

.. code-block:: text

    {
      "schema_version": 1,
      "target": "<module:callable or a description>",
      "clean": true | false,
      "checks": [{"name": str, "status": "ran" | "skipped", "note": str, "findings": int}, ...],
      "findings": [{"kind": str, "check": str, "message": str, "location": "file:line",
                    "detail": str}, ...]
    }

Locations are shown relative to ``root`` (the working directory by default) when they lie under
it, so reports compare across checkouts; nothing volatile (timings, addresses, ids) is included.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from eplb_graph.audit.findings import Finding, sort_key
from eplb_graph.audit.hints import hints_for

SCHEMA_VERSION = 1

#: The note of every check that needs an EPLB state when none was given.
NO_STATE = "skipped: no EPLB state given (eplb_state is None), so there is nothing to commit"


@dataclass
class CheckResult:
    """One check's outcome. ``status`` is ``"ran"`` or ``"skipped"`` (a skip is not a failure)."""

    name: str
    status: str
    note: str
    findings: list[Finding] = field(default_factory=list)

    def __post_init__(self) -> None:
        unique: dict[tuple, Finding] = {}
        for finding in self.findings:
            unique.setdefault((finding.kind, finding.location, finding.message), finding)
        self.findings = sorted(unique.values(), key=sort_key)


@dataclass
class AuditReport:
    target: str
    checks: list[CheckResult]

    @property
    def findings(self) -> list[Finding]:
        return [finding for check in self.checks for finding in check.findings]

    @property
    def clean(self) -> bool:
        return not self.findings

    def relative_to(self, root: str | os.PathLike) -> AuditReport:
        """A copy with locations (and paths in details) relative to ``root``."""
        prefix = os.path.realpath(root) + os.sep
        checks = []
        for check in self.checks:
            findings = []
            for finding in check.findings:
                moved = finding.relative_to(root)
                findings.append(
                    Finding(
                        moved.kind,
                        moved.check,
                        moved.message,
                        moved.location,
                        moved.detail.replace(prefix, ""),
                    )
                )
            checks.append(CheckResult(check.name, check.status, check.note, findings))
        return AuditReport(self.target, checks)

    def as_dict(self, root: str | os.PathLike | None = None) -> dict:
        report = self.relative_to(os.getcwd() if root is None else root)
        return {
            "schema_version": SCHEMA_VERSION,
            "target": report.target,
            "clean": report.clean,
            "checks": [
                {
                    "name": check.name,
                    "status": check.status,
                    "note": check.note,
                    "findings": len(check.findings),
                }
                for check in report.checks
            ],
            "findings": [finding.as_dict() for finding in report.findings],
        }

    def to_json(self, root: str | os.PathLike | None = None) -> str:
        return json.dumps(self.as_dict(root), indent=2, sort_keys=True) + "\n"

    def render_text(self, root: str | os.PathLike | None = None) -> str:
        """The human report: checks with their notes, a findings table, and how to fix them
        (the shared advice of ``eplb_graph.audit.hints``) where a finding has a known fix."""
        report = self.relative_to(os.getcwd() if root is None else root)
        lines = [f"graph audit of {report.target}", "", "checks:"]
        name_width = max(len(check.name) for check in report.checks)
        for check in report.checks:
            lines.append(f"  {check.name:<{name_width}}  {check.status:<7}  {check.note}")
        lines.append("")
        findings = report.findings
        if not findings:
            lines.append("no findings: graph-safe")
            return "\n".join(lines) + "\n"
        rows = [("KIND", "LOCATION", "MESSAGE")] + [
            (finding.kind, finding.location, finding.message) for finding in findings
        ]
        kind_width = max(len(row[0]) for row in rows)
        location_width = max(len(row[1]) for row in rows)
        for index, (kind, location, message) in enumerate(rows):
            lines.append(f"{kind:<{kind_width}}  {location:<{location_width}}  {message}")
            if index and findings[index - 1].detail:
                pad = " " * (kind_width + location_width + 4)
                lines.append(f"{pad}-> {findings[index - 1].detail}")
        lines.append("")
        count = len(findings)
        lines.append(f"{count} finding{'s' if count != 1 else ''}: not graph-safe")
        hints = hints_for([f"{finding.message}\n{finding.detail}" for finding in findings])
        if hints:
            lines += ["", "how to fix:"]
            for hint in hints:
                first, *rest = hint.splitlines()
                lines += [f"- {first}", *(f"  {line}" for line in rest)]
        return "\n".join(lines) + "\n"
