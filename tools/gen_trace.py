"""Generate a synthetic load trace for ``eplb-graph simulate --trace``.

Example: ``python tools/gen_trace.py --out trace.npz --steps 20000 --shape zipf --skew 1.0``.
The format is documented in ``eplb_graph/simulate/trace.py`` and ``docs/user-guide.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eplb_graph.simulate.trace import TraceSpec, generate_trace, save_trace


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output .npz path")
    defaults = TraceSpec()
    for name, value in vars(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = parser.parse_args()
    spec = TraceSpec(**{name: getattr(args, name) for name in vars(defaults)})
    trace = generate_trace(spec)
    save_trace(trace, args.out)
    print(f"wrote {args.out}: {trace.num_steps} steps, {trace.num_layers} x {trace.num_experts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
