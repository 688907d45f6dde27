"""How to fix what the audit and the capture regression kit find, written once.

A user meets the same defect in two places: as a finding in the audit report (``eplb-graph
audit``, ``assert_graph_safe``) and as the error of a failed replay (``capture_commit_replay``).
Both take their advice from here, so the two never give different fixes for one cause.

The advice is chosen from the text torch and the audit use for a defect (finding messages,
Dynamo's break reasons), because that text is all a failed compile leaves behind.
"""

from __future__ import annotations

import os
import re

from eplb_graph.audit.findings import location_from_stack, location_from_text, relative_location

#: Graph-safe expert dispatch: every shape fixed by the batch, never by the routing values.
#: ``tests/test_audit.py`` runs this code through the audit, so the advice stays graph-safe.
DISPATCH_EXAMPLE = """\
flat = physical_ids.reshape(-1)  # [tokens * top_k]; -1: no slot
weights = expert_weights.index_select(0, flat.clamp_min(0))  # gather, not x[ids == e]
out = torch.bmm(x.repeat_interleave(top_k, 0).unsqueeze(1), weights).squeeze(1)
out = out * gates.reshape(-1, 1)
out = torch.where((flat >= 0).unsqueeze(-1), out, 0.0)  # zero the -1 rows: mask, not filter
token = torch.arange(x.shape[0], device=x.device).repeat_interleave(top_k)
y = torch.zeros_like(x).scatter_add_(0, token.unsqueeze(-1).expand_as(out), out)
"""

DYNAMIC_SHAPE_HINT = (
    "nonzero, one-argument torch.where(mask) and boolean-mask indexing (x[mask]) give a shape\n"
    "that depends on the routing: the host waits for the device (a captured graph cannot) and\n"
    "every new count is a new graph. Dispatch on fixed shapes instead: gather each (token,\n"
    "choice) row's expert with index_select, compute every row, zero the rows that must not\n"
    "count with three-argument torch.where (or multiply by a mask), and combine with\n"
    "scatter_add_ / index_add_:\n"
    + "".join(f"    {line}\n" for line in DISPATCH_EXAMPLE.splitlines())
).rstrip("\n")

HOST_VALUE_HINT = (
    "a Python value read from a device tensor (.item(), .tolist(), `if tensor:`) stops the\n"
    "graph on the host and freezes that value into it. Keep it on the device: pass the tensor\n"
    "itself on (the eplb_graph ops take num_valid_tokens and record_enabled as tensors), and\n"
    "replace a branch on a tensor with torch.where(condition, a, b) or arithmetic on a mask."
)

CAPTURE_HINT = (
    "a device graph cannot capture a host sync. The usual causes in routing are .item() or\n"
    "a branch on a tensor, and nonzero, torch.where(mask) or x[mask] in the expert dispatch;\n"
    "`eplb_graph.testing.assert_graph_safe(fn, args, state)` names the line of each and shows\n"
    "how to dispatch on fixed shapes instead."
)


def audit_pointer(torch_logs: str) -> str:
    """Where a failing kit check sends the user for the whole story, line by line."""
    return (
        "every finding with its line: eplb_graph.testing.assert_graph_safe(fn, args, state) or "
        f"`eplb-graph audit module:target`; torch's own account: TORCH_LOGS={torch_logs}"
    )


#: The fix of routing state kept in a Python value (the graph froze it and guards on it).
PYTHON_VALUE_FIX = "keep it in a device tensor of the EPLB state and update it in place"

_DYNAMIC_SHAPE = re.compile(
    r"nonzero|boolean mask|dynamic shape operator|data-dependent output shape"
    r"|data-dependent symbol|output shape depends on input",
    re.IGNORECASE,
)
_HOST_VALUE = re.compile(
    r"\.item\(\)|_local_scalar_dense|tolist|data-dependent branching|is_nonzero"
    r"|reads a device value on the host|generic_jump|jump on a tensor",
    re.IGNORECASE,
)


