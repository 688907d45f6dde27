"""Benchmark ``eplb_graph.policy.rebalance_experts`` against the plain-Python reference.

Usage::

    python tools/bench/bench_policy.py [--quick] [--json PATH] [--threads 1 2]

Configurations (from ``shared/research/anchor_numbers.md``):

- ``A1/hierarchical``: 58 layers x 256 experts, P = 320 slots, 64 ranks on 8 nodes, 8 groups;
- ``A1/global``: the same model with ``num_groups = num_nodes = 1`` (upstream's "global");
- ``B/global``: 48 layers x 128 experts, P = 144 slots, 16 ranks on 1 node, 1 group.

Loads are zipf(1.0)-shaped and seeded: per layer, popularity ``p ∝ 1 / (rank + 1)`` over a fresh
random permutation of the experts, and counts drawn as ``multinomial(800_000, p)`` (100k tokens x
top-8). The planner's time depends on the shape, not on the values.

For every torch thread count and configuration, the vectorized ``rebalance_experts`` and the
reference ``reference_rebalance_experts`` run alternately (one call each per round, so load from
other processes hits both alike); the medians and minima over the rounds are reported, with the
speedup ``reference / vectorized``. Every call's outputs (phy2log, log2phy, logcnt) must be
identical between the two, or the script exits 1. Otherwise it exits 0 (a benchmark, not a test),
printing whether the >= 20x target held. ``--quick`` uses 8 layers and fewer rounds (a smoke run:
the vectorized code amortizes its per-step cost over layers, so 8-layer speedups are far lower and
the target is not evaluated).

The upstream anchor times (DeepSeek ``eplb.py`` unmodified, same machine class, a different run)
are printed alongside for context only; they are not part of the same-run comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from eplb_graph.policy import rebalance_experts
from eplb_graph.policy.reference_deepseek import reference_rebalance_experts

TARGET_SPEEDUP = 20.0
TOKENS_X_TOPK = 800_000


@dataclass(frozen=True)
class Config:
    name: str
    layers: int
    experts: int
    slots: int
    ranks: int
    nodes: int
    groups: int
    anchor_upstream_s: float  # median seconds of upstream eplb.py (anchor_numbers.md, zipf1.0)


CONFIGS = (
    Config("A1/hierarchical", 58, 256, 320, 64, 8, 8, 0.434),
    Config("A1/global", 58, 256, 320, 64, 1, 1, 1.594),
    Config("B/global", 48, 128, 144, 16, 1, 1, 0.202),
)


def zipf_load(layers: int, experts: int, seed: int) -> torch.Tensor:
    """``[layers, experts]`` float64 token counts with zipf(1.0) popularity per layer."""
    rng = np.random.default_rng(seed)
    shape = 1.0 / np.arange(1, experts + 1)
    shape /= shape.sum()
    load = np.empty((layers, experts))
    for layer in range(layers):
        popularity = np.empty(experts)
        popularity[rng.permutation(experts)] = shape
        load[layer] = rng.multinomial(TOKENS_X_TOPK, popularity)
    return torch.from_numpy(load)


def same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def bench_config(config: Config, layers: int, rounds: int, seed: int) -> dict:
    weight = zipf_load(layers, config.experts, seed)
    args = (config.slots, config.groups, config.nodes, config.ranks)
    expected = reference_rebalance_experts(weight, *args)  # warm-up both, check once
    if not same(rebalance_experts(weight, *args), expected):
        raise AssertionError(f"{config.name}: vectorized output differs from the reference")
    fast_s, reference_s = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        fast = rebalance_experts(weight, *args)
        fast_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        slow = reference_rebalance_experts(weight, *args)
        reference_s.append(time.perf_counter() - start)
        if not same(fast, slow):
            raise AssertionError(f"{config.name}: vectorized output differs from the reference")
    fast_median, ref_median = statistics.median(fast_s), statistics.median(reference_s)
    result = {
        "config": config.name,
        "layers": layers,
        "experts": config.experts,
        "slots": config.slots,
        "ranks": config.ranks,
        "nodes": config.nodes,
        "groups": config.groups,
        "rounds": rounds,
        "identical": True,
        "vectorized_median_ms": fast_median * 1e3,
        "vectorized_min_ms": min(fast_s) * 1e3,
        "reference_median_ms": ref_median * 1e3,
        "reference_min_ms": min(reference_s) * 1e3,
        "speedup_median": ref_median / fast_median,
        "speedup_min": min(reference_s) / min(fast_s),
    }
    if layers == config.layers:
        result["anchor_upstream_median_ms"] = config.anchor_upstream_s * 1e3
        result["speedup_vs_anchor_upstream"] = config.anchor_upstream_s / fast_median
    return result


def environment() -> dict:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
    }


def print_table(threads: int, rows: list[dict]) -> None:
    print(f"\ntorch threads = {threads}")
    header = (
        f"{'config':<16} {'L':>3} {'vectorized ms':>14} {'reference ms':>13} "
        f"{'speedup':>8} {'(min/min)':>9} {'upstream anchor ms':>19}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        anchor = row.get("anchor_upstream_median_ms")
        anchor_text = f"{anchor:.0f} ({row['speedup_vs_anchor_upstream']:.0f}x)" if anchor else "-"
        print(
            f"{row['config']:<16} {row['layers']:>3} {row['vectorized_median_ms']:>14.2f} "
            f"{row['reference_median_ms']:>13.1f} {row['speedup_median']:>7.1f}x "
            f"{row['speedup_min']:>8.1f}x {anchor_text:>19}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 layers, fewer rounds")
    parser.add_argument("--json", type=Path, help="write the raw results here")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, help="timed rounds per configuration")
    parser.add_argument("--seed", type=int, default=1000)
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 11)

    report: dict = {"environment": environment(), "quick": args.quick, "results": {}}
    print("environment:", report["environment"])
    misses = []
    wall = time.perf_counter()
    for threads in args.threads:
        torch.set_num_threads(threads)
        rows = []
        for index, config in enumerate(CONFIGS):
            layers = 8 if args.quick else config.layers
            try:
                rows.append(bench_config(config, layers, rounds, args.seed + 10 * index))
            except AssertionError as error:
                print(f"FAILED: {error}")
                return 1
        print_table(threads, rows)
        report["results"][str(threads)] = rows
        misses += [
            f"{r['config']} @ {threads} threads: {r['speedup_median']:.1f}x"
            for r in rows
            if r["speedup_median"] < TARGET_SPEEDUP and not args.quick
        ]
    report["wall_s"] = time.perf_counter() - wall
    report["target_speedup"] = TARGET_SPEEDUP
    report["target_misses"] = misses
    print(f"\nall outputs identical to the reference; wall {report['wall_s']:.1f} s")
    if args.quick:
        print(f"--quick: the >= {TARGET_SPEEDUP:.0f}x target applies to full-size models only")
    elif misses:
        print(f"target >= {TARGET_SPEEDUP:.0f}x (median) MISSED: " + "; ".join(misses))
    else:
        print(f"target >= {TARGET_SPEEDUP:.0f}x (median): met everywhere")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
