"""Capture regression kit: drive a routed callable through a graph mode, commit placements in
place, replay, and assert nothing recompiled or re-captured and routing followed the commit.

Downstream model runners call :func:`capture_commit_replay` on their own model; our own suite
uses it for the tiny MoE. Graph modes:

- ``"compile:<backend>"`` — ``torch.compile(fullgraph=True)`` with that backend (``eager``,
  ``aot_eager``, ``inductor``, ...), replayed under ``set_stance("fail_on_recompile")``;
- ``"cuda_graph"`` — a raw ``torch.cuda.CUDAGraph`` capture;
- ``"npu_graph"`` — a raw ``torch.npu.NPUGraph`` capture (torch_npu).

- ``"auto"`` — what the machine and the state's device have: CUDA graphs for a CUDA state,
  NPU graphs for an NPU state, else ``compile:inductor``.

A mode the kit does not know (``inductr``, ``compile:inductr``) is refused up front with
:class:`UnknownGraphModeError` naming the valid ones, before anything is compiled or committed;
left to torch, a backend typo surfaces only at the first call, as its ``InvalidBackend``.

Every check compares the graph against an eager run of the same callable on the same state:
outputs equal (within ``atol``), load deltas equal exactly, and the EPLB tensors' ``data_ptr``
unchanged. The eager run must also read the live EPLB tables: graph and eager agree perfectly
when both route through a private copy of the lookup, so the eager run is watched by the audit's
live-table probe (``eplb_graph.audit.live_tables``) and a copy fails the replay.

:func:`assert_graph_safe` runs the static audit (``eplb_graph.audit``) and fails with every
finding listed; the pytest plugin (``eplb_graph.pytest_plugin``, auto-loaded through the
``pytest11`` entry point) wraps both as fixtures. ``docs/testing.md`` has a worked example.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import os
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch

from eplb_graph.audit.hints import (
    explain_capture_failure,
    explain_compile_failure,
    explain_recompile,
)
from eplb_graph.errors import EplbError
from eplb_graph.placement import Placement
from eplb_graph.state import EplbState

DEVICE_GRAPH_MODES = ("cuda_graph", "npu_graph")
#: Every mode the kit knows, whether or not this machine can run it (for parametrizing).
ALL_GRAPH_MODES = ("compile:eager", "compile:aot_eager", "compile:inductor", *DEVICE_GRAPH_MODES)


class GraphRegressionError(EplbError, AssertionError):
    """A graph recompiled, re-captured, moved an EPLB tensor, or disagreed with eager."""


class GraphBreakError(GraphRegressionError):
    """The callable does not compile or capture as one graph, so there is nothing to replay.

    ``torch_error`` keeps torch's own exception (Dynamo's or the device's) for whoever needs
    its full text; the message itself is the cause, the user's line and how to fix it.
    """

    def __init__(self, message: str, torch_error: BaseException) -> None:
        super().__init__(message)
        self.torch_error = torch_error


class KitArgumentError(EplbError, ValueError):
    """An argument the kit cannot use: an unknown graph mode or finding kind."""


class UnknownGraphModeError(KitArgumentError):
    """A graph mode the kit does not know, such as a typo in a backend name."""


class GraphModeUnavailableError(EplbError, RuntimeError):
    """A known graph mode that this machine cannot run (no CUDA device, no torch_npu...)."""


class GraphSafetyError(EplbError, AssertionError):
    """The audit found graph-safety defects; the message is the full findings table."""

    def __init__(self, message: str, report) -> None:
        super().__init__(message)
        self.report = report


def assert_graph_safe(
    fn: Callable,
    example_args: Sequence,
    eplb_state: EplbState | None = None,
    *,
    ignore_kinds: Collection[str] = (),
    checks: Sequence[str] | None = None,
    root: str | os.PathLike | None = None,
):
    """Audit ``fn(*example_args)`` and raise :class:`GraphSafetyError` listing every finding.

    Args:
        fn: the routed callable or module.
        example_args: arguments of one representative call.
        eplb_state: the EPLB state ``fn`` reads; ``None`` skips the commit/toggle checks.
        ignore_kinds: finding kinds to tolerate (e.g. ``{"graph_break"}`` while a known break
            is being fixed); they still appear in the returned report.
        checks: subset of ``eplb_graph.audit.CHECKS`` to run (default: all).
        root: paths in the message are shown relative to it (default: the working directory).

    Returns:
        The :class:`~eplb_graph.audit.AuditReport` when no unignored finding remains.

    Raises:
        GraphSafetyError: listing every finding, with how to fix the ones the audit knows.
        KitArgumentError: ``ignore_kinds`` names a kind the audit does not have.
    """
    __tracebackhide__ = True  # pytest shows the caller's line, not the kit's frames
    from eplb_graph.audit import KINDS, run_audit

    unknown = sorted(set(ignore_kinds) - set(KINDS))
    if unknown:
        raise KitArgumentError(
            f"unknown finding kinds {unknown} in ignore_kinds; expected some of {list(KINDS)}"
        )
    report = run_audit(fn, example_args, eplb_state, checks=checks)
    failing = [finding for finding in report.findings if finding.kind not in ignore_kinds]
    if failing:
        text = report.render_text(root)
        raise GraphSafetyError(
            f"{len(failing)} graph-safety finding(s) in {report.target}:\n{text}", report
        )
    return report


@dataclass(frozen=True)
class StepInputs:
    """Per-call knobs toggled between replays (all written in place into the state)."""

    num_valid_tokens: int
    record: bool = True
    offset_advance: int = 1


@dataclass
class ReplayReport:
    mode: str
    commits: int = 0
    replays: int = 0
    max_abs_diff: float = 0.0
    unique_graphs: int | None = None
    notes: list[str] = field(default_factory=list)


def _compile_backends() -> list[str]:
    """Every backend name ``torch.compile`` accepts here, debug and registered ones included."""
    return torch.compiler.list_backends(exclude_tags=())


def check_graph_mode(mode: str) -> str:
    """``mode`` unchanged when the kit knows it, else :class:`UnknownGraphModeError`.

    Known: ``auto``, every mode of :data:`ALL_GRAPH_MODES`, and ``compile:<backend>`` for any
    backend ``torch.compile`` has (``torch.compiler.list_backends(exclude_tags=())``, which
    includes backends registered by the user's code before the check).
    """
    known = ("auto", *ALL_GRAPH_MODES)
    if mode in known:
        return mode
    backends = _compile_backends()
    prefix, sep, backend = mode.partition(":")
    if prefix == "compile" and sep and backend in backends:
        return mode
    # Whole modes first ("cuda-graph"), then a bare backend name ("inductr" -> its compile mode).
    modes = [*known, *(f"compile:{name}" for name in backends)]
    close = difflib.get_close_matches(mode, modes, n=1, cutoff=0.75)
    bare = backend if sep else mode
    close = close or [f"compile:{name}" for name in difflib.get_close_matches(bare, backends, n=1)]
    suggestion = f"did you mean {close[0]!r}? " if close else ""
    what = f"torch.compile has no backend {backend!r}" if prefix == "compile" and sep else ""
    raise UnknownGraphModeError(
        f"unknown graph mode {mode!r}{f' ({what})' if what else ''}; {suggestion}valid modes: "
        f"{', '.join(known)}, or compile:<backend> for another torch.compile backend "
        f"(torch.compiler.list_backends(): {', '.join(torch.compiler.list_backends())})"
    )


def graph_mode_skip_reason(mode: str) -> str | None:
    """``None`` when ``mode`` can run on this machine, else a human-readable reason.

    Raises:
        UnknownGraphModeError: for a mode the kit does not know (see :func:`check_graph_mode`).
    """
    check_graph_mode(mode)
    if mode == "auto" or mode.startswith("compile:"):
        return None
    if mode == "cuda_graph":
        if not torch.cuda.is_available():
            return "CUDA graphs need a CUDA device; torch.cuda.is_available() is False"
        return None
    if mode == "npu_graph":
        if importlib.util.find_spec("torch_npu") is None:
            return "NPU graphs need torch_npu (with CANN); it is not installed"
        try:
            importlib.import_module("torch_npu")
        except Exception as error:
            return f"torch_npu is installed but does not import: {error}"
        if not torch.npu.is_available():  # type: ignore[attr-defined]
            return "torch_npu imports but no NPU device is available"
    return None


def graph_mode_device(mode: str) -> str:
    """The device (a string, ``torch.device``-compatible) to build the model and state on.

    Device graphs capture their own device (``"cuda"``/``"npu"``; a string because ``"npu"``
    only parses once torch_npu is imported); compile modes run on CUDA where present, else CPU.
    """
    if mode == "cuda_graph":
        return "cuda"
    if mode == "npu_graph":
        return "npu"
    check_graph_mode(mode)
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_graph_mode(mode: str, state: EplbState) -> str:
    """Turn ``"auto"`` into the mode the state's device supports here; other modes unchanged.

    A device graph captures the device the tensors live on, so the choice follows the state:
    a CUDA state with CUDA present gets ``cuda_graph``, an NPU state with torch_npu gets
    ``npu_graph``, anything else ``compile:inductor``.
    """
    if check_graph_mode(mode) != "auto":
        return mode
    device_type = str(state.device).split(":", 1)[0]  # "npu" is no torch.device without torch_npu
    device_mode = {"cuda": "cuda_graph", "npu": "npu_graph"}.get(device_type)
    if device_mode is not None and graph_mode_skip_reason(device_mode) is None:
        return device_mode
    return "compile:inductor"


def available_graph_modes() -> list[str]:
    """Modes this machine can drive: compile backends always; device graphs where present."""
    modes = ["compile:eager", "compile:aot_eager", "compile:inductor"]
    return modes + [mode for mode in DEVICE_GRAPH_MODES if graph_mode_skip_reason(mode) is None]


def _device_graph_api(mode: str):
    if mode == "cuda_graph":
        return torch.cuda, torch.cuda.CUDAGraph
    torch_npu = importlib.import_module("torch_npu")  # noqa: F841  (registers torch.npu)
    return torch.npu, torch.npu.NPUGraph  # type: ignore[attr-defined]


def _as_tuple(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def _compare(label: str, got, expected, atol: float) -> float:
    __tracebackhide__ = True
    worst = 0.0
    for index, (a, b) in enumerate(zip(_as_tuple(got), _as_tuple(expected), strict=True)):
        if not isinstance(a, torch.Tensor):
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            raise GraphRegressionError(
                f"{label}: output {index} is {tuple(a.shape)}/{a.dtype}, eager gives "
                f"{tuple(b.shape)}/{b.dtype}"
            )
        if a.is_floating_point():
            delta = (a.detach().float() - b.detach().float()).abs()
            diff = float(delta.max()) if a.numel() else 0.0
            if diff > atol:
                raise GraphRegressionError(f"{label}: output {index} differs by {diff} > {atol}")
            worst = max(worst, diff)
        elif not torch.equal(a, b):
            raise GraphRegressionError(f"{label}: integer output {index} differs from eager")
    return worst


class _Harness:
    """Runs one graph call and the eager oracle from the same state; compares both."""

    def __init__(self, fn: Callable, state: EplbState, atol: float) -> None:
        self.fn = fn
        self.state = state
        self.atol = atol
        self.pointers = state.data_ptrs()

    def check_pointers(self, label: str) -> None:
        __tracebackhide__ = True
        now = self.state.data_ptrs()
        moved = sorted(name for name, ptr in now.items() if self.pointers[name] != ptr)
        if moved:
            raise GraphRegressionError(f"{label}: EPLB tensors changed address: {moved}")

    def eager_reading_live_tables(self, label: str, args) -> object:
        """The eager oracle's output; raises if it routed through a copy of the EPLB tables."""
        __tracebackhide__ = True
        from eplb_graph.audit.findings import relative_location
        from eplb_graph.audit.live_tables import LiveTableProbe

        probe = LiveTableProbe(self.state.graph_tensors())
        with probe:
            expected = self.fn(*args)
        problems = probe.result.problems()
        if problems:
            lines = [
                f"  {message}"
                + (f" (at {relative_location(location, os.getcwd())})" if location else "")
                for message, location, _hint in problems
            ]
            hints = dict.fromkeys(f"  fix: {hint}" for _message, _location, hint in problems)
            raise GraphRegressionError(
                f"{label}: routing reads a copy of the EPLB tables, so commits never reach it "
                "(graph and eager then agree while both are wrong):\n" + "\n".join([*lines, *hints])
            )
        return expected

    def run_and_compare(self, label: str, run_graph: Callable[[str], object], args) -> float:
        __tracebackhide__ = True
        load_before = self.state.load.clone()
        got = run_graph(label)
        got = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in _as_tuple(got))
        graph_delta = self.state.load - load_before
        self.state.load.copy_(load_before)
        expected = self.eager_reading_live_tables(label, args)
        eager_delta = self.state.load - load_before
        if not torch.equal(graph_delta, eager_delta):
            raise GraphRegressionError(f"{label}: recorded load differs from eager")
        self.check_pointers(label)
        return _compare(label, got, expected, self.atol)


