"""Benchmark ``eplb_graph.policy.rebalance_experts`` against the plain-Python reference.

Usage::

    python tools/bench/bench_policy.py [--quick] [--json PATH] [--threads 1 2]
    python tools/bench/bench_policy.py --churn [--quick] [--json PATH] [--seeds N] [--draws K]

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

``--churn`` runs the churn experiment instead (:func:`churn_experiment`): re-planning window after
window on a drifting trace, DeepSeek global's fresh plan against ``churn_aware`` (and
``swift_balance`` / ``flash_lb`` for reference), measuring the fraction of slots that need a
cross-rank transfer and the balancedness of each plan under the *next* window's load: under one
draw of the drift, and in expectation over ``--draws`` draws (one draw moves the gap between two
policies by about +-0.005, more than the differences being judged). Configs A1, A2 and B, each
over ``--seeds`` traces; ``--quick`` uses 8 layers, 3 windows, 1 seed and 4 draws.
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

from eplb_graph.control.planning import PolicyPlanner
from eplb_graph.control.window import WindowLoad
from eplb_graph.policy import (
    balancedness,
    rank_load,
    rebalance_experts,
    transfers_needed,
)
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


# ---------------------------------------------------------------------------------------------
# Churn experiment (--churn)

CHURN_CONFIGS = (  # name, layers, experts, slots, ranks (DeepSeek "global": 1 group, 1 node)
    ("A1", 58, 256, 320, 64),
    ("A2", 58, 256, 288, 32),
    ("B", 48, 128, 144, 16),
)
CHURN_TOKENS, CHURN_TOP_K, CHURN_SIGMA = 100_000, 8, 0.2
TARGET_TRANSFER_FRACTION = 0.15
# name -> (policy, options). Every policy plans through the runtime's PolicyPlanner, from its own
# previous plan (DeepSeek's "default" ignores the old plan: it plans fresh each time).
CHURN_POLICIES = {
    "default (DeepSeek global, fresh)": ("default", {}),
    "churn_aware (15%, default)": ("churn_aware", {}),
    "churn_aware (15%, no drift hedge)": ("churn_aware", {"drift_sigma": 0.0}),
    "churn_aware (10% budget)": ("churn_aware", {"max_transfer_fraction": 0.10}),
    "swift_balance": ("swift_balance", {}),
    "flash_lb": ("flash_lb", {}),
}
REFERENCE = "default (DeepSeek global, fresh)"


def expected_topk_load(popularity: np.ndarray) -> np.ndarray:
    """``[..., L, N]`` expected token counts when each of ``CHURN_TOKENS`` tokens picks
    ``CHURN_TOP_K`` distinct experts with weights ``popularity`` (rows sum to 1).

    The inclusion probability of an expert under sampling without replacement is approximated by
    ``1 - exp(-lam p)`` with ``lam`` solved (bisection) so that the probabilities sum to ``k``;
    like real top-k routing this caps an expert at ``1 / k`` of a layer's counts. For zipf(1.0)
    over 256 experts the largest share comes out at 0.098, as the anchors' sampled 0.0983.
    """
    low = np.zeros(popularity.shape[:-1])
    high = np.ones(popularity.shape[:-1])
    while ((1 - np.exp(-high[..., None] * popularity)).sum(axis=-1) < CHURN_TOP_K).any():
        high *= 2
    for _ in range(60):
        middle = (low + high) / 2
        below = (1 - np.exp(-middle[..., None] * popularity)).sum(axis=-1) < CHURN_TOP_K
        low, high = np.where(below, middle, low), np.where(below, high, middle)
    return CHURN_TOKENS * (1 - np.exp(-high[..., None] * popularity))


def drift(popularity: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One window of drift: ``p * exp(CHURN_SIGMA * N(0, 1))`` per expert, renormalized."""
    drifted = popularity * np.exp(CHURN_SIGMA * rng.standard_normal(popularity.shape))
    return drifted / drifted.sum(axis=-1, keepdims=True)


def drifting_popularity(layers: int, experts: int, windows: int, seed: int) -> list[np.ndarray]:
    """``windows`` consecutive ``[L, N]`` popularities: zipf(1.0) over a random expert order per
    layer, then :func:`drift` between consecutive windows."""
    rng = np.random.default_rng(seed)
    shape = 1.0 / np.arange(1, experts + 1)
    popularity = np.stack([shape[rng.permutation(experts)] for _ in range(layers)])
    popularity /= popularity.sum(axis=1, keepdims=True)
    series = [popularity]
    for _ in range(windows - 1):
        series.append(drift(series[-1], rng))
    return series


