"""The audit checks, one function each, sharing one :class:`AuditContext`.

Order matters only through the context: the graph-break and fullgraph checks each compile the
target from scratch (``torch._dynamo.reset()``), then the capture session (see
``eplb_graph.audit.capture``) compiles it once more and is reused by every later check, which
keeps the audit of a small model to a few seconds.

Known blind spots are listed in ``docs/testing.md`` ("What the audit cannot see").
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import torch

from eplb_graph.audit.capture import CaptureSession, StepOutcome, run_step
from eplb_graph.audit.findings import (
    Finding,
    location_from_stack,
    location_from_text,
    location_of_callable,
)
from eplb_graph.audit.hints import PYTHON_VALUE_FIX, summarize_dynamo_message
from eplb_graph.audit.live_tables import live_tables
from eplb_graph.audit.placements import alternative_placement
from eplb_graph.audit.report import NO_STATE, CheckResult
from eplb_graph.audit.sync_ops import (
    audit_op_body,
    classify_node,
    is_custom_op,
    mutable_target,
    op_body,
)


@dataclass
class AuditContext:
    """Everything the checks share: the target, its eager op calls, and the capture session."""

    fn: Callable
    args: tuple
    state: object | None
    eager_op_calls: dict = field(default_factory=dict)
    explain_breaks: int = 0

    @cached_property
    def fallback_location(self) -> str:
        return location_of_callable(self.fn)

    @cached_property
    def session(self) -> CaptureSession:
        torch._dynamo.reset()
        session = CaptureSession(self.fn, self.args, self.state)
        try:
            session.call()
        except Exception as error:
            session.error = error
        return session

    @cached_property
    def steps(self) -> list[StepOutcome]:
        """Commit a different placement, then toggle the record flag, valid count and offset."""
        state = self.state
        session = self.session
        if state is None or session.error is not None:
            return []
        valid = int(state.num_valid_tokens.item())
        record = bool(state.record_enabled.item())
        other_valid = valid - 1 if valid > 0 else 1
        plan: list[tuple[str, Callable[[], None]]] = []
        placement = alternative_placement(state.placement)
        if placement is not None:
            plan.append(("commit", lambda: state.commit_(placement)))
        plan += [
            ("record flag", lambda: state.set_step_inputs_(valid, not record)),
            ("valid-token count", lambda: state.set_step_inputs_(other_valid, not record)),
            ("offset", lambda: state.advance_offset_(1)),
        ]
        return [run_step(session, name, mutate) for name, mutate in plan]

    def step_method_location(self, step: str) -> str:
        """Where the state method a step called is defined (when no finer line is known)."""
        method = {"commit": "commit_", "offset": "advance_offset_"}.get(step, "set_step_inputs_")
        return location_of_callable(getattr(type(self.state), method))


def _state_skip(ctx: AuditContext, name: str) -> CheckResult | None:
    if ctx.state is None:
        return CheckResult(name, "skipped", NO_STATE)
    if ctx.session.error is not None:
        return CheckResult(name, "skipped", "skipped: the audit's compile of the target failed")
    return None


# -- graph breaks -----------------------------------------------------------------------------


class _BreakEvents(logging.Handler):
    """Collects Dynamo's structured ``dynamo_graph_break_reason`` artifacts.

    ``explain()`` drops some break reasons (a ``Tensor.item()`` inside an inlined call leaves
    ``break_reasons`` empty in torch 2.13) and its own break log is silenced under ``explain``;
    the structured artifact is emitted for every break and carries the user traceback.
    """

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.payloads: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        metadata = getattr(record, "metadata", None)
        artifact = metadata.get("artifact") if isinstance(metadata, dict) else None
        if isinstance(artifact, dict) and artifact.get("name") == "dynamo_graph_break_reason":
            self.payloads.append(str(getattr(record, "payload", "")))


def _parse_break_payload(payload: str) -> tuple[str, str, str | None]:
    reason_text = payload.split("Graph Break Reason:", 1)[-1]
    reason_text = reason_text.split("User code traceback:", 1)[0]
    reason, explanation = summarize_dynamo_message(reason_text)
    traceback_text = payload.split("User code traceback:", 1)[-1]
    traceback_text = traceback_text.split("Traceback (most recent call last)", 1)[0]
    location = location_from_text(traceback_text)
    if location is None:
        match = re.search(r"Graph break in user code at (\S+:\d+)", payload)
        location = match.group(1) if match else None
    return reason, explanation, location


def graph_breaks(ctx: AuditContext) -> CheckResult:
    """Graph breaks and their reasons, from ``torch._dynamo.explain`` and Dynamo's break events."""
    events = _BreakEvents()
    trace_log = logging.getLogger("torch.__trace")
    trace_log.addHandler(events)
    try:
        explanation = torch._dynamo.explain(ctx.fn)(*ctx.args)
    except Exception as error:
        reason, explanation_line = summarize_dynamo_message(str(error) or type(error).__name__)
        location = location_from_stack(getattr(error, "real_stack", None))
        finding = Finding(
            "compile_error",
            "graph_breaks",
            f"torch._dynamo.explain failed: {reason}",
            location or ctx.fallback_location,
            explanation_line,
        )
        return CheckResult("graph_breaks", "ran", "explain() raised", [finding])
    finally:
        trace_log.removeHandler(events)
    findings = []
    for payload in events.payloads:
        reason, detail, location = _parse_break_payload(payload)
        findings.append(
            Finding(
                "graph_break",
                "graph_breaks",
                f"graph break: {reason}",
                location or ctx.fallback_location,
                detail,
            )
        )
    located = {finding.location for finding in findings}
    for item in explanation.break_reasons:
        location = location_from_stack(item.user_stack) or ctx.fallback_location
        if location in located:
            continue
        reason, detail = summarize_dynamo_message(item.reason)
        findings.append(Finding("graph_break", "graph_breaks", f"graph break: {reason}", location))
    if explanation.graph_count > 1 and not findings:
        findings.append(
            Finding(
                "graph_break",
                "graph_breaks",
                f"{explanation.graph_count} graphs but no break reason was reported",
                ctx.fallback_location,
            )
        )
    ctx.explain_breaks = explanation.graph_break_count
    note = (
        f"explain(): {explanation.graph_count} graph(s), {explanation.graph_break_count} break(s)"
    )
    return CheckResult("graph_breaks", "ran", note, findings)