def capture_commit_replay(
    fn: Callable,
    example_args: Sequence,
    state: EplbState,
    placements: Sequence[Placement] | None = None,
    *,
    mode: str = "auto",
    step_inputs: Sequence[StepInputs] | None = None,
    atol: float = 1e-5,
) -> ReplayReport:
    """Capture/compile ``fn``, then for each placement: commit in place, toggle step inputs,
    replay, and compare with eager.

    Args:
        fn: the routed callable; it must read routing only from ``state``'s tensors.
        example_args: tensors passed on every call (device graphs replay on these addresses).
        state: the EPLB state ``fn`` reads; commits go through ``state.commit_``.
        placements: placements to commit one after another (each must differ to be meaningful);
            ``None`` commits three generated valid placements, each different from the last.
        mode: see the module docstring (default ``"auto"``).
        step_inputs: knobs cycled over the calls (valid-token count, record flag, offset step).
        atol: tolerance for floating outputs (compiled kernels may reassociate sums).

    Raises:
        GraphBreakError: ``fn`` does not compile or capture as one graph (a
            :class:`GraphRegressionError` naming the cause, the user's line and the fix).
        GraphRegressionError: on a recompile/re-capture, moved EPLB tensor, eager mismatch, or
            routing through a copy of the EPLB tables (commits never reach it).
        UnknownGraphModeError: for a mode the kit does not know, before anything runs.
        GraphModeUnavailableError: if ``mode`` cannot run here (a ``RuntimeError``; see
            :func:`graph_mode_skip_reason`).
    """
    __tracebackhide__ = True
    mode = resolve_graph_mode(mode, state)
    reason = graph_mode_skip_reason(mode)
    if reason is not None:
        raise GraphModeUnavailableError(f"graph mode {mode} unavailable: {reason}")
    if placements is None:
        from eplb_graph.audit.placements import alternative_placements

        placements = alternative_placements(state.placement, 3)
    args = tuple(example_args)
    knobs = list(step_inputs or [StepInputs(num_valid_tokens=_rows(args))])
    harness = _Harness(fn, state, atol)
    report = ReplayReport(mode=mode)

    if mode.startswith("compile:"):
        run_graph, finish = _compiled_runner(fn, args, mode.split(":", 1)[1], report)
    else:
        run_graph, finish = _device_graph_runner(fn, args, mode, state, knobs[0])

    try:
        for index, placement in enumerate(placements):
            state.commit_(placement)
            report.commits += 1
            for step, knob in enumerate(knobs):
                state.set_step_inputs_(knob.num_valid_tokens, knob.record)
                state.advance_offset_(knob.offset_advance)
                label = f"{mode} commit {index} step {step}"
                diff = harness.run_and_compare(label, run_graph, args)
                report.max_abs_diff = max(report.max_abs_diff, diff)
                report.replays += 1
    finally:
        finish()
    return report


