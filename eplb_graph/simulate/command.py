"""``eplb-graph simulate``: replay a trace per policy and report balancedness and churn."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from eplb_graph.cli_support import (
    UsageError,
    check_destination,
    check_plotting,
    float_between,
    int_at_least,
    policy_metavar,
    refuse,
    warn_if_window_capped,
    write_file_atomically,
    write_text_atomically,
)
from eplb_graph.errors import EplbError
from eplb_graph.progress import NO_PROGRESS_HELP

if TYPE_CHECKING:
    from eplb_graph.simulate.simulator import ClusterShape, SimulationReport
    from eplb_graph.simulate.trace import LoadTrace

# The parser is built without torch (``eplb-graph --help`` and usage errors answer in well under
# a second); everything the replay needs is imported where it is used.

COMMAND = "eplb-graph simulate"


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
    positive, non_negative = int_at_least(1), int_at_least(0)
    source = parser.add_argument_group("trace")
    source.add_argument(
        "--trace",
        metavar="NPZ",
        help="replay this trace file (tools/gen_trace.py makes one); the generator options "
        "below are then ignored",
    )
    source.add_argument(
        "--windows",
        metavar="JSONL",
        help="replay the windows an engine recorded (the vLLM plugin's record_windows option) "
        "through a planner with the engine's settings, and show each decision next to the "
        "engine's; every other option is then ignored",
    )
    source.add_argument("--layers", type=positive, default=58, help="generated trace: MoE layers")
    source.add_argument("--experts", type=positive, default=256, help="logical experts")
    source.add_argument("--top-k", type=positive, default=8, help="picks per token")
    source.add_argument("--steps", type=positive, default=20_000, help="steps")
    source.add_argument(
        "--shape",
        choices=["zipf", "lognormal"],
        default="zipf",
        help="expert popularity (independent order per layer)",
    )
    source.add_argument(
        "--skew", type=float_between(0.0), default=1.0, help="zipf exponent / lognormal sigma"
    )
    source.add_argument(
        "--drift-sigma",
        type=float_between(0.0),
        default=0.2,
        help="lognormal noise multiplied into popularity at each segment",
    )
    source.add_argument(
        "--segment-steps", type=positive, default=500, help="steps per popularity segment"
    )
    source.add_argument(
        "--prefill-fraction",
        type=float_between(0.0, 1.0),
        default=0.1,
        help="share of prefill steps",
    )
    source.add_argument("--seed", type=non_negative, default=0, help="generator seed")
    control = parser.add_argument_group("EPLB")
    control.add_argument(
        "--policy",
        action="append",
        metavar=policy_metavar(),
        help="policy to simulate; repeat it for one report per policy on the same trace "
        "(default: default)",
    )
    control.add_argument(
        "--window-size",
        type=positive,
        default=1000,
        help="steps of load each plan sees (capped at --step-interval, with a warning)",
    )
    control.add_argument(
        "--step-interval", type=positive, default=3000, help="steps between rebalances"
    )
    control.add_argument("--num-redundant", type=non_negative, default=32, help="redundant slots")
    control.add_argument(
        "--ranks",
        type=positive,
        default=32,
        help="EP ranks (experts + --num-redundant must divide by it)",
    )
    control.add_argument(
        "--nodes", type=positive, default=1, help="nodes, for the default policy's hierarchy"
    )
    control.add_argument(
        "--groups",
        type=positive,
        default=1,
        help="expert groups, for the default policy's hierarchy",
    )
    control.add_argument(
        "--load-collection-phase",
        choices=["all", "prefill", "decode"],
        default="all",
        help="which steps' load the window records",
    )
    control.add_argument(
        "--expert-bytes",
        type=non_negative,
        default=44_040_192,
        help="bytes of one expert's weights, to turn copies into bytes (DeepSeek-V3 at FP8)",
    )
    output = parser.add_argument_group("output")
    output.add_argument("--json", metavar="PATH", help="write the report as JSON")
    output.add_argument("--plot", metavar="PNG", help="write balancedness over time as a PNG")
    output.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)
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
    lines.append(UNITS_NOTE)
    return "\n".join(lines)


#: The table's units, printed under it: a byte figure without its scope reads as per rank.
UNITS_NOTE = (
    "units: GB/rebalance = cross-rank copies x --expert-bytes per rebalance, cluster-wide (all "
    "ranks; divide by --ranks for one rank's share); policy s = total policy seconds"
)


def _load_or_generate(args: argparse.Namespace) -> LoadTrace:
    from eplb_graph.simulate.trace import generate_trace, load_trace, spec_from_flags

    if args.trace:
        return load_trace(args.trace)
    if args.top_k > args.experts:
        raise UsageError(f"--top-k must be <= --experts ({args.experts}), got {args.top_k}")
    return generate_trace(spec_from_flags(args))


def check_cluster(trace: LoadTrace, cluster: ClusterShape, policies: list[str]) -> None:
    """Refuse a cluster shape the replay would fail on at its first rebalance (UsageError).

    The slots must split evenly over the ranks (the placement's own rule), hold at most one copy
    of an expert per rank (``map write``'s rule too: what is simulated can be written), and each
    policy must
    accept the shape: each plans one layer of skewed load from the initial placement here, so
    its own rules (the ``default`` policy's groups and nodes, for one) apply before the run.
    """
    import torch

    from eplb_graph.placement import Placement
    from eplb_graph.policy import rebalance
    from eplb_graph.policy.replica_cap import replica_room_problem
    from eplb_graph.tables import check_slots_per_rank

    num_slots = trace.num_experts + cluster.num_redundant
    check_slots_per_rank(
        num_slots,
        cluster.num_ranks,
        name=f"--ranks {cluster.num_ranks}: experts ({trace.num_experts}) + --num-redundant "
        f"({cluster.num_redundant})",
        error=UsageError,
    )
    # The one replica rule, shared with ``map write``: no shape that forces two copies of an
    # expert onto one rank (every policy's plan keeps to it when the shape has room).
    problem = replica_room_problem(trace.num_experts, num_slots, cluster.num_ranks)
    if problem is not None:
        raise UsageError(
            f"--ranks {cluster.num_ranks}, --num-redundant {cluster.num_redundant}: {problem}; "
            "lower --num-redundant or raise --ranks"
        )
    placement = Placement.default(1, trace.num_experts, cluster.num_redundant, cluster.num_ranks)
    skewed = torch.arange(trace.num_experts, 0, -1, dtype=torch.float64).unsqueeze(0)
    for policy in policies:
        try:
            rebalance(
                policy,
                skewed,
                num_slots,
                cluster.num_groups,
                cluster.num_nodes,
                cluster.num_ranks,
                old_phy2log=placement.phy2log,
            )
        except ValueError as error:  # the policies' shape checks
            raise UsageError(
                f"--policy {policy} cannot plan {trace.num_experts} experts on {num_slots} slots "
                f"over --ranks {cluster.num_ranks}, --nodes {cluster.num_nodes}, --groups "
                f"{cluster.num_groups}: {error}"
            ) from error


def _prepare(args: argparse.Namespace):
    """Everything the replay needs, checked: ``(trace, cluster, settings per policy)``."""
    from eplb_graph.policy import get_policy
    from eplb_graph.settings import RuntimeSettings
    from eplb_graph.simulate.simulator import ClusterShape

    if args.json is not None:
        check_destination(args.json, "--json")
    if args.plot is not None:
        check_plotting("--plot")
        check_destination(args.plot, "--plot")
    policies = args.policy or ["default"]
    for policy in policies:
        get_policy(policy)  # unknown names are a usage error, before any simulation
    trace = _load_or_generate(args)
    cluster = ClusterShape(
        num_redundant=args.num_redundant,
        num_ranks=args.ranks,
        num_nodes=args.nodes,
        num_groups=args.groups,
        expert_bytes=args.expert_bytes,
    )
    check_cluster(trace, cluster, policies)
    warn_if_window_capped(args.window_size, args.step_interval)
    settings = [
        RuntimeSettings(
            window_size=args.window_size,
            step_interval=args.step_interval,
            load_collection_phase=args.load_collection_phase,
            policy=policy,
        )
        for policy in policies
    ]
    return trace, cluster, settings


def run(args: argparse.Namespace) -> int:
    if args.windows:
        return _replay(args)
    from eplb_graph.simulate import simulator

    try:
        trace, cluster, settings = _prepare(args)
    except EplbError as error:
        return refuse(COMMAND, error)
    show_progress = not args.no_progress
    reports = [simulator.simulate(trace, s, cluster, progress=show_progress) for s in settings]
    sys.stdout.write(
        f"trace: {trace.num_steps} steps, {trace.num_layers} layers x {trace.num_experts} "
        f"experts, top-{trace.top_k}; {cluster.num_ranks} ranks, "
        f"{trace.num_experts + cluster.num_redundant} slots\n"
    )
    sys.stdout.write(_table(reports) + "\n")
    payload = {
        "trace": {
            "steps": trace.num_steps,
            "layers": trace.num_layers,
            "experts": trace.num_experts,
            "top_k": trace.top_k,
        },
        "reports": [report.as_dict() for report in reports],
    }
    try:
        if args.json:
            write_text_atomically(args.json, json.dumps(payload, indent=2) + "\n")
        if args.plot:
            write_file_atomically(args.plot, lambda path: simulator.plot_reports(reports, path))
    except OSError as error:  # checked before the run; the disk can still fill up or vanish
        return refuse(COMMAND, f"cannot write the report: {error}")
    return 0


def _replay(args: argparse.Namespace) -> int:
    """``--windows``: the engine's decisions and the replay's, window by window."""
    from eplb_graph.simulate.replay import replay_windows

    try:
        if args.json is not None:
            check_destination(args.json, "--json")
        report = replay_windows(args.windows)
    except (EplbError, OSError, ValueError) as error:
        return refuse(COMMAND, error)
    lines = [f"{'step':>8}  {'engine':<48} {'replay':<48} same"]
    for row in report.rows:
        engine, replay = (_cell(row["engine"]), _cell(row["replay"]))
        lines.append(
            f"{row['step']:>8}  {engine:<48} {replay:<48} {'yes' if row['same'] else 'NO'}"
        )
    summary = report.summary()
    lines.append(
        f"{summary['same_decisions']} of {summary['decisions']} decisions the same "
        f"({summary['windows']} windows)"
    )
    sys.stdout.write("\n".join(lines) + "\n")
    try:
        if args.json:
            payload = {"summary": summary, "rows": report.rows}
            write_text_atomically(args.json, json.dumps(payload, indent=2) + "\n")
    except OSError as error:
        return refuse(COMMAND, f"cannot write the report: {error}")
    return 0 if not report.differences else 1


def _cell(key) -> str:
    if key is None:
        return "-"
    action, candidate, reason = key
    text = f"{action}{f' {candidate}' if candidate else ''}: {reason}"
    return text if len(text) <= 48 else text[:45] + "..."
