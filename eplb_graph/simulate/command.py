"""``eplb-graph simulate``: replay a trace per policy and report balancedness and churn."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eplb_graph.control import ControlSettings
from eplb_graph.policy import get_policy
from eplb_graph.simulate.simulator import ClusterShape, SimulationReport, plot_reports, simulate
from eplb_graph.simulate.trace import TraceError, TraceSpec, generate_trace, load_trace


def add_parser(commands) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "simulate",
        help="replay a load trace through the control plane (tune window/interval/redundancy)",
        description=(
            "Replay a load trace (or a generated one) through the real window, phase filter, "
            "planner and policy, with no weights. Reports time-averaged balancedness against "
            "EPLB off, rebalances, slots and bytes moved, and policy time."
        ),
    )
    source = parser.add_argument_group("trace")
    source.add_argument("--trace", metavar="NPZ", help="trace file (tools/gen_trace.py makes one)")
    source.add_argument("--layers", type=int, default=58)
    source.add_argument("--experts", type=int, default=256)
    source.add_argument("--top-k", type=int, default=8)
    source.add_argument("--steps", type=int, default=20_000)
    source.add_argument("--shape", choices=["zipf", "lognormal"], default="zipf")
    source.add_argument("--skew", type=float, default=1.0, help="zipf exponent / lognormal sigma")
    source.add_argument("--drift-sigma", type=float, default=0.2)
    source.add_argument("--segment-steps", type=int, default=500)
    source.add_argument("--prefill-fraction", type=float, default=0.1)
    source.add_argument("--seed", type=int, default=0)
    control = parser.add_argument_group("EPLB")
    control.add_argument(
        "--policy", action="append", help="policy to simulate (repeatable; default: default)"
    )
    control.add_argument("--window-size", type=int, default=1000)
    control.add_argument("--step-interval", type=int, default=3000)
    control.add_argument("--num-redundant", type=int, default=32)
    control.add_argument("--ranks", type=int, default=32)
    control.add_argument("--nodes", type=int, default=1)
    control.add_argument("--groups", type=int, default=1)
    control.add_argument(
        "--load-collection-phase", choices=["all", "prefill", "decode"], default="all"
    )
    control.add_argument(
        "--expert-bytes", type=int, default=44_040_192, help="bytes of one expert's weights"
    )
    output = parser.add_argument_group("output")
    output.add_argument("--json", metavar="PATH", help="write the report as JSON")
    output.add_argument("--plot", metavar="PNG", help="write balancedness over time as a PNG")
    output.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(handler=run)
    return parser


def _table(reports: list[SimulationReport]) -> str:
    header = (
        f"{'policy':<14} {'balancedness':>12} {'EPLB off':>9} {'rebalances':>10} "
        f"{'slots moved':>11} {'GB/rebalance':>12} {'policy s':>9}"
    )
    lines = [header, "-" * len(header)]
    for report in reports:
        data = report.as_dict()
        lines.append(
            f"{report.policy:<14} {report.balancedness:>12.4f} "
            f"{report.balancedness_baseline:>9.4f} {report.rearrangements:>10d} "
            f"{data['mean_slots_changed']:>11.1%} "
            f"{data['mean_bytes_per_rebalance'] / 1e9:>12.2f} "
            f"{data['total_policy_seconds']:>9.3f}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        if args.trace:
            trace = load_trace(args.trace)
        else:
            trace = generate_trace(
                TraceSpec(
                    num_layers=args.layers,
                    num_experts=args.experts,
                    top_k=args.top_k,
                    num_steps=args.steps,
                    shape=args.shape,
                    skew=args.skew,
                    drift_sigma=args.drift_sigma,
                    segment_steps=args.segment_steps,
                    prefill_fraction=args.prefill_fraction,
                    seed=args.seed,
                )
            )
        cluster = ClusterShape(
            num_redundant=args.num_redundant,
            num_ranks=args.ranks,
            num_nodes=args.nodes,
            num_groups=args.groups,
            expert_bytes=args.expert_bytes,
        )
        policies = args.policy or ["default"]
        for policy in policies:
            get_policy(policy)  # unknown names are a usage error, before any simulation
        settings = [
            ControlSettings(
                window_size=args.window_size,
                step_interval=args.step_interval,
                load_collection_phase=args.load_collection_phase,
                policy=policy,
            )
            for policy in policies
        ]
    except (TraceError, ValueError, KeyError) as error:
        sys.stderr.write(f"eplb-graph simulate: {error}\n")
        return 2
    show_progress = not args.no_progress and sys.stderr.isatty()
    reports = [simulate(trace, s, cluster, progress=show_progress) for s in settings]
    sys.stdout.write(
        f"trace: {trace.num_steps} steps, {trace.num_layers} layers x {trace.num_experts} "
        f"experts, top-{trace.top_k}; {cluster.num_ranks} ranks, "
        f"{trace.num_experts + cluster.num_redundant} slots\n"
    )
    sys.stdout.write(_table(reports) + "\n")
    if args.json:
        payload = {
            "trace": {
                "steps": trace.num_steps,
                "layers": trace.num_layers,
                "experts": trace.num_experts,
                "top_k": trace.top_k,
            },
            "reports": [report.as_dict() for report in reports],
        }
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    if args.plot:
        plot_reports(reports, args.plot)
    return 0
