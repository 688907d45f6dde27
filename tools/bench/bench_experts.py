"""Expert compute that follows the placement: local rows only, against computing every row.

    python tools/bench/bench_experts.py [--quick] [--json PATH]

Two families, each variant sampled in turn (tools/bench/timing.py), ratios within one run:

1. ``torch.ops.eplb_graph.local_experts`` (native CPU kernel) against the weight-0 path the demo
   used before (every row computed, other ranks' rows on local row 0 and masked), at T in
   {1, 16, 256, 4096}: (a) every row local (goal: no slower), (b) EP=2, same placement, one
   rank's share (goal: <= 0.6x of the weight-0 path, which computes every row on every rank).
2. vLLM's CPU kernel (``torch.ops._C.cpu_fused_moe``) in the plugin's op
   ``torch.ops.eplb_graph.vllm_local_experts`` (local rows compacted) against the weight-0 trick
   on the same prepacked storage, and against ``local_experts`` over unpacked weights of the same
   shape (which kernel the plugin should use). Needs vLLM; skipped with the reason without it.

Shapes: hidden 1024, intermediate 512, 64 experts (32 per rank at EP=2), top-8 for the vLLM
family (the --benefit model's layer); hidden 256, intermediate 256, 16 experts, top-2 for the demo
family (quick: smaller). One thread, as each vLLM CPU worker runs on one core here.
"""

# The timed lambdas run inside the iteration that made them: binding loop variables is intended.
# ruff: noqa: B023

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import measure, run_benchmark, write_report

import eplb_graph  # noqa: F401  (registers the ops)
from eplb_graph import ops
from eplb_graph.ops import native


def weight0_demo(tokens, local_slot, w13, w2):
    """The previous demo kernel: every row computed (non-local on slot 0), then masked."""
    slot = local_slot.clamp_min(0)
    up = w13.index_select(0, slot)
    down = w2.index_select(0, slot)
    hidden = torch.bmm(up, tokens.unsqueeze(2)).squeeze(2)
    gate, value = hidden.chunk(2, dim=1)
    out = torch.bmm(down, (torch.nn.functional.silu(gate) * value).unsqueeze(2)).squeeze(2)
    return out * (local_slot >= 0).unsqueeze(1).to(out.dtype)


def demo_family(rows_list, hidden, inter, experts, budget):
    results = []
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    half = experts // 2
    for rows in rows_list:
        tokens = torch.randn(rows, hidden, generator=g)
        slot = torch.randint(0, experts, (rows,), generator=g)
        stats = torch.zeros(2, dtype=torch.int64)
        ones = torch.ones(rows, 1)
        valid = torch.tensor(rows)
        identity = torch.arange(experts)
        # EP=2: this rank holds slots 0..half-1; its weights are half the experts.
        ep_map = torch.cat([torch.arange(half), torch.full((experts - half,), -1)])
        local_ep = torch.where(slot < half, slot, torch.full_like(slot, -1))
        fns = {
            "weight0_all_local": lambda: weight0_demo(tokens, slot, w13, w2),
            "local_experts_all_local": lambda: ops.local_experts(
                tokens, slot.unsqueeze(1), ones, identity, w13, w2, stats, valid
            ),
            "weight0_ep2": lambda: weight0_demo(tokens, local_ep, w13[:half], w2[:half]),
            "local_experts_ep2": lambda: ops.local_experts(
                tokens, slot.unsqueeze(1), ones, ep_map, w13[:half], w2[:half], stats, valid
            ),
        }
        cell = measure(fns, budget, 0.02, 5)
        med = {name: value["median_us"] for name, value in cell.items()}
        results.append(
            {
                "rows": rows,
                "median_us": med,
                "all_local_ratio": med["local_experts_all_local"] / med["weight0_all_local"],
                "ep2_ratio": med["local_experts_ep2"] / med["weight0_ep2"],
            }
        )
        print(
            f"demo T={rows:5d}: all local {med['local_experts_all_local']:9.1f} us vs weight-0 "
            f"{med['weight0_all_local']:9.1f} us ({results[-1]['all_local_ratio']:.2f}x); EP=2 "
            f"{med['local_experts_ep2']:9.1f} vs {med['weight0_ep2']:9.1f} us "
            f"({results[-1]['ep2_ratio']:.2f}x)"
        )
    return results


