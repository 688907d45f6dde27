"""Capture, compile, load-recording and host-sync checks of :class:`RoutedMoELayer`.

Every check follows one pattern: build the graph once, then for each placement commit it in
place (tables and slot weights), change the per-step inputs, run the graph, and compare with an
eager call of the same layer on the same state. The graph's recorded load is compared as a
delta and then undone, so the eager call starts from the same counters.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import torch

from device_checks.layer import (
    LayerShape,
    RoutedMoELayer,
    build_layer,
    example_hidden,
    placements,
    step_knobs,
)

logger = logging.getLogger(__name__)

COMMITS = 6
LOAD_REPLAYS = 8


def _watched_pointers(layer: RoutedMoELayer) -> dict[str, int]:
    pointers = dict(layer.state.data_ptrs())
    pointers.update(w13=layer.w13.data_ptr(), w2=layer.w2.data_ptr())
    return pointers


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _sync_debug_error(device: torch.device):
    """Make any host sync inside the block raise (CUDA only; a no-op elsewhere)."""
    if device.type != "cuda":
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


class _Comparison:
    """Runs one graph step and the eager oracle from the same state, and keeps the worst case."""

    def __init__(self, layer: RoutedMoELayer, hidden: torch.Tensor, bitwise: bool) -> None:
        self.layer, self.hidden, self.bitwise = layer, hidden, bitwise
        self.steps = 0
        self.mismatches: list[str] = []
        self.max_abs_diff = 0.0

    def step(self, label: str, run_graph: Callable[[], tuple[torch.Tensor, torch.Tensor]]):
        state = self.layer.state
        load_before = state.load.clone()
        out, physical = (t.clone() for t in run_graph())
        graph_delta = state.load - load_before
        state.load.copy_(load_before)
        eager_out, eager_physical = self.layer(self.hidden)
        eager_delta = state.load - load_before
        self.steps += 1
        diff = float((out.float() - eager_out.float()).abs().max())
        self.max_abs_diff = max(self.max_abs_diff, diff)
        if not torch.equal(physical, eager_physical):
            self.mismatches.append(f"{label}: physical ids differ from eager")
        if not torch.equal(graph_delta, eager_delta):
            self.mismatches.append(f"{label}: recorded load differs from eager")
        equal = torch.equal(out, eager_out) if self.bitwise else diff <= 1e-4
        if not equal:
            self.mismatches.append(f"{label}: output differs from eager by {diff:.3g}")


def _commit_and_step(
    layer: RoutedMoELayer,
    comparison: _Comparison,
    run_graph: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    shape: LayerShape,
) -> list[int]:
    """Commit ``COMMITS`` placements in place, each followed by every step knob; returns the
    number of slots whose weights moved at each commit."""
    moved = []
    for index, placement in enumerate(placements(shape, COMMITS)):
        layer.state.commit_(placement)
        moved.append(layer.install_weights_())
        for step, knob in enumerate(step_knobs(shape)):
            layer.state.set_step_inputs_(knob.valid_tokens, knob.record)
            layer.state.advance_offset_(knob.offset_advance)
            comparison.step(f"commit {index} step {step}", run_graph)
    return moved


def _captured(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """``fn`` captured once in a ``torch.cuda.CUDAGraph`` (after a warm-up on a side stream);
    returns what replays it and gives the graph's static outputs. Elsewhere ``fn`` itself: the
    dry run walks the same commit-and-compare loop on eager calls."""
    if device.type != "cuda":
        return fn
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # lazy init, cuBLAS workspaces, allocator pools
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fn()
    torch.cuda.synchronize()

    def replay():
        graph.replay()
        return static_out

    replay.graph = graph  # type: ignore[attr-defined]  (keeps the graph alive with its replay)
    return replay


def _applies(device: torch.device, why: str) -> dict:
    """``ok`` is decided by the caller on CUDA; on other devices the section is a dry run."""
    return {} if device.type == "cuda" else {"ok": None, "why": why, "dry_run": True}


def raw_cuda_graph(device: torch.device, shape: LayerShape) -> dict:
    """``torch.cuda.CUDAGraph`` captured once, replayed across in-place commits: every replay
    equals eager bit for bit, addresses never change, replays never sync the host."""
    layer = build_layer(shape, device)
    hidden = example_hidden(shape, device)
    pointers = _watched_pointers(layer)
    load_before = layer.state.load.clone()
    replay = _captured(lambda: layer(hidden), device)
    layer.state.load.copy_(load_before)  # warm-up ran the layer; it is not served load
    sync_errors: list[str] = []

    def checked_replay():
        try:
            with _sync_debug_error(device):
                out = replay()
        except RuntimeError as error:  # a sync inside the replay path
            sync_errors.append(str(error).splitlines()[0])
            out = layer(hidden)
        _sync(device)
        return out

    comparison = _Comparison(layer, hidden, bitwise=True)
    moved = _commit_and_step(layer, comparison, checked_replay, shape)
    moved_pointers = sorted(k for k, v in _watched_pointers(layer).items() if pointers[k] != v)
    return {
        "ok": not comparison.mismatches and not moved_pointers and not sync_errors,
        "captures": 1,
        "commits": COMMITS,
        "slots_moved_per_commit": moved,
        "replays": comparison.steps,
        "bitwise_equal_to_eager": not comparison.mismatches,
        "max_abs_diff": comparison.max_abs_diff,
        "addresses_stable": not moved_pointers,
        "moved_addresses": moved_pointers,
        "host_syncs_in_replay": sync_errors,
        "mismatches": comparison.mismatches[:10],
        **_applies(device, "CUDA graphs need a CUDA device"),
    }


def load_in_graph(device: torch.device, shape: LayerShape) -> dict:
    """Load counted inside a captured graph over ``LOAD_REPLAYS`` replays with padding rows
    equals the eager counts of as many eager calls, and excludes the padding."""
    valid = shape.tokens * 3 // 4
    counts = {}
    for kind in ("eager", "graph"):
        layer = build_layer(shape, device)
        layer.state.commit_(placements(shape, 1, seed=5)[0])
        layer.install_weights_()
        hidden = example_hidden(shape, device)
        layer.state.set_step_inputs_(valid, True)
        run: Callable[[], object] = lambda layer=layer, hidden=hidden: layer(hidden)  # noqa: E731
        if kind == "graph":
            run = _captured(run, device)
        layer.state.reset_load_()
        for _ in range(LOAD_REPLAYS):
            run()
            layer.state.advance_offset_(1)
        _sync(device)
        counts[kind] = layer.state.load[0].cpu()
    expected_total = LOAD_REPLAYS * valid * shape.top_k
    equal = torch.equal(counts["graph"], counts["eager"])
    total = int(counts["graph"].sum())
    return {
        "ok": equal and total == expected_total,
        "replays": LOAD_REPLAYS,
        "valid_rows_per_step": valid,
        "padding_rows_per_step": shape.tokens - valid,
        "counts_equal_to_eager": equal,
        "total_counted": total,
        "expected_total": expected_total,
        **_applies(device, "CUDA graphs need a CUDA device"),
    }


def _cudagraph_skips() -> int:
    from torch._dynamo.utils import counters

    return int(sum(counters["inductor"].get(k, 0) for k in ("cudagraph_skips",)))


def compiled(device: torch.device, shape: LayerShape, mode: str | None) -> dict:
    """``torch.compile(fullgraph=True)`` with inductor (``mode=None``) or CUDA graph trees
    (``mode="reduce-overhead"``): 0 graph breaks, 0 recompiles across in-place commits, outputs
    equal to eager (routing and load exactly, hidden states within 1e-4)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    layer = build_layer(shape, device)
    hidden = example_hidden(shape, device)
    explanation = torch._dynamo.explain(layer)(hidden)
    breaks = [str(reason.reason) for reason in explanation.break_reasons]
    torch._dynamo.reset()
    counters.clear()
    started = time.perf_counter()
    module = torch.compile(layer, fullgraph=True, mode=mode)

    def call():
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        return module(hidden)

    load_before = layer.state.load.clone()
    for _ in range(3):  # compile, then (graph trees) warm up and record
        call()
    _sync(device)
    layer.state.load.copy_(load_before)
    compile_s = time.perf_counter() - started
    graphs_after_warmup = counters["stats"]["unique_graphs"]
    recompile_errors: list[str] = []

    def run():
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                return call()
        except RuntimeError as error:
            recompile_errors.append(str(error).splitlines()[0])
            return layer(hidden)

    comparison = _Comparison(layer, hidden, bitwise=False)
    pointers = _watched_pointers(layer)
    _commit_and_step(layer, comparison, run, shape)
    moved_pointers = sorted(k for k, v in _watched_pointers(layer).items() if pointers[k] != v)
    recompiles = counters["stats"]["unique_graphs"] - graphs_after_warmup + len(recompile_errors)
    cudagraph_skips = _cudagraph_skips()
    uses_cudagraphs = mode == "reduce-overhead" and device.type == "cuda"
    ok = (
        explanation.graph_count == 1
        and not breaks
        and recompiles == 0
        and not comparison.mismatches
        and not moved_pointers
        and (cudagraph_skips == 0 or not uses_cudagraphs)
    )
    result = {
        "ok": ok,
        "mode": mode or "default",
        "graphs": explanation.graph_count,
        "graph_breaks": len(breaks),
        "break_reasons": breaks,
        "recompiles": recompiles,
        "recompile_errors": recompile_errors,
        "commits": COMMITS,
        "calls": comparison.steps,
        "max_abs_diff": comparison.max_abs_diff,
        "addresses_stable": not moved_pointers,
        "mismatches": comparison.mismatches[:10],
        "compile_s": round(compile_s, 1),
    }
    if mode == "reduce-overhead":
        result["cudagraph_skips"] = cudagraph_skips
        result["cudagraphs_apply"] = uses_cudagraphs
        result["cudagraph_counters"] = {
            k: v for k, v in counters["inductor"].items() if "cudagraph" in k
        }
    torch._dynamo.reset()
    return result