def hint_for_text(text: str) -> str | None:
    """The hint for a defect described by ``text`` (a finding or a Dynamo reason), or ``None``.

    Shapes first: a boolean mask's message also says "host" (the mask's ``nonzero`` syncs), and
    its fix is the fixed-shape dispatch, not keeping a scalar on the device.
    """
    if _DYNAMIC_SHAPE.search(text):
        return DYNAMIC_SHAPE_HINT
    if _HOST_VALUE.search(text):
        return HOST_VALUE_HINT
    return None


def hints_for(texts: list[str]) -> list[str]:
    """The distinct hints for several defects, in the order they first apply."""
    found: dict[str, None] = {}
    for text in texts:
        hint = hint_for_text(text)
        if hint is not None:
            found[hint] = None
    return list(found)


def summarize_dynamo_message(text: str) -> tuple[str, str]:
    """``(reason, explanation)`` from a Dynamo break message (first meaningful line of each)."""
    body, _, _ = text.partition("Explanation:")
    lines = [line.strip() for line in body.splitlines() if line.strip()]
    reason = lines[0] if lines else text.strip()
    if reason.endswith(":") and len(lines) > 1:
        reason = lines[1]  # skip wrappers such as "Encountered graph break when ...:"
    explanation = ""
    if "Explanation:" in text:
        explanation = text.split("Explanation:", 1)[1].strip().splitlines()[0].strip()
    return reason, explanation


def _where(location: str | None) -> str:
    return f" at {relative_location(location, os.getcwd())}" if location else ""


def _labelled(label: str, text: str) -> list[str]:
    first, *rest = text.splitlines()
    return [f"  {label}: {first}", *(f"    {line}" for line in rest)]


def explain_compile_failure(mode: str, name: str, error: BaseException) -> str:
    """The kit's account of a ``fullgraph=True`` compile that failed: cause, line, fix.

    Dynamo's own message runs to dozens of lines of internals; the user needs the reason, the
    line of their code and what to write instead.
    """
    text = str(error) or type(error).__name__
    reason, explanation = summarize_dynamo_message(text)
    location = location_from_stack(getattr(error, "real_stack", None))
    lines = [
        f"{mode}: {name} does not compile as one graph (torch.compile(fullgraph=True)), so "
        f"there is nothing to replay: {reason}{_where(location)}"
    ]
    if explanation:
        lines.append(f"  {explanation}")
    hint = hint_for_text(f"{reason}\n{explanation}")
    if hint is not None:
        lines += _labelled("fix", hint)
    lines.append(f"  {audit_pointer('graph_breaks')}")
    return "\n".join(lines)


_RECOMPILE = "Detected recompile when torch.compile stance"
_GUARD_LINE = re.compile(r"^\s*-\s*(?:\d+/\d+:\s*)?(?P<guard>.*?)(?:\s{2,}#.*)?$")


def explain_recompile(label: str, error: BaseException) -> str | None:
    """The kit's account of a replay refused by ``fail_on_recompile``; ``None`` for any other
    error (torch raises a plain ``RuntimeError`` for both)."""
    text = str(error)
    if not text.startswith(_RECOMPILE):
        return None
    failures = text.split("guard failure(s):", 1)[-1].splitlines()
    match = next(filter(None, map(_GUARD_LINE.match, failures[:2])), None)
    guard = f"guard `{match['guard']}` failed" if match else "a guard failed"
    return "\n".join(
        [
            f"{label}: recompiled: the commit or step toggle changed a value the graph guards "
            f"on, so a captured graph would replay the old routing: {guard}"
            f"{_where(location_from_text(text))}",
            f"  fix: if that value is routing state, {PYTHON_VALUE_FIX}",
            f"  {audit_pointer('recompiles')}",
        ]
    )


def explain_capture_failure(mode: str, name: str, error: BaseException) -> str:
    """The kit's account of a device-graph capture that failed (the eager warm-up ran)."""
    first = (str(error) or type(error).__name__).strip().splitlines()[0]
    return "\n".join(
        [
            f"{mode}: {name} cannot be captured, so there is nothing to replay: {first}",
            *_labelled("fix", CAPTURE_HINT),
            f"  {audit_pointer('graph_breaks')}",
        ]
    )
