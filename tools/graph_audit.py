"""Graph-safety audit of a model: ``python tools/graph_audit.py [TARGET] [--json PATH]``.

Same as ``eplb-graph audit`` (exit 0 clean, 1 findings, 2 usage or import error); kept as a
script for checkouts where the package is not installed.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eplb_graph.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["audit", *sys.argv[1:]]))
