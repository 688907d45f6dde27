"""``eplb-graph map``: check an expert-map file, or write one a model runner can start from.

``map write`` exists so a user can go from a shape (and, optionally, recorded traffic) to a map
without writing Python: the default placement, or one policy plan on a trace's total load,
written through the same writer (and the same validation) as ``Placement.save_expert_map``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from eplb_graph.cli_support import (
    UsageError,
    check_destination,
    int_at_least,
    policy_metavar,
    refuse,
    write_text_atomically,
)
from eplb_graph.errors import EplbError

if TYPE_CHECKING:
    import torch

VALIDATE = "eplb-graph map validate"
WRITE = "eplb-graph map write"


def _json_text(report: dict) -> str:
    return json.dumps(report, indent=2, sort_keys=True) + "\n"


def _print_summary(summary: dict) -> None:
    width = max(len(key) for key in summary)
    for key, value in summary.items():
        shown = json.dumps(value) if isinstance(value, dict) else value
        sys.stdout.write(f"  {key:<{width}}  {shown}\n")


def validate(args: argparse.Namespace) -> int:
    """Validate an expert-map file: 0 valid, 1 invalid content, 2 unreadable file.

    Exit 1 and 2 are kept apart so scripts can tell "fix the map" from "fix the path".
    """
    from eplb_graph.expert_map import ExpertMapError
    from eplb_graph.placement import Placement

    try:
        if args.json is not None:
            check_destination(args.json)
    except UsageError as error:
        return refuse(VALIDATE, error)
    report: dict = {"file": args.file, "valid": False, "error": None, "summary": None}
    try:
        placement = Placement.load_expert_map(args.file, num_logical=args.num_logical)
    except ExpertMapError as error:
        report["error"] = str(error)
        sys.stdout.write(f"invalid: {error}\n")
        status = 1
    except OSError as error:
        report["error"] = f"cannot read {args.file}: {error.strerror or error}"
        sys.stderr.write(f"{VALIDATE}: {report['error']}\n")
        status = 2
    else:
        report["valid"] = True
        report["summary"] = placement.summary()
        sys.stdout.write(f"valid: {args.file}\n")
        _print_summary(report["summary"])
        status = 0
    if args.json is None:
        return status
    try:
        write_text_atomically(args.json, _json_text(report))
    except OSError as error:
        return refuse(VALIDATE, f"cannot write --json {args.json}: {error.strerror or error}")
    return status


def trace_total_load(path: str) -> torch.Tensor:
    """A trace's logical load summed over all its steps, ``[L, N]`` float64."""
    import numpy as np
    import torch

    from eplb_graph.simulate.trace import load_trace

    trace = load_trace(path)
    tokens_per_segment = np.bincount(
        trace.segment, weights=trace.tokens.astype(np.float64), minlength=len(trace.popularity)
    )
    total = np.tensordot(tokens_per_segment, trace.popularity.astype(np.float64), axes=1)
    return torch.from_numpy(total)


def _planned(args: argparse.Namespace):
    """The placement to write (checked; nothing written yet)."""
    from eplb_graph.placement import Placement
    from eplb_graph.policy import get_policy, rebalance
    from eplb_graph.policy.replica_cap import replica_room_problem
    from eplb_graph.tables import check_slots_per_rank

    if args.policy is not None:
        get_policy(args.policy)  # an unknown name is a usage error, before the trace is read
    if args.trace is None:
        if args.policy is not None:
            raise UsageError(f"--policy {args.policy} plans on a load: pass --trace NPZ too")
        if args.layers is None or args.experts is None:
            raise UsageError("--layers and --experts are required without --trace")
        load = None
        layers, experts = args.layers, args.experts
    else:
        load = trace_total_load(args.trace)
        layers, experts = load.shape
        for option, given, actual in (
            ("--layers", args.layers, layers),
            ("--experts", args.experts, experts),
        ):
            if given is not None and given != actual:
                raise UsageError(
                    f"{option} {given} does not match the trace {args.trace} ({actual})"
                )
    num_slots = experts + args.redundant
    check_slots_per_rank(
        num_slots,
        args.ranks,
        name=f"--ranks {args.ranks}: experts ({experts}) + --redundant ({args.redundant})",
        error=UsageError,
    )
    # The one replica rule, shared with ``simulate``: no shape that forces two copies of an
    # expert onto one device (every policy's plan keeps to it when the shape has room).
    problem = replica_room_problem(experts, num_slots, args.ranks)
    if problem is not None:
        raise UsageError(
            f"--ranks {args.ranks}, --redundant {args.redundant}: {problem}; lower --redundant "
            "or raise --ranks"
        )
    placement = Placement.default(layers, experts, args.redundant, args.ranks)
    if load is None:
        return placement
    policy = args.policy or "default"
    try:
        phy2log = rebalance(
            policy, load, num_slots, args.groups, args.nodes, args.ranks, old_phy2log=None
        )
    except ValueError as error:  # the policies' shape checks
        raise UsageError(
            f"--policy {policy} cannot plan {experts} experts on {num_slots} slots over --ranks "
            f"{args.ranks}, --nodes {args.nodes}, --groups {args.groups}: {error}"
        ) from error
    return Placement(phy2log, experts, args.ranks)


