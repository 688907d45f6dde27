"""Small deterministic MoE models used by the tests, the audit tool and the demo.

Names load on first use (``eplb_graph.lazy_exports``): the ``checkpoint`` command's parser
needs none of them.
"""

from __future__ import annotations

from eplb_graph.lazy_exports import lazy_exports

_TINY = "eplb_graph.models.tiny_moe"
_PUBLIC = {"TinyMoE": _TINY, "TinyMoEConfig": _TINY, "audit_target": _TINY}
__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = lazy_exports(__name__, globals(), _PUBLIC)
