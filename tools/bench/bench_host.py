"""EPLB's own host work on the cores that serve: the per-step hooks and the per-window planning.

Usage::

    python tools/bench/bench_host.py [--quick] [--json PATH]

Why: with EPLB on and nothing moving, serving pays only this work, so it bounds how much slower
EPLB on can be than off at a batch where no rearrangement repays (the benefit curve's goal is
>= 0.99x). Two figures:

- **per step**: ``EplbController.begin_step`` + ``end_step`` (batch phase, step inputs, the load
  ring, the serving feedback that reads the expert op's counters and adds cost samples), with the
  counters advanced between the two as the op would; and the feedback's part alone. Shapes: the
  benefit curve's wide model (4 layers, 64 + 8 slots, 2 ranks) and a DeepSeek-V3-sized rank (58
  layers, 256 + 32 slots, 8 ranks).
- **per window** (``rearrange="when_it_pays"``, a fitted model, 2 ranks, the wide model): a
  uniform load, where no placement could repay one copy (kept without planning), and a skewed
  one, where every candidate is built and priced (each timed window on a fresh planner, so a
  plan applied does not leave the next windows only judging it); ``rearrange="always"`` on the
  skewed load for reference (the policy alone); and the skewed window priced on a
  DeepSeek-V3-sized rank (58 layers; 8 with ``--quick``), where the planning is seconds.

Samples are interleaved across variants (``timing.measure``); µs per call, median and min.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch
from timing import measure, run_benchmark, write_report

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from eplb_graph.control.cost_model import CostMoments, ExpertCostModel
from eplb_graph.control.feedback import ServingFeedback, WindowFeedback, feedback_size
from eplb_graph.control.planning import PolicyPlanner
from eplb_graph.control.window import EplbController, WindowLoad
from eplb_graph.placement import Placement
from eplb_graph.settings import RuntimeSettings
from eplb_graph.state import EplbState

SHAPES = {
    "wide (4 x 64+8, 2 ranks)": (4, 64, 8, 2),
    "DeepSeek-V3 rank (58 x 256+32, 8 ranks)": (58, 256, 32, 8),
}
MODEL = ExpertCostModel(fixed_us=600.0, row_us=80.0, read_us=240.0, samples=800, fit_error=0.2)
"""About what the benefit curve's engines fitted for the wide model (AVX2 machine)."""


def step_variants() -> dict:
    variants = {}
    for name, (layers, logical, redundant, ranks) in SHAPES.items():
        state = EplbState(Placement.default(layers, logical, redundant, ranks), max_replicas=4)
        controller = EplbController(
            state, RuntimeSettings(window_size=32, step_interval=10**9), lambda window: None
        )
        controller.feedback.model_source = lambda: MODEL
        advance = torch.tensor([16, 3_000_000, 8], dtype=torch.int64)

        def step(controller=controller, state=state, advance=advance) -> None:
            controller.begin_step(has_prefill=False, num_valid_tokens=8)
            state.expert_stats.add_(advance)
            controller.end_step()

        feedback = ServingFeedback(state.expert_stats, model_source=lambda: MODEL)

        def feedback_step(feedback=feedback, state=state, advance=advance) -> None:
            state.expert_stats.add_(advance)
            feedback.step(step_us=30_000, tokens=8, decode=True, in_flight=False, version=0)

        variants[f"step hooks, {name}"] = step
        variants[f"feedback alone, {name}"] = feedback_step
    return variants


def _feedback_vector(num_ranks: int) -> torch.Tensor:
    moments = CostMoments()
    for rows in range(1, 65):
        active = min(32, rows)
        moments.add_call(rows, active, int(MODEL.call_us(rows, active)))
    vector = torch.zeros(feedback_size(num_ranks), dtype=torch.int64)
    vector[:3] = torch.tensor([num_ranks, 32 * num_ranks, num_ranks])
    vector[3 : 3 + len(moments.values)] = moments.values
    return vector


def window_variants(quick: bool) -> dict:
    """Window closes on the wide model (uniform, skewed, ``always``) and, priced, on a
    DeepSeek-V3-sized rank (8 of its layers with ``--quick``)."""
    variants = {}
    for shape in SHAPES:
        layers, logical, redundant, ranks = SHAPES[shape]
        wide = shape.startswith("wide")
        if not wide and quick:
            layers = 8
        committed = Placement.default(layers, logical, redundant, ranks).phy2log
        feedback = WindowFeedback.parse(_feedback_vector(ranks))
        generator = torch.Generator().manual_seed(0)
        zipf = 1.0 / torch.arange(1, logical + 1, dtype=torch.float64) ** 1.2
        skewed = (zipf / zipf.sum() * 32 * 64 * 8).round().to(torch.int64).expand(layers, -1)
        loads = {
            "uniform": torch.full((4, layers, logical), 2, dtype=torch.int64),
            "skewed": torch.stack(
                [skewed + torch.randint(0, 3, skewed.shape, generator=generator) for _ in range(4)]
            ),
        }
        cases = (
            (("when_it_pays", "uniform"), ("when_it_pays", "skewed"), ("always", "skewed"))
            if wide
            else (("when_it_pays", "skewed"),)
        )
        for mode, load_name in cases:
            window = WindowLoad(
                100, loads[load_name], torch.zeros_like(committed), committed, feedback
            )
            name = f"window, {mode}, {load_name}" + ("" if wide else f", {shape}")

            def close(mode=mode, window=window, name=name, ranks=ranks, committed=committed):
                # A fresh planner per window: a gate that applied a plan would otherwise spend
                # the next windows judging it, and those cost nothing to time.
                planner = PolicyPlanner(
                    "default", committed.shape[1], 1, 1, ranks, rearrange=mode,
                    max_replicas=4, step_interval=64, copy_bytes=3 * 1024 * 512 * 2,
                )  # fmt: skip
                planner(window)
                REASONS[name] = planner

            variants[name] = close
    return variants


REASONS: dict = {}
"""Each window variant's planner, to report the decision the timed calls made."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short budgets (a smoke run)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    budget, sample = (0.3, 0.02) if args.quick else (2.0, 0.05)
    report = {"machine": platform.processor() or platform.machine(), "quick": args.quick}
    print("per step (µs):")
    report["step"] = measure(step_variants(), budget, sample, 5)
    for name, figures in report["step"].items():
        print(f"  {name:<72} median {figures['median_us']:9.1f}  min {figures['min_us']:9.1f}")
    print("per window (µs):")
    report["window"] = measure(window_variants(args.quick), budget * 2, sample * 4, 3)
    for name, figures in report["window"].items():
        print(f"  {name:<72} median {figures['median_us']:9.1f}  min {figures['min_us']:9.1f}")
    for name, planner in REASONS.items():
        gate = planner.gate
        reason = gate.decisions[-1]["reason"] if gate is not None else "policy only"
        report["window"][name]["decision"] = reason
        print(f"  {name}: {reason}")
    write_report(args.json, report)


if __name__ == "__main__":
    run_benchmark(main)
