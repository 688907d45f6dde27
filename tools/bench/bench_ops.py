"""Benchmark the routing op ``torch.ops.eplb_graph.map_and_record`` on CPU.

Usage::

    python tools/bench/bench_ops.py [--quick] [--json PATH] [--threads 1 2]

For every torch thread count and every token count T (K=8 choices per token, N=256 logical
experts, P=288 slots = 32 redundant over 8 ranks, hottest experts replicated 2-4 times, skewed
random top-k ids) it times, in one process and interleaved sample by sample so that load from
other processes hits every variant alike:

- ``floor``: a bare ``index_select`` of the T*K int64 ids from an ``[N]`` table (the least any
  table lookup can cost: one dispatch, one gather, one output allocation);
- ``composite``: the upstream-style composite, ``log2phy[ids, (t*K + j) % count[ids]]`` by
  advanced indexing plus ``load.scatter_add_``;
- ``eager``: ``torch.ops.eplb_graph.map_and_record`` (the fused native CPU kernel);
- ``reference``: ``eplb_graph.ops.map_and_record_ref`` called directly (the ATen oracle);
- ``compiled``: ``torch.compile(..., backend="inductor", fullgraph=True, dynamic=False)`` of a
  function calling ``map_and_record`` (compiled and warmed up before timing);
- ``dynamo`` (supplementary): the same function under ``torch.compile(backend="eager")``: only
  Dynamo's frame entry and guards, no AOTAutograd or inductor wrapper;
- ``eager_l16`` / ``compiled_l16`` (supplementary): a function calling ``map_and_record`` once
  for each of 16 MoE layers, eager and compiled as one graph, per op. A one-op compiled region
  pays torch.compile's fixed per-call cost (guards, runtime wrappers) on one op; inside a model
  graph that cost is shared by every op, which is what these two columns show.
- ``compiled_l16_cpp``: the 16-layer graph compiled with ``torch._inductor.config.cpp_wrapper``,
  per op: how a runner should compile (the Python wrapper spends ~1 us per extern call on
  tensor reinterpretation and stride asserts). The "compiled no slower than eager" target is
  judged on this column.

Each sample times a calibrated batch of calls (per-call microseconds); the reported numbers are
the min and median over the samples of a time-bounded run. Targets are checked on the medians.
The script always exits 0: it is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from timing import measure, run_benchmark, write_report

from eplb_graph import EplbState, Placement, ops

TOP_K = 8
NUM_LOGICAL = 256
NUM_REDUNDANT = 32
NUM_RANKS = 8
FULL_TOKENS = (1, 16, 256, 4096, 32768)
QUICK_TOKENS = (1, 256, 4096)
VARIANTS = (
    "floor",
    "composite",
    "eager",
    "reference",
    "compiled",
    "dynamo",
    "eager_l16",
    "compiled_l16",
    "compiled_l16_cpp",
)
LAYERS = 16  # layers in the supplementary in-graph variants

# Targets from the issue.
TARGET_T = 4096
TARGET_OURS_OVER_FLOOR = 3.0  # eager <= 3x floor at T=4096
TARGET_COMPOSITE_OVER_OURS = 5.0  # composite >= 5x eager at T=4096
TARGET_T1_ABOVE_FLOOR_US = 5.0  # eager - floor <= 5 us at T=1
TARGET_COMPILED_OVER_EAGER = 1.0  # compiled <= eager

OP = torch.ops.eplb_graph.map_and_record.default


def expert_popularity(generator: torch.Generator) -> torch.Tensor:
    """Zipf(1) popularity over a random permutation of the experts: ``[N]`` float, sums to 1."""
    weights = 1.0 / torch.arange(1, NUM_LOGICAL + 1, dtype=torch.float64)
    order = torch.randperm(NUM_LOGICAL, generator=generator)
    popularity = torch.empty(NUM_LOGICAL, dtype=torch.float64)
    popularity[order] = weights / weights.sum()
    return popularity


def skewed_placement(popularity: torch.Tensor) -> Placement:
    """One layer; each rank holds 32 experts plus 4 redundant slots given to the hottest experts.

    The hottest expert gets 3 extra slots (4 replicas), the next 3 get 2 extra (3 replicas) and
    the next 23 get one (2 replicas): 3 + 6 + 23 = 32 redundant slots.
    """
    hottest = torch.argsort(popularity, descending=True).tolist()
    extra = [hottest[0]] * 3 + [e for e in hottest[1:4] for _ in range(2)] + hottest[4:27]
    assert len(extra) == NUM_REDUNDANT
    per_rank_primary = NUM_LOGICAL // NUM_RANKS
    per_rank_extra = NUM_REDUNDANT // NUM_RANKS
    row: list[int] = []
    for rank in range(NUM_RANKS):
        row.extend(range(rank * per_rank_primary, (rank + 1) * per_rank_primary))
        # Round-robin so the replicas of one expert land on different ranks.
        row.extend(extra[rank + NUM_RANKS * j] for j in range(per_rank_extra))
    return Placement(torch.tensor([row]), NUM_LOGICAL, NUM_RANKS)


def skewed_topk(popularity: torch.Tensor, tokens: int, generator: torch.Generator) -> torch.Tensor:
    """``[T, K]`` int64 distinct expert ids per row, drawn by popularity."""
    probs = popularity.to(torch.float32).expand(tokens, NUM_LOGICAL)
    return torch.multinomial(probs, TOP_K, replacement=False, generator=generator)


def composite(ids, log2phy, count, load):
    """Upstream-style rule: replica ``(t*K + j) % count[id]`` by advanced indexing, then count.

    The flat positions and the ones are built per call, as a model's forward would.
    """
    flat = ids.reshape(-1)
    position = torch.arange(flat.numel(), device=flat.device)
    physical = log2phy[flat, position % count[flat]]
    load.scatter_add_(0, physical, torch.ones_like(physical, dtype=load.dtype))
    return physical.view(ids.shape)


def compiled_fn(ids, log2phy, count, offset, load, num_valid, record):
    return ops.map_and_record(ids, log2phy, count, offset, load, num_valid, record)


def fresh_code(fn):
    """A copy of ``fn`` with its own code object.

    Dynamo caches compiled graphs per code object: two ``torch.compile`` wrappers of the same
    function (different backends or configs) share one cache, and each call then evaluates the
    other entries' guards first. Every compiled variant gets its own code to be timed alone.
    """
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_FRESH_IDS)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


_FRESH_IDS = itertools.count()


def routed_variant(state: EplbState) -> torch.nn.Module:
    """A ``RoutedLayers`` whose ``forward`` has its own code object (see :func:`fresh_code`)."""
    cls = type(
        "RoutedLayersVariant", (RoutedLayers,), {"forward": fresh_code(RoutedLayers.forward)}
    )
    return cls(state)


class RoutedLayers(torch.nn.Module):
    """One routing op per MoE layer, reading the EPLB state the way a model does (attributes of
    the model, marked static by EplbState), so the compiled graph holds the tables as static
    inputs rather than per-call arguments. All layers route the same ids."""

    def __init__(self, state: EplbState) -> None:
        super().__init__()
        self.state = state

    def forward(self, ids):
        s = self.state
        return [
            ops.map_and_record(
                ids,
                s.log2phy[i],
                s.replica_count[i],
                s.offset,
                s.load[i],
                s.num_valid_tokens,
                s.record_enabled,
            )
            for i in range(LAYERS)
        ]


def make_inputs(state: EplbState, popularity: torch.Tensor, tokens: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    ids = skewed_topk(popularity, tokens, generator)
    tables = state.layer(0)
    count = tables.replica_count
    return {
        "ids": ids,
        "log2phy": tables.log2phy,
        "count": count,
        "load": tables.load,
        "offset": state.offset,
        "num_valid": state.num_valid_tokens,
        "record": state.record_enabled,
        "floor_table": count.clone(),
    }


def check_layers_agreement(x, routed: RoutedLayers, compiled_layers) -> None:
    """The 16-layer graph gives the eager op's slots and counts in every layer."""
    load = routed.state.load
    load.zero_()
    eager = routed(x["ids"])
    eager_load = load.clone()
    load.zero_()
    compiled = compiled_layers(x["ids"])
    same = all(torch.equal(a, b) for a, b in zip(eager, compiled, strict=True))
    if not (same and torch.equal(eager_load, load)):
        raise AssertionError("eager and compiled 16-layer functions disagree")