def expected_balancedness(plan: torch.Tensor, loads: np.ndarray, ranks: int) -> np.ndarray:
    """``[D]`` balancedness of ``plan`` under each of ``loads [D, L, N]``."""
    return np.array([balancedness(rank_load(plan, torch.from_numpy(x), ranks)) for x in loads])


def churn_experiment(
    config: tuple, layers: int, windows: int, seed: int, draws: int
) -> dict[str, dict[str, list[float]]]:
    """Re-plan on windows 1..W of one drifting trace; score each plan on the next window.

    Window 0's DeepSeek global plan is everyone's starting placement. For t = 1..W every policy
    plans on window t's load through :class:`eplb_graph.control.planning.PolicyPlanner` (the
    runtime's planner: ``churn_aware`` also gets the previous window's load and hedges the drift
    it measures), and we record per window: the fraction of the L * P slots whose (expert, rank)
    pair is new (a cross-rank transfer); balancedness under window t's load (what the plan was
    made for), under window t+1's load (what it serves next: one draw of the drift), and its mean
    under ``draws`` independent draws of window t+1 (the expectation, the same draws for every
    policy); and the planning time.
    """
    _, _, experts, slots, ranks = config
    popularity = drifting_popularity(layers, experts, windows + 2, seed)
    loads = [expected_topk_load(p) for p in popularity]
    start, _, _ = rebalance_experts(torch.from_numpy(loads[0]), slots, 1, 1, ranks)
    planners = {
        label: PolicyPlanner(policy, slots, 1, 1, ranks, dict(options))
        for label, (policy, options) in CHURN_POLICIES.items()
    }
    for planner in planners.values():
        planner.observe(window_load(0, loads[0], start))
    current = dict.fromkeys(CHURN_POLICIES, start)
    rows: dict[str, dict[str, list[float]]] = {
        label: {"transfers": [], "now": [], "next": [], "expected": [], "seconds": []}
        for label in CHURN_POLICIES
    }
    draw_rng = np.random.default_rng(seed + 7919)
    for t in range(1, windows + 1):
        next_draws = expected_topk_load(
            np.stack([drift(popularity[t], draw_rng) for _ in range(draws)])
        )
        for label, planner in planners.items():
            began = time.perf_counter()
            plan = planner(window_load(t, loads[t], current[label]))
            plan = current[label] if plan is None else plan
            row = rows[label]
            row["seconds"].append(time.perf_counter() - began)
            moved = int(transfers_needed(current[label], plan, ranks).sum())
            row["transfers"].append(moved / (layers * slots))
            row["now"].append(balancedness(rank_load(plan, torch.from_numpy(loads[t]), ranks)))
            row["next"].append(balancedness(rank_load(plan, torch.from_numpy(loads[t + 1]), ranks)))
            row["expected"].append(float(expected_balancedness(plan, next_draws, ranks).mean()))
            current[label] = plan
    return rows


def window_load(step: int, load: np.ndarray, committed: torch.Tensor) -> WindowLoad:
    """A closed window of one sample, as the runtime's planner receives it."""
    return WindowLoad(
        step, torch.from_numpy(load)[None], torch.zeros_like(committed), committed.clone()
    )


def churn_summary(config: tuple, layers: int, windows: int, runs: list[dict]) -> dict:
    """Pool the windows of every seed's run per policy, with gaps to DeepSeek's fresh plan."""
    name, _, experts, slots, ranks = config
    pooled = {
        label: {key: [v for run in runs for v in run[label][key]] for key in runs[0][label]}
        for label in CHURN_POLICIES
    }
    reference_next = np.array(pooled[REFERENCE]["next"])
    reference_expected = np.array(pooled[REFERENCE]["expected"])
    summary = {}
    for label, row in pooled.items():
        gap = np.array(row["next"]) - reference_next
        expected_gap = np.array(row["expected"]) - reference_expected
        summary[label] = {
            **row,
            "transfers_mean": float(np.mean(row["transfers"])),
            "transfers_max": float(np.max(row["transfers"])),
            "now_mean": float(np.mean(row["now"])),
            "next_mean": float(np.mean(row["next"])),
            "next_gap_mean": float(gap.mean()),
            "expected_mean": float(np.mean(row["expected"])),
            "expected_gap_mean": float(expected_gap.mean()),
            "expected_gap_min": float(expected_gap.min()),
            "windows_behind": int((expected_gap < 0).sum()),
            "seconds_median": float(statistics.median(row["seconds"])),
        }
    return {
        "config": name,
        "layers": layers,
        "experts": experts,
        "slots": slots,
        "ranks": ranks,
        "windows": windows,
        "runs": len(runs),
        "policies": summary,
    }


