"""Speed of ``map_and_record`` against the floor and the upstream-style composite.

Same workload as ``tools/bench/bench_ops.py`` (N=256 experts, P=288 slots over 8 ranks, K=8,
Zipf-skewed ids, hottest experts replicated): its placement, ids and composite are imported from
there, so the two tables measure the same thing on two devices.

- ``floor``: a bare ``index_select`` of the ids from an ``[N]`` table;
- ``composite``: ``log2phy[ids, position % count[ids]]`` plus ``load.scatter_add_``;
- ``ours``: ``torch.ops.eplb_graph.map_and_record`` (on CUDA the Triton kernel, one launch);
- ``reference``: the ATen reference the op had on CUDA before it (``map_and_record_ref``);
- ``compiled`` (CUDA only): ``map_and_record`` under ``torch.compile(fullgraph=True)``, which
  inductor decomposes into the reference and fuses (Triton), as a compiled model runs it.

On CUDA each is timed eagerly (CUDA events around a loop of calls) and inside a captured graph
holding ``GRAPH_CALLS`` back-to-back calls (one per MoE layer of a model graph), per call. On
a machine without CUDA the eager columns are timed with the wall clock (the dry run).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench_ops import (
    composite,
    expert_popularity,
    skewed_placement,
    skewed_topk,
)

from eplb_graph import EplbState
from eplb_graph.ops import map_and_record, map_and_record_ref

CUDA_TOKENS = (1, 16, 256, 4096, 32768)
CPU_TOKENS = (1, 256)
GRAPH_CALLS = 16
SAMPLES = 5


def _variants(tokens: int, device: torch.device) -> dict[str, Callable[[], object]]:
    generator = torch.Generator().manual_seed(tokens)
    popularity = expert_popularity(generator)
    state = EplbState(skewed_placement(popularity), device=device)
    state.set_step_inputs_(tokens, True)
    ids = skewed_topk(popularity, tokens, generator).to(device)
    table = torch.arange(popularity.numel(), device=device)
    log2phy, count, load = state.log2phy[0], state.replica_count[0], state.load[0]
    flat = ids.reshape(-1)
    step = (state.offset, load, state.num_valid_tokens, state.record_enabled)
    variants = {
        "floor": lambda: table.index_select(0, flat),
        "composite": lambda: composite(ids, log2phy, count, load),
        "ours": lambda: map_and_record(ids, log2phy, count, *step),
        "reference": lambda: map_and_record_ref(ids, log2phy, count, *step),
    }
    if device.type == "cuda":
        torch._dynamo.reset()
        compiled = torch.compile(map_and_record, fullgraph=True, dynamic=False)
        variants["compiled"] = lambda: compiled(ids, log2phy, count, *step)
    return variants


def _cuda_us(fn: Callable[[], object], calls: int) -> float:
    """Median over ``SAMPLES`` of the per-call time of ``calls`` back-to-back calls (events)."""
    times = []
    for _ in range(SAMPLES):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    return statistics.median(times)


def _graph_of(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    return graph


def _cpu_us(fn: Callable[[], object], calls: int) -> float:
    times = []
    for _ in range(SAMPLES):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) * 1e6 / calls)
    return statistics.median(times)


def speed_table(device: torch.device, quick: bool = False) -> dict:
    """Per-call microseconds of every variant at every T, eager and (CUDA) in a graph."""
    tokens_list = CPU_TOKENS if device.type != "cuda" or quick else CUDA_TOKENS
    rows = []
    for tokens in tokens_list:
        variants = _variants(tokens, device)
        row: dict[str, float | int] = {"tokens": tokens}
        for name, fn in variants.items():
            fn()  # warm-up
            if device.type == "cuda":
                torch.cuda.synchronize()
                row[f"{name}_eager_us"] = _cuda_us(fn, 50)
                graph = _graph_of(fn)
                row[f"{name}_graph_us"] = _cuda_us(graph.replay, 20) / GRAPH_CALLS
                del graph
            else:
                row[f"{name}_eager_us"] = _cpu_us(fn, 20)
        for where in ("eager", "graph"):
            ours = row.get(f"ours_{where}_us")
            if ours:
                row[f"ours_over_floor_{where}"] = ours / row[f"floor_{where}_us"]
                row[f"composite_over_ours_{where}"] = row[f"composite_{where}_us"] / ours
                row[f"reference_over_ours_{where}"] = row[f"reference_{where}_us"] / ours
        rows.append(row)
    timer = "CUDA events" if device.type == "cuda" else "wall clock"
    return {"ok": True, "timer": timer, "graph_calls": GRAPH_CALLS, "rows": rows}