def check_agreement(x, compiled) -> None:
    """Eager, compiled and the reference produce the same slots and the same load counts."""
    args = (x["ids"], x["log2phy"], x["count"], x["offset"])
    loads = [torch.zeros_like(x["load"]) for _ in range(3)]
    outs = [
        OP(*args, loads[0], x["num_valid"], x["record"]),
        ops.map_and_record_ref(*args, loads[1], x["num_valid"], x["record"]),
        compiled(*args, loads[2], x["num_valid"], x["record"]),
    ]
    for name, out, load in zip(("reference", "compiled"), outs[1:], loads[1:], strict=True):
        if not (torch.equal(outs[0], out) and torch.equal(loads[0], load)):
            raise AssertionError(f"eager and {name} disagree")


def bench_one(
    x, compiled, dynamo, routed: RoutedLayers, compiled_layers, compiled_layers_cpp, quick: bool
):
    ids, log2phy, count, load = x["ids"], x["log2phy"], x["count"], x["load"]
    offset, num_valid, record = x["offset"], x["num_valid"], x["record"]
    flat = ids.reshape(-1)
    table = x["floor_table"]
    reference = ops.map_and_record_ref
    fns: dict[str, Callable[[], object]] = {
        "floor": lambda: table.index_select(0, flat),
        "composite": lambda: composite(ids, log2phy, count, load),
        "eager": lambda: OP(ids, log2phy, count, offset, load, num_valid, record),
        "reference": lambda: reference(ids, log2phy, count, offset, load, num_valid, record),
        "compiled": lambda: compiled(ids, log2phy, count, offset, load, num_valid, record),
        "dynamo": lambda: dynamo(ids, log2phy, count, offset, load, num_valid, record),
        "eager_l16": lambda: routed(ids),
        "compiled_l16": lambda: compiled_layers(ids),
        "compiled_l16_cpp": lambda: compiled_layers_cpp(ids),
    }
    budget = 0.06 if quick else 0.2
    cells = measure(fns, budget_s=budget, sample_s=budget / 40, min_samples=5)
    for name in ("eager_l16", "compiled_l16", "compiled_l16_cpp"):  # per op
        for stat in ("min_us", "median_us"):
            cells[name][stat] /= LAYERS
    return cells