# -- fullgraph --------------------------------------------------------------------------------


def _passthrough(gm: torch.fx.GraphModule, example_inputs):
    return gm.forward


def fullgraph(ctx: AuditContext) -> CheckResult:
    """Whether ``torch.compile(fullgraph=True)`` (default config) compiles and runs the target."""
    torch._dynamo.reset()
    try:
        torch.compile(ctx.fn, backend=_passthrough, fullgraph=True)(*ctx.args)
    except Exception as error:
        reason = getattr(error, "gb_type", None)
        text = str(error) or type(error).__name__
        summary, explanation = summarize_dynamo_message(text)
        location = location_from_stack(getattr(error, "real_stack", None))
        finding = Finding(
            "fullgraph_failed",
            "fullgraph",
            f"torch.compile(fullgraph=True) fails: {reason or summary}",
            location or ctx.fallback_location,
            explanation,
        )
        return CheckResult("fullgraph", "ran", "torch.compile(fullgraph=True) failed", [finding])
    finally:
        torch._dynamo.reset()
    note = "torch.compile(fullgraph=True) succeeded"
    if ctx.explain_breaks:
        # fullgraph=True can trace through what breaks a default compile (torch 2.13 captures a
        # .item() as a graph scalar, a host sync the host_syncs check reports); serving compiles
        # without fullgraph, so the default compile's breaks are what a runner gets.
        note += (
            f"; explain() saw {ctx.explain_breaks} break(s): trusting explain() (reported as "
            "findings), because fullgraph=True may trace through a break that a default compile, "
            "the one serving uses, takes"
        )
    return CheckResult("fullgraph", "ran", note)


# -- host syncs and dynamic shapes ------------------------------------------------------------