def host_syncs(device: torch.device, shape: LayerShape) -> dict:
    """The routing op and the whole layer, eager and inductor-compiled, under
    ``set_sync_debug_mode("error")``: a device-to-host sync anywhere raises."""
    layer = build_layer(shape, device)
    hidden = example_hidden(shape, device)
    state = layer.state
    ids = torch.randint(0, shape.num_experts, (shape.tokens, shape.top_k), device=device)
    from eplb_graph.ops import map_and_record

    def op_alone():
        return map_and_record(
            ids,
            state.log2phy[0],
            state.replica_count[0],
            state.offset,
            state.load[0],
            state.num_valid_tokens,
            state.record_enabled,
        )

    torch._dynamo.reset()
    compiled_layer = torch.compile(layer, fullgraph=True)
    compiled_layer(hidden)  # compile outside the checked block: compiling may sync
    op_alone()
    layer(hidden)
    _sync(device)
    results = {}
    for name, fn in (
        ("map_and_record eager", op_alone),
        ("layer eager", lambda: layer(hidden)),
        ("layer compiled (inductor)", lambda: compiled_layer(hidden)),
    ):
        try:
            with _sync_debug_error(device):
                for _ in range(3):
                    fn()
            results[name] = "no sync"
        except RuntimeError as error:
            results[name] = f"sync: {str(error).splitlines()[0]}"
        _sync(device)
    torch._dynamo.reset()
    return {
        "ok": all(v == "no sync" for v in results.values()),
        "paths": results,
        **_applies(device, "sync debug mode is CUDA's"),
    }
