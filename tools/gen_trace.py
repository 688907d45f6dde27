"""Generate a synthetic load trace for ``eplb-graph simulate --trace``.

Example: ``python tools/gen_trace.py --out trace.npz --steps 20000 --shape zipf --skew 1.0``.
The format is documented in ``eplb_graph/simulate/trace.py`` and ``docs/operations.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eplb_graph.simulate.trace import SPEC_FLAGS, TraceSpec, generate_trace, save_trace

#: ``eplb-graph simulate``'s option names for the fields it shares, so one vocabulary works for
#: both tools; the ``--num-*`` spellings stay as deprecated aliases (older docs and scripts).
OPTION_NAMES = {field: f"--{flag}" for field, flag in SPEC_FLAGS.items()}


class _DeprecatedAlias(argparse.Action):
    """Stores the value like the option it stands for, and says which name to use instead."""

    def __call__(self, parser, namespace, values, option_string=None):
        sys.stderr.write(
            f"gen_trace.py: {option_string} is deprecated; use {self.metavar_name} "
            "(the name eplb-graph simulate uses)\n"
        )
        setattr(namespace, self.dest, values)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output .npz path")
    for name, value in vars(TraceSpec()).items():
        option = OPTION_NAMES.get(name, f"--{name.replace('_', '-')}")
        parser.add_argument(option, dest=name, type=type(value), default=value)
        if name in OPTION_NAMES:
            alias = f"--{name.replace('_', '-')}"
            action = parser.add_argument(
                alias, dest=name, type=type(value), action=_DeprecatedAlias, help=argparse.SUPPRESS
            )
            action.metavar_name = option
    return parser


def main(argv: list[str] | None = None) -> int:
    defaults = TraceSpec()
    args = build_parser().parse_args(argv)
    spec = TraceSpec(**{name: getattr(args, name) for name in vars(defaults)})
    trace = generate_trace(spec)
    save_trace(trace, args.out)
    print(f"wrote {args.out}: {trace.num_steps} steps, {trace.num_layers} x {trace.num_experts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
