"""``eplb-graph demo``: the end-to-end job (spawned ranks, or one rank under torchrun)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eplb_graph.demo.runner import DemoOptions, run_rank


def add_parser(commands) -> argparse.ArgumentParser:
    defaults = DemoOptions()
    parser = commands.add_parser(
        "demo",
        help="run a compiled multi-rank MoE with async EPLB against EPLB off",
        description=(
            "Spawn N ranks (gloo on this machine; or run as one rank under torchrun), serve "
            "skewed, drifting traffic with a prefill/decode mix through a compiled MoE with "
            "async EPLB, next to the same model with EPLB off, and report balancedness, "
            "rearrangements, bytes moved, commit latency, recompiles, graph breaks and the "
            "largest output difference."
        ),
    )
    parser.add_argument("--ranks", type=int, default=defaults.ranks)
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--experts", type=int, default=defaults.experts)
    parser.add_argument("--redundant", type=int, default=defaults.redundant)
    parser.add_argument("--hidden", type=int, default=defaults.hidden)
    parser.add_argument("--intermediate", type=int, default=defaults.intermediate)
    parser.add_argument("--top-k", type=int, default=defaults.top_k)
    parser.add_argument(
        "--format", dest="weight_format", choices=["unquantized", "w8a8"], default="unquantized"
    )
    parser.add_argument("--policy", default=defaults.policy)
    parser.add_argument("--window-size", type=int, default=defaults.window_size)
    parser.add_argument("--step-interval", type=int, default=defaults.step_interval)
    parser.add_argument("--layers-per-step", type=int, default=defaults.layers_per_step)
    parser.add_argument(
        "--backend", default=defaults.backend, help="torch.compile backend (inductor, aot_eager)"
    )
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON")
    parser.add_argument(
        "--plot", metavar="PNG", default="eplb-demo.png", help="plot path (default %(default)s)"
    )
    parser.add_argument("--no-plot", action="store_true", help="do not write the plot")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(handler=run)
    return parser


def options_from_args(args: argparse.Namespace, ranks: int | None = None) -> DemoOptions:
    from eplb_graph.policy import get_policy

    get_policy(args.policy)  # unknown names: a usage error before any process starts
    return DemoOptions(
        ranks=ranks or args.ranks,
        steps=args.steps,
        layers=args.layers,
        experts=args.experts,
        hidden=args.hidden,
        intermediate=args.intermediate,
        top_k=args.top_k,
        redundant=args.redundant,
        weight_format=args.weight_format,
        policy=args.policy,
        window_size=args.window_size,
        step_interval=args.step_interval,
        layers_per_step=args.layers_per_step,
        backend=args.backend,
        seed=args.seed,
        progress=not args.no_progress and sys.stderr.isatty(),
    )


def run(args: argparse.Namespace) -> int:
    from eplb_graph.launch import launched_by_torchrun, run_under_torchrun, spawn_ranks

    try:
        if launched_by_torchrun():
            import os

            options = options_from_args(args, ranks=int(os.environ["WORLD_SIZE"]))
        else:
            options = options_from_args(args)
    except (ValueError, KeyError) as error:
        sys.stderr.write(f"eplb-graph demo: {error}\n")
        return 2
    if launched_by_torchrun():
        # The demo model runs on the CPU: its serving collectives use gloo even where a GPU is
        # visible (EPLB's own groups are gloo in every case).
        report = run_under_torchrun(run_rank, options, backend="gloo")
        if report is None:  # not rank 0: rank 0 reports
            return 0
    else:
        report = spawn_ranks(run_rank, options.ranks, options)[0]
    return emit(report, args)


def emit(report: dict, args: argparse.Namespace) -> int:
    from eplb_graph.demo.report import plot, summary_table

    sys.stdout.write(summary_table(report) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if not args.no_plot:
        plot(report, args.plot)
        sys.stdout.write(f"plot: {args.plot}\n")
    broken = violated_guarantees(report)
    for problem in broken:
        sys.stderr.write(f"eplb-graph demo: FAILED: {problem}\n")
    return 1 if broken else 0


def violated_guarantees(report: dict) -> list[str]:
    """The guarantees the demo exists to show; any violation makes it exit 1."""
    problems = []
    if report["recompiles"]:
        problems.append(f"{report['recompiles']} recompiles after warm-up")
    if report["graph_breaks"]:
        problems.append(f"{report['graph_breaks']} graph breaks")
    if not report["weights_exact"]:
        problems.append("moved weights differ from the checkpoint")
    if not report["addresses_stable"]:
        problems.append("an EPLB tensor or weight view changed address")
    if report["max_abs_diff"] != 0.0:
        problems.append(f"EPLB on and off outputs differ by {report['max_abs_diff']}")
    return problems