def fmt(value: float) -> str:
    return f"{value:9.2f}" if value < 1e4 else f"{value:9.0f}"


def print_table(threads: int, rows: dict[int, dict[str, dict[str, float]]]) -> None:
    for stat in ("median_us", "min_us"):
        print(f"\n== torch threads = {threads}: per-call {stat[:-3]} in us (l16: per op) ==")
        print(f"{'T':>6} " + " ".join(f"{v:>12}" for v in VARIANTS))
        for tokens, cells in rows.items():
            print(f"{tokens:>6} " + " ".join(f"{fmt(cells[v][stat]):>12}" for v in VARIANTS))
    print(f"\n== torch threads = {threads}: ratios of medians [of mins] ==")
    columns = (
        ("eager/floor", "ours_over_floor"),
        ("composite/eager", "composite_over_ours"),
        ("compiled/eager", "compiled_over_eager"),
        ("dynamo-eager us", "dynamo_minus_eager_us"),
        ("l16 comp/eager", "l16_compiled_over_eager"),
        ("l16 cpp/eager", "l16_cpp_compiled_over_eager"),
        ("reference/eager", "reference_over_ours"),
        ("eager-floor us", "ours_minus_floor_us"),
    )
    print(f"{'T':>6} " + " ".join(f"{title:>17}" for title, _ in columns))
    for tokens, cells in rows.items():
        r = ratios(cells)
        print(
            f"{tokens:>6} "
            + " ".join(f"{r[key]:8.2f} [{r[key + '_min']:6.2f}]" for _, key in columns)
        )


