"""The end-to-end demo: a compiled multi-rank MoE with async EPLB (``eplb-graph demo``).

Names load on first use (``eplb_graph.lazy_exports``): the command line builds its parser from
``demo.command`` and ``demo.options`` without importing torch.
"""

from __future__ import annotations

from eplb_graph.lazy_exports import lazy_exports

_PUBLIC = {"DemoOptions": "eplb_graph.demo.options", "run_rank": "eplb_graph.demo.runner"}
__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = lazy_exports(__name__, globals(), _PUBLIC)
