"""``python -m eplb_graph.demo [options]`` — the torchrun entry: ``torchrun --nproc-per-node 2
-m eplb_graph.demo --steps 60 --json out.json`` (same options as ``eplb-graph demo``)."""

from eplb_graph.cli import main

if __name__ == "__main__":
    import sys

    raise SystemExit(main(["demo", *sys.argv[1:]]))