def _rows(args: tuple) -> int:
    first = next((a for a in args if isinstance(a, torch.Tensor) and a.dim() > 0), None)
    return 0 if first is None else int(first.shape[0])


def _describe(fn: Callable) -> str:
    return getattr(fn, "__qualname__", type(fn).__qualname__)


def _compiled_runner(fn, args, backend: str, report: ReplayReport):
    __tracebackhide__ = True
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    try:
        compiled(*args)  # first call compiles; later calls must hit the same graph
    except torch._dynamo.exc.Unsupported as error:
        message = explain_compile_failure(f"compile:{backend}", _describe(fn), error)
        raise GraphBreakError(message, error) from None
    graphs_after_warmup = counters["stats"]["unique_graphs"]

    def run(label: str):
        __tracebackhide__ = True
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                return compiled(*args)
        except RuntimeError as error:
            message = explain_recompile(label, error)
            if message is None:
                raise
            raise GraphRegressionError(message) from None

    def finish():
        __tracebackhide__ = True
        report.unique_graphs = counters["stats"]["unique_graphs"]
        if report.unique_graphs != graphs_after_warmup:
            raise GraphRegressionError(
                f"compile:{backend}: {report.unique_graphs - graphs_after_warmup} new graphs "
                "after warm-up"
            )

    return run, finish


def _device_graph_runner(fn, args, mode: str, state: EplbState, knob: StepInputs):
    __tracebackhide__ = True
    device_module, graph_class = _device_graph_api(mode)
    state.set_step_inputs_(knob.num_valid_tokens, knob.record)
    load_before = state.load.clone()
    side = device_module.Stream()
    side.wait_stream(device_module.current_stream())
    with device_module.stream(side):
        for _ in range(2):  # warm-up: lazy init, workspaces, allocator
            fn(*args)
    device_module.current_stream().wait_stream(side)
    graph = graph_class()
    try:
        with device_module.graph(graph):
            static_out = fn(*args)
    except RuntimeError as error:  # the eager warm-up ran, so the capture itself refused fn
        raise GraphBreakError(explain_capture_failure(mode, _describe(fn), error), error) from None
    device_module.synchronize()
    state.load.copy_(load_before)  # warm-up and capture must not count as executed load

    def run(label: str):
        __tracebackhide__ = True
        graph.replay()
        device_module.synchronize()
        return static_out

    return run, lambda: None
