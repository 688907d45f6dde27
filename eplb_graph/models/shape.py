"""``MoEShape``: the sizes a MoE stack is built from, spelled once for the package's models.

Kept free of torch so that a caller that only describes a model (the demo's options, checked in
the parent before any rank starts) can name it without importing a tensor library.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoEShape:
    """Layers, hidden size, expert intermediate size, logical experts and picks per token.

    A model's config extends this instead of re-declaring the five fields, so every model
    names them the same, in the same order (positional construction stays interchangeable), and
    refuses a ``top_k`` its router could not pick (``torch.topk`` over fewer experts than ``k``)
    with one message, at construction rather than inside a compiled graph.

    The fields have no defaults: a model's defaults belong to whoever chooses the model (the
    demo's options, for the demo model), not to a second copy here.
    """

    num_layers: int
    hidden: int
    intermediate: int
    num_experts: int
    top_k: int

    def __post_init__(self) -> None:
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