def host_syncs(ctx: AuditContext) -> CheckResult:
    """Host syncs and data-dependent shapes in the ATen graph, and inside custom-op bodies."""
    session = ctx.session
    findings: list[Finding] = []
    error = session.error
    if error is not None:
        summary, detail = summarize_dynamo_message(str(error) or type(error).__name__)
        location = location_from_stack(getattr(error, "real_stack", None))
        findings.append(
            Finding(
                "compile_error",
                "host_syncs",
                f"the audit's capture compile failed: {summary}",
                location or ctx.fallback_location,
                detail,
            )
        )
    custom_sites: dict = {}
    for record in session.graphs:
        if record.aot_error is not None:
            summary, _ = summarize_dynamo_message(
                str(record.aot_error) or type(record.aot_error).__name__
            )
            findings.append(
                Finding(
                    "compile_error",
                    "host_syncs",
                    f"AOTAutograd could not build the ATen graph: {summary}",
                    ctx.fallback_location,
                )
            )
        for graph in record.aten_graphs:
            for node in graph.graph.nodes:
                if node.op != "call_function":
                    continue
                location = location_from_text(node.meta.get("stack_trace"))
                location = location or ctx.fallback_location
                found = classify_node(node)
                if found is not None:
                    findings.append(Finding(found[0], "host_syncs", found[1], location))
                target = mutable_target(node)
                if is_custom_op(target):
                    custom_sites.setdefault(target, location)
    audited, opaque = [], []
    for op, location in custom_sites.items():
        body = op_body(op)
        call = ctx.eager_op_calls.get(op)
        if body is None or call is None:
            opaque.append(op._schema.name)
            continue
        audited.append(op._schema.name)
        for hit in audit_op_body(body, *call):
            findings.append(
                Finding(
                    hit.kind,
                    "host_syncs",
                    f"{hit.why}, inside the body of {op._schema.name}",
                    location,
                    f"op body line: {hit.body_location}",
                )
            )
    graphs = len(session.aten_graphs)
    note = f"walked {graphs} ATen graph(s); op bodies audited: {', '.join(sorted(audited)) or '-'}"
    if opaque:
        note += f"; opaque (no Python body known): {', '.join(sorted(opaque))}"
    return CheckResult("host_syncs", "ran", note, findings)


# -- commit and toggle checks -----------------------------------------------------------------

_GUARD_EXPRESSION = re.compile(r"^\s*-?\s*(?:\d+/\d+:\s*)?(?P<expr>.*?)(?:\s{2,}#.*)?$")
_TENSOR_GUARD = re.compile(
    r"^tensor |check_tensor|size mismatch|stride mismatch|dtype mismatch|device mismatch"
    r"|\.size\(\)|\.stride\(\)|storage_offset|requires_grad mismatch|dispatch key"
)


def _parse_guard_failure(reason: str) -> tuple[str, str | None]:
    first = reason.strip().splitlines()[0] if reason.strip() else reason
    match = _GUARD_EXPRESSION.match(first)
    expression = match.group("expr").strip() if match else first.strip()
    return expression, location_from_text(reason)


def _step_names(outcomes: list[StepOutcome]) -> str:
    return ", ".join(outcome.name for outcome in outcomes)


def recompiles(ctx: AuditContext) -> CheckResult:
    """New graphs after a commit in place or a toggle of record flag, valid count, offset."""
    skip = _state_skip(ctx, "recompiles")
    if skip is not None:
        return skip
    findings = []
    new_graphs = 0
    for outcome in ctx.steps:
        if outcome.error is not None:
            findings.append(
                Finding(
                    "compile_error",
                    "recompiles",
                    f"the compiled target raised after {outcome.name}: {outcome.error}",
                    ctx.fallback_location,
                )
            )
        new_graphs += outcome.new_graphs
        if not outcome.new_graphs:
            continue
        if not outcome.guard_failures:
            findings.append(
                Finding(
                    "recompile",
                    "recompiles",
                    f"{outcome.new_graphs} new graph(s) after {outcome.name}",
                    ctx.fallback_location,
                )
            )
        for reason in outcome.guard_failures:
            expression, location = _parse_guard_failure(reason)
            findings.append(
                Finding(
                    "recompile",
                    "recompiles",
                    f"recompiled after {outcome.name}: guard `{expression}` failed",
                    location or ctx.fallback_location,
                )
            )
    note = f"steps: {_step_names(ctx.steps)}; {new_graphs} new graph(s)"
    if not any(outcome.name == "commit" for outcome in ctx.steps):
        note += "; no different valid placement exists, commit not exercised"
    return CheckResult("recompiles", "ran", note, findings)


