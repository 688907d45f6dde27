"""``eplb-graph demo``: the end-to-end job (spawned ranks, or one rank under torchrun)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

from eplb_graph.cli_support import (
    check_destination,
    check_plotting,
    policy_metavar,
    refuse,
    warn_if_window_capped,
    write_file_atomically,
    write_text_atomically,
)
from eplb_graph.demo.options import (
    COMPILE_BACKENDS,
    INTEGER_FIELDS,
    DemoOptions,
    option_defaults,
)
from eplb_graph.errors import EplbError
from eplb_graph.models.formats import FORMATS
from eplb_graph.progress import NO_PROGRESS_HELP

COMMAND = "eplb-graph demo"
logger = logging.getLogger(__name__)


# The integer flags' help, in --help order; each flag's spelling comes from INTEGER_FIELDS (the
# checks' own table) and its default from DemoOptions, so neither is written a second time here.
_MODEL_FLAGS_HELP = {
    "ranks": "EP ranks to spawn (>= 2); under torchrun WORLD_SIZE is used instead",
    "steps": "serving steps",
    "layers": "MoE layers",
    "experts": "logical experts; experts + redundant must divide by ranks",
    "redundant": "redundant slots (>= 0)",
    "hidden": "hidden size",
    "intermediate": "expert intermediate size",
    "top_k": "experts per token (at most --experts)",
}
_SCHEDULE_FLAGS_HELP = {
    "window_size": "steps of load each plan sees (capped at --step-interval)",
    "step_interval": "steps between rearrangements",
    "layers_per_step": "layers committed at one agreed step",
}


def _integer_options(option, defaults: argparse.Namespace, helps: dict[str, str]) -> None:
    """Add one ``type=int`` flag per :class:`DemoOptions` field in ``helps``."""
    for name, text in helps.items():
        option(INTEGER_FIELDS[name][0], type=int, default=getattr(defaults, name), help=text)


def add_parser(commands) -> argparse.ArgumentParser:
    defaults = argparse.Namespace(**option_defaults())  # no instance: its checks import torch
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
    option = parser.add_argument
    _integer_options(option, defaults, _MODEL_FLAGS_HELP)
    option(
        "--format",
        dest="weight_format",
        choices=FORMATS,
        default=defaults.weight_format,
        help="expert weight format: fp32 weights, or int8 weights with scales",
    )
    option(
        "--policy",
        metavar=policy_metavar(),
        default=defaults.policy,
        help="rebalance policy ('random' is a test policy)",
    )
    option(
        "--rearrange",
        choices=("always", "when_it_pays"),
        default=defaults.rearrange,
        help="always: apply every plan (the demo's default, to show movement); when_it_pays: "
        "only plans the expert cost model predicts repay their move (vLLM's default)",
    )
    _integer_options(option, defaults, _SCHEDULE_FLAGS_HELP)
    option(
        "--backend",
        choices=COMPILE_BACKENDS,
        default=defaults.backend,
        help="torch.compile backend (fullgraph=True, dynamic=False)",
    )
    _integer_options(option, defaults, {"seed": "seed of the weights and the traffic"})
    option("--json", metavar="PATH", help="write the report as JSON")
    option(
        "--plot",
        metavar="PNG",
        default="eplb-demo.png",
        help="write balancedness over time and per-rank load as a PNG (needs matplotlib)",
    )
    option("--no-plot", action="store_true", help="do not write the plot")
    option("--no-progress", action="store_true", help=NO_PROGRESS_HELP)
    parser.set_defaults(handler=run)
    return parser


def options_from_args(args: argparse.Namespace, ranks: int | None = None) -> DemoOptions:
    """The run's options; :class:`DemoOptionError` names the first flag the ranks could not use."""
    flags = {name: getattr(args, name) for name in option_defaults() if hasattr(args, name)}
    if ranks is not None:
        flags["ranks"] = ranks
    return DemoOptions(**flags, progress=not args.no_progress)


def check_outputs(args: argparse.Namespace) -> None:
    """Refuse report destinations the run could not write, before the run (UsageError)."""
    if args.json is not None:
        check_destination(args.json, "--json")
    if not args.no_plot:
        check_plotting("--plot")
        check_destination(args.plot, "--plot")


def run(args: argparse.Namespace) -> int:
    """Validate everything, then run the ranks; see the module docstring of ``eplb_graph.cli``
    for the exit statuses."""
    from eplb_graph.launch import launched_by_torchrun

    torchrun = launched_by_torchrun()
    try:
        options = options_from_args(args, ranks=int(os.environ["WORLD_SIZE"]) if torchrun else None)
        if not torchrun or os.environ["RANK"] == "0":  # only rank 0 writes the report
            check_outputs(args)
            warn_if_window_capped(options.window_size, options.step_interval)
    except EplbError as error:
        return refuse(COMMAND, error)
    report = _run_torchrun(options) if torchrun else _run_spawned(options)
    if isinstance(report, int):
        return report
    return emit(report, args)


def _run_torchrun(options: DemoOptions) -> dict | int:
    from eplb_graph.demo.runner import run_rank
    from eplb_graph.launch import run_under_torchrun

    # The demo model runs on the CPU: its serving collectives use gloo even where a GPU is
    # visible (EPLB's own groups are gloo in every case). torchrun owns these processes' signals.
    report = run_under_torchrun(run_rank, options, backend="gloo")
    return 0 if report is None else report  # not rank 0: rank 0 reports


def _run_spawned(options: DemoOptions) -> dict | int:
    """Rank 0's report, or the exit status of a run that could not finish (one stderr line)."""
    from eplb_graph.demo.runner import run_rank
    from eplb_graph.launch import RankFailed, RanksInterrupted, spawn_ranks

    try:
        return spawn_ranks(run_rank, options.ranks, options)[0]
    except KeyboardInterrupt:
        sys.stderr.write(f"{COMMAND}: interrupted by SIGINT; every rank was stopped\n")
        return 128 + signal.SIGINT
    except RanksInterrupted as stop:
        sys.stderr.write(f"{COMMAND}: {stop}\n")
        return stop.exit_status
    except RankFailed as failure:
        if failure.details:
            logger.info("%s", failure.details)
        hint = "; rerun with -v for its traceback" if failure.details else ""
        sys.stderr.write(f"{COMMAND}: {failure.summary}; the other ranks were stopped{hint}\n")
        return 1


def emit(report: dict, args: argparse.Namespace) -> int:
    from eplb_graph.demo.report import plot, summary_table

    sys.stdout.write(summary_table(report) + "\n")
    try:
        if args.json:
            write_text_atomically(args.json, json.dumps(report, indent=2) + "\n")
        if not args.no_plot:
            write_file_atomically(args.plot, lambda path: plot(report, path))
            sys.stdout.write(f"plot: {args.plot}\n")
    except OSError as error:  # checked before the run; the disk can still fill up or vanish
        return refuse(COMMAND, f"cannot write the report: {error}")
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