def vllm_family(rows_list, hidden, inter, experts, top_k, budget):
    try:
        import vllm._custom_ops as vllm_ops
    except Exception as error:
        print(f"vLLM family skipped: {type(error).__name__}: {error}")
        return {"skipped": f"{type(error).__name__}: {error}"}
    from eplb_graph.integrations.vllm.local_rows import vllm_local_experts

    results = []
    g = torch.Generator().manual_seed(1)
    half = experts // 2
    dtype, isa = torch.bfloat16, "amx"
    if not torch.cpu._is_amx_tile_supported():
        isa = "vec"
    w13 = (torch.randn(half, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(half, hidden, inter, generator=g) / inter**0.5).to(dtype)
    packed13 = vllm_ops.cpu_prepack_moe_weight(w13, isa)
    packed2 = vllm_ops.cpu_prepack_moe_weight(w2, isa)
    expert_map = torch.cat([torch.arange(half), torch.full((experts - half,), -1)]).int()
    for rows in rows_list:
        x = torch.randn(rows, hidden, generator=g).to(dtype)
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(rows)]).int()
        weights = torch.rand(rows, top_k, generator=g)
        local = expert_map[ids.long()]
        w0_ids = torch.where(local >= 0, local, torch.zeros_like(local)).int()
        w0_weights = torch.where(local >= 0, weights, torch.zeros_like(weights))
        out = torch.empty_like(x)
        stats = torch.zeros(2, dtype=torch.int64)
        valid = torch.tensor(rows)

        def weight0():
            torch.ops._C.cpu_fused_moe(
                out, x, packed13, packed2, None, None, w0_weights, w0_ids, False, "silu", isa
            )

        fns = {
            "vllm_weight0_ep2": weight0,
            "vllm_local_rows_ep2": lambda: vllm_local_experts(
                x,
                ids,
                weights,
                expert_map,
                [packed13, packed2, None, None],
                stats,
                "cpu_fused_moe",
                "silu",
                isa,
            ),
            "local_experts_ep2": lambda: ops.local_experts(
                x, ids, weights, expert_map, w13, w2, stats, valid
            ),
        }
        cell = measure(fns, budget, 0.02, 3)
        med = {name: value["median_us"] for name, value in cell.items()}
        results.append(
            {
                "rows": rows,
                "median_us": med,
                "local_rows_vs_weight0": med["vllm_local_rows_ep2"] / med["vllm_weight0_ep2"],
                "own_kernel_vs_vllm_local_rows": med["local_experts_ep2"]
                / med["vllm_local_rows_ep2"],
            }
        )
        print(
            f"vLLM T={rows:5d}: local rows {med['vllm_local_rows_ep2']:10.1f} us vs weight-0 "
            f"{med['vllm_weight0_ep2']:10.1f} us ({results[-1]['local_rows_vs_weight0']:.2f}x); "
            f"eplb-graph local_experts {med['local_experts_ep2']:10.1f} us "
            f"({results[-1]['own_kernel_vs_vllm_local_rows']:.2f}x of vLLM's)"
        )
    return {"isa": isa, "dtype": str(dtype), "cells": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes, short cells")
    parser.add_argument("--json", type=Path, help="write the raw results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    native.ensure_loaded()
    if args.quick:
        demo = demo_family([1, 16, 256], 128, 128, 16, 0.3)
        vllm = vllm_family([1, 16, 256], 512, 256, 64, 8, 0.3)
    else:
        demo = demo_family([1, 16, 256, 4096], 256, 256, 16, 1.5)
        vllm = vllm_family([1, 16, 256, 1024], 1024, 512, 64, 8, 1.5)
    write_report(
        args.json,
        {"quick": args.quick, "native": native.status().value, "demo": demo, "vllm": vllm},
    )
    return 0


if __name__ == "__main__":
    run_benchmark(main)