def churn_verdict(result: dict) -> dict:
    """The acceptance check for churn_aware rows: transfers <= 15% of slots in every window, and
    balancedness under the next window >= DeepSeek's fresh plan's, in expectation over the drift
    (mean over windows and seeds); the one-draw mean and the windows behind are reported too."""
    verdict = {}
    for label, row in result["policies"].items():
        if not label.startswith("churn_aware"):
            continue
        verdict[label] = {
            "transfers_ok": row["transfers_max"] <= TARGET_TRANSFER_FRACTION + 1e-12,
            "balance_expected_ok": row["expected_gap_mean"] >= 0.0,
            "balance_one_draw_ok": row["next_gap_mean"] >= 0.0,
            "windows_behind": f"{row['windows_behind']} of {len(row['expected'])}",
        }
    return verdict


def print_churn(result: dict, draws: int) -> None:
    print(
        f"\n{result['config']}: {result['layers']} layers x {result['experts']} experts, "
        f"P = {result['slots']}, {result['ranks']} ranks, {result['runs']} seeds x "
        f"{result['windows']} windows (drift sigma {CHURN_SIGMA}; expectation over {draws} draws)"
    )
    header = (
        f"{'policy':<34} {'transfers mean/max':>18} {'bal@t':>6} {'bal@t+1':>8} "
        f"{'E[bal@t+1]':>10} {'E vs DeepSeek mean/worst':>25} {'behind':>7} {'ms':>5}"
    )
    print(header)
    print("-" * len(header))
    for label, row in result["policies"].items():
        print(
            f"{label:<34} {row['transfers_mean']:>9.3f}/{row['transfers_max']:.3f} "
            f"{row['now_mean']:>6.3f} {row['next_mean']:>8.4f} {row['expected_mean']:>10.4f} "
            f"{row['expected_gap_mean']:>+16.4f}/{row['expected_gap_min']:+.4f} "
            f"{row['windows_behind']:>7} {row['seconds_median'] * 1e3:>5.0f}"
        )
    for label, checks in churn_verdict(result).items():
        print(f"  {label}: " + ", ".join(f"{k}={v}" for k, v in checks.items()))


def churn_main(args: argparse.Namespace) -> int:
    """``--churn``: run :func:`churn_experiment` on every config; always exits 0."""
    report: dict = {"environment": environment(), "quick": args.quick, "churn": []}
    print("environment:", report["environment"])
    windows = 3 if args.quick else 5
    seeds = args.seeds or (1 if args.quick else 4)
    draws = args.draws or (4 if args.quick else 16)
    report.update(seeds=seeds, draws=draws, sigma=CHURN_SIGMA)
    wall = time.perf_counter()
    for index, config in enumerate(CHURN_CONFIGS):
        layers = 8 if args.quick else config[1]
        runs = [
            churn_experiment(config, layers, windows, args.seed + 10 * index + 100 * k, draws)
            for k in range(seeds)
        ]
        result = churn_summary(config, layers, windows, runs)
        result["verdict"] = churn_verdict(result)
        print_churn(result, draws)
        report["churn"].append(result)
    report["wall_s"] = time.perf_counter() - wall
    print(f"\nwall {report['wall_s']:.1f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 layers, fewer rounds")
    parser.add_argument("--json", type=Path, help="write the raw results here")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, help="timed rounds per configuration")
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument(
        "--churn", action="store_true", help="run the churn experiment instead of the timing"
    )
    parser.add_argument("--seeds", type=int, help="--churn: traces per config (default 4)")
    parser.add_argument("--draws", type=int, help="--churn: draws of the next window (16)")
    args = parser.parse_args(argv)
    if args.churn:
        return churn_main(args)
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
