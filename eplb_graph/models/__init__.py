"""Small deterministic MoE models used by the tests, the audit tool and the demo."""

from eplb_graph.models.tiny_moe import TinyMoE, TinyMoEConfig, audit_target

__all__ = ["TinyMoE", "TinyMoEConfig", "audit_target"]