def static_inputs(ctx: AuditContext) -> CheckResult:
    """Every EPLB tensor a graph reads must be a static input (fixed address, no replay copy)."""
    skip = _state_skip(ctx, "static_inputs")
    if skip is not None:
        return skip
    ctx.steps  # noqa: B018  (graphs compiled during the steps are judged too)
    findings = []
    read: dict[str, None] = {}
    for record in ctx.session.graphs:
        placeholders = [node for node in record.gm.graph.nodes if node.op == "placeholder"]
        for node, example in zip(placeholders, record.example_inputs, strict=False):
            if not isinstance(example, torch.Tensor):
                continue
            name = record.state_storages.get(example.untyped_storage().data_ptr())
            if name is None:
                continue
            read[name] = None
            if node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type") is not None:
                continue
            users = [user.meta.get("stack_trace") for user in node.users]
            location = next(
                (loc for loc in map(location_from_text, users) if loc), ctx.fallback_location
            )
            findings.append(
                Finding(
                    "non_static_input",
                    "static_inputs",
                    f"EPLB tensor `{name}` is not a static graph input "
                    f"(graph compiled at step: {record.step})",
                    location,
                    "cudagraph trees copy non-static inputs on every replay and skip graphs "
                    "that mutate them; mark it with torch._dynamo.mark_static_address",
                )
            )
    order = [name for name in ctx.state.graph_tensors() if name in read]
    note = f"EPLB tensors read by the graph: {', '.join(order) or '-'}"
    return CheckResult("static_inputs", "ran", note, findings)


def addresses(ctx: AuditContext) -> CheckResult:
    """EPLB tensors must keep their ``data_ptr`` across commits and toggles (no rebinding)."""
    skip = _state_skip(ctx, "addresses")
    if skip is not None:
        return skip
    findings = []
    for outcome in ctx.steps:
        for name in outcome.moved:
            location = outcome.rebind_sites.get(name) or ctx.step_method_location(outcome.name)
            findings.append(
                Finding(
                    "address_changed",
                    "addresses",
                    f"EPLB tensor `{name}` changed address after {outcome.name}: captured "
                    "graphs keep reading the old memory",
                    location,
                    "write the new values in place (copy_/fill_) instead of assigning a new tensor",
                )
            )
    count = len(ctx.state.graph_tensors())
    note = f"{count} EPLB tensors compared across: {_step_names(ctx.steps)}"
    return CheckResult("addresses", "ran", note, findings)


def python_values(ctx: AuditContext) -> CheckResult:
    """Routing state read from Python values: a commit or toggle fails a non-tensor guard.

    A guard on a Python value (``EQUALS_MATCH``, ``CONSTANT_MATCH``, dict-content and identity
    guards) that fails after the audit changed the EPLB state means that value *is* routing
    state, frozen into the graph as a constant. Python values the steps leave unchanged (model
    config, the rank) are constants by design and are not reported.
    """
    skip = _state_skip(ctx, "python_values")
    if skip is not None:
        return skip
    findings = []
    for outcome in ctx.steps:
        for reason in outcome.guard_failures:
            expression, location = _parse_guard_failure(reason)
            if _TENSOR_GUARD.search(expression):
                continue
            findings.append(
                Finding(
                    "python_value",
                    "python_values",
                    f"routing state read from a Python value is frozen into the graph: "
                    f"`{expression}` stopped holding after {outcome.name}",
                    location or ctx.fallback_location,
                    PYTHON_VALUE_FIX,
                )
            )
    note = "non-tensor guards checked after: " + _step_names(ctx.steps)
    return CheckResult("python_values", "ran", note, findings)


CHECKS: dict[str, Callable[[AuditContext], CheckResult]] = {
    "graph_breaks": graph_breaks,
    "fullgraph": fullgraph,
    "host_syncs": host_syncs,
    "recompiles": recompiles,
    "static_inputs": static_inputs,
    "addresses": addresses,
    "python_values": python_values,
    "live_tables": live_tables,
}
