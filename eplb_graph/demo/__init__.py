"""The end-to-end demo: a compiled multi-rank MoE with async EPLB (``eplb-graph demo``)."""

from eplb_graph.demo.runner import DemoOptions, run_rank

__all__ = ["DemoOptions", "run_rank"]