def write(args: argparse.Namespace) -> int:
    """Write an expert map: 0 written, 2 usage, shape or unreadable trace (nothing written)."""
    try:
        check_destination(args.out, "OUT")
        placement = _planned(args)
        placement.save_expert_map(args.out)
    except EplbError as error:  # the map's own errors name the file
        return refuse(WRITE, error)
    except OSError as error:  # checked first; the disk can still fill up or vanish
        return refuse(WRITE, f"cannot write {args.out}: {error.strerror or error}")
    sys.stdout.write(f"wrote: {args.out}\n")
    _print_summary(placement.summary())
    return 0


def add_parser(commands) -> argparse.ArgumentParser:
    parser = commands.add_parser("map", help="expert-map JSON files (vllm-ascend schema)")
    map_commands = parser.add_subparsers(dest="map_command", required=True)
    checker = map_commands.add_parser(
        "validate",
        help="check an expert map; exit 0 valid, 1 invalid, 2 usage or I/O error",
        description="Check an expert-map file and print a summary (layers, devices, slots, "
        "redundancy, replica histogram). Exit status: 0 valid, 1 invalid, 2 usage or I/O error.",
    )
    checker.add_argument("file", metavar="FILE", help="expert-map JSON file")
    checker.add_argument(
        "--num-logical",
        type=int_at_least(1),
        metavar="N",
        help="the model's logical expert count (default: max id + 1, which cannot detect "
        "experts missing from every layer)",
    )
    checker.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    checker.set_defaults(handler=validate)

    writer = map_commands.add_parser(
        "write",
        help="write an expert map: the default placement, or a policy's plan for a trace",
        description="Write an expert map for --layers x --experts (+ --redundant) on --ranks "
        "devices. Without --trace: the default placement (slot p holds expert p, redundant "
        "slots repeat experts from 0). With --trace: --policy's plan for the trace's load "
        "summed over all its steps. The map is validated before it is written, atomically. "
        "Exit status: 0 written, 2 usage, shape or unreadable trace (nothing written).",
    )
    writer.add_argument("out", metavar="OUT", help="expert-map JSON file to write")
    writer.add_argument(
        "--layers",
        type=int_at_least(1),
        metavar="L",
        help="MoE layers (required without --trace; with it, must match the trace)",
    )
    writer.add_argument(
        "--experts",
        type=int_at_least(1),
        metavar="N",
        help="logical experts (required without --trace; with it, must match the trace)",
    )
    writer.add_argument(
        "--redundant", type=int_at_least(0), default=0, metavar="R", help="redundant slots"
    )
    writer.add_argument(
        "--ranks",
        type=int_at_least(1),
        required=True,
        metavar="D",
        help="EP ranks, the map's devices (experts + redundant must divide by it)",
    )
    writer.add_argument(
        "--trace", metavar="NPZ", help="plan on this load trace (eplb-graph simulate's format)"
    )
    writer.add_argument(
        "--policy",
        metavar=policy_metavar(),
        help="policy that plans on --trace (default: default, when --trace is given)",
    )
    writer.add_argument(
        "--nodes", type=int_at_least(1), default=1, help="nodes, for the default policy"
    )
    writer.add_argument(
        "--groups", type=int_at_least(1), default=1, help="expert groups, for the default policy"
    )
    writer.set_defaults(handler=write)
    return parser