def ratios(cells: dict[str, dict[str, float]]) -> dict[str, float]:
    out = {}
    for stat, suffix in (("median_us", ""), ("min_us", "_min")):
        ours = cells["eager"][stat]
        out[f"ours_over_floor{suffix}"] = ours / cells["floor"][stat]
        out[f"composite_over_ours{suffix}"] = cells["composite"][stat] / ours
        out[f"compiled_over_eager{suffix}"] = cells["compiled"][stat] / ours
        out[f"reference_over_ours{suffix}"] = cells["reference"][stat] / ours
        out[f"ours_minus_floor_us{suffix}"] = ours - cells["floor"][stat]
        out[f"dynamo_minus_eager_us{suffix}"] = cells["dynamo"][stat] - ours
        out[f"l16_compiled_over_eager{suffix}"] = (
            cells["compiled_l16"][stat] / cells["eager_l16"][stat]
        )
        out[f"l16_cpp_compiled_over_eager{suffix}"] = (
            cells["compiled_l16_cpp"][stat] / cells["eager_l16"][stat]
        )
    return out


def evaluate_targets(threads: int, rows: dict[int, dict[str, dict[str, float]]]) -> list[dict]:
    results = []

    def add(name: str, value: float, target: str, ok: bool) -> None:
        results.append(
            {"threads": threads, "target": name, "value": value, "goal": target, "pass": ok}
        )

    if TARGET_T in rows:
        r = ratios(rows[TARGET_T])
        add(
            f"T={TARGET_T} eager/floor",
            r["ours_over_floor"],
            f"<= {TARGET_OURS_OVER_FLOOR}",
            r["ours_over_floor"] <= TARGET_OURS_OVER_FLOOR,
        )
        add(
            f"T={TARGET_T} composite/eager",
            r["composite_over_ours"],
            f">= {TARGET_COMPOSITE_OVER_OURS}",
            r["composite_over_ours"] >= TARGET_COMPOSITE_OVER_OURS,
        )
    if 1 in rows:
        r = ratios(rows[1])
        add(
            "T=1 eager - floor (us)",
            r["ours_minus_floor_us"],
            f"<= {TARGET_T1_ABOVE_FLOOR_US}",
            r["ours_minus_floor_us"] <= TARGET_T1_ABOVE_FLOOR_US,
        )
    # "Compiled no slower than eager" is judged where a runner pays it: per op inside a compiled
    # model graph, with inductor's C++ wrapper (the Python wrapper adds ~1 us of tensor
    # reinterpretation per extern call). The one-op compiled region (informational) mostly
    # measures Dynamo's fixed per-call cost, which a model amortizes over all its layers.
    for tokens, cells in rows.items():
        r = ratios(cells)
        add(
            f"T={tokens} in-graph compiled (cpp_wrapper)/eager",
            r["l16_cpp_compiled_over_eager"],
            f"<= {TARGET_COMPILED_OVER_EAGER}",
            r["l16_cpp_compiled_over_eager"] <= TARGET_COMPILED_OVER_EAGER,
        )
    for tokens, cells in rows.items():
        r = ratios(cells)
        add(
            f"T={tokens} in-graph compiled (python wrapper)/eager (info)",
            r["l16_compiled_over_eager"],
            f"<= {TARGET_COMPILED_OVER_EAGER}",
            r["l16_compiled_over_eager"] <= TARGET_COMPILED_OVER_EAGER,
        )
        add(
            f"T={tokens} one-op compiled region/eager (info)",
            r["compiled_over_eager"],
            f"<= {TARGET_COMPILED_OVER_EAGER}",
            r["compiled_over_eager"] <= TARGET_COMPILED_OVER_EAGER,
        )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T in {1, 256, 4096}, short cells")
    parser.add_argument("--json", type=Path, help="write the raw results here")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args(argv)

    ops.native.ensure_loaded()
    status = ops.native.status()
    assert status is ops.native.NativeStatus.LOADED, (
        f"native CPU kernel not loaded ({status}): {ops.native.failure_reason()}"
    )
    token_counts = QUICK_TOKENS if args.quick else FULL_TOKENS
    popularity = expert_popularity(torch.Generator().manual_seed(0))
    placement = skewed_placement(popularity)
    state = EplbState(placement)
    layers = EplbState(
        Placement(placement.phy2log.expand(LAYERS, -1).clone(), NUM_LOGICAL, NUM_RANKS)
    )
    routed = RoutedLayers(layers)
    replicas = placement.replica_count()[0]
    print(
        f"torch {torch.__version__}, native kernel {status.value}, cpu_count {os.cpu_count()}, "
        f"N={NUM_LOGICAL} P={placement.num_slots} R={state.max_replicas} K={TOP_K}, "
        f"replicas per expert: {torch.bincount(replicas).tolist()} (index = replica count)"
    )

    report: dict = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "native_status": status.value,
        "quick": args.quick,
        "threads": args.threads,
        "shape": {
            "K": TOP_K,
            "N": NUM_LOGICAL,
            "P": placement.num_slots,
            "R": state.max_replicas,
            "ranks": NUM_RANKS,
            "layers_in_l16_graph": LAYERS,
            "index_dtype": str(state.log2phy.dtype),
            "load_dtype": str(state.load.dtype),
        },
        "results": {},
        "targets": [],
    }
    started = time.perf_counter()
    for threads in args.threads:
        torch.set_num_threads(threads)
        rows: dict[int, dict[str, dict[str, float]]] = {}
        for tokens in token_counts:
            state.set_step_inputs_(tokens, record=True)
            layers.set_step_inputs_(tokens, record=True)
            x = make_inputs(state, popularity, tokens, seed=tokens)
            torch._dynamo.reset()
            compiled = torch.compile(
                fresh_code(compiled_fn), backend="inductor", fullgraph=True, dynamic=False
            )
            check_agreement(x, compiled)  # also compiles and warms up
            for _ in range(3):
                compiled(
                    x["ids"], x["log2phy"], x["count"], x["offset"], x["load"], x["num_valid"],
                    x["record"],
                )  # fmt: skip
            compiled_layers = torch.compile(
                routed_variant(layers), backend="inductor", fullgraph=True, dynamic=False
            )
            check_layers_agreement(x, routed, compiled_layers)
            with torch._inductor.config.patch(cpp_wrapper=True):
                compiled_layers_cpp = torch.compile(
                    routed_variant(layers), backend="inductor", fullgraph=True, dynamic=False
                )
                check_layers_agreement(x, routed, compiled_layers_cpp)
            dynamo = torch.compile(
                fresh_code(compiled_fn), backend="eager", fullgraph=True, dynamic=False
            )
            check_agreement(x, dynamo)
            rows[tokens] = bench_one(
                x, compiled, dynamo, routed, compiled_layers, compiled_layers_cpp, args.quick
            )
            state.reset_load_()
            layers.reset_load_()
        print_table(threads, rows)
        report["results"][str(threads)] = {
            str(t): {"cells": cells, "ratios": ratios(cells)} for t, cells in rows.items()
        }
        report["targets"].extend(evaluate_targets(threads, rows))

    print("\n== targets (medians) ==")
    for target in report["targets"]:
        verdict = "PASS" if target["pass"] else "MISS"
        print(
            f"{verdict}  threads={target['threads']}  {target['target']:<36}"
            f" {target['value']:8.2f}  (goal {target['goal']})"
        )
    report["elapsed_s"] = time.perf_counter() - started
    write_report(args.json, report)
    return 0


if __name__ == "__main__":
    run_benchmark(main)
