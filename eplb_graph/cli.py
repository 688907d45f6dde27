"""``eplb-graph`` command line entry point.

Subcommands land with the issues that build them; each takes ``--json PATH`` for a
machine-readable report and exits 0 on success.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

logger = logging.getLogger("eplb_graph.cli")


def _write_json(path: str | None, report: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")


def _info(args: argparse.Namespace) -> int:
    """Report the op library's state on this machine: where each device's calls go."""
    import custom_ops
    from eplb_graph.testing import available_graph_modes

    if args.build_native:
        custom_ops.native.ensure_loaded()
    report = {
        "torch": torch.__version__,
        "native_cpu_kernel": custom_ops.native.status().value,
        "native_failure": custom_ops.native.failure_reason(),
        "ops": sorted(custom_ops.op_handles()),
        "graph_modes": available_graph_modes(),
        "cuda_available": torch.cuda.is_available(),
    }
    width = max(len(key) for key in report)
    for key, value in report.items():
        sys.stdout.write(f"{key:<{width}}  {value}\n")
    _write_json(args.json, report)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eplb-graph",
        description="Graph-capture-first Expert Parallelism Load Balancer for MoE inference.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="show the op library's kernels and graph modes")
    info.add_argument(
        "--build-native", action="store_true", help="build/load the native CPU kernel first"
    )
    info.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    info.set_defaults(handler=_info)
    return parser


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
