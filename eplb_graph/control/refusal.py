"""The payback gate's memory of its last refusal: a window like it is refused on its word.

Pricing (the policy's plan, the packer, the priced moves) is most of a window's work, and it runs
on the cores that serve; at a small uniform batch the saving bound stays just above one copy's
cost window after window while no candidate comes near it, so every window paid for the same
refusal. A window is refused without pricing while the last priced refusal still answers it:
the same committed placement, a price of a copy no lower, a saving bound not grown past
:data:`REPRICE_GROWTH` times its own, and fewer than :data:`MAX_UNPRICED` windows kept on its
word.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MAX_UNPRICED", "REPRICE_GROWTH", "Refusal", "RefusalMemory"]

REPRICE_GROWTH = 1.25
"""A window whose saving bound is more than this many times the refused one's is priced again
(its load moved toward a skew a plan could use) ..."""
MAX_UNPRICED = 7
"""... and so is every window after this many kept in a row on the last pricing's word."""


@dataclass
class Refusal:
    """The last window whose candidates were all priced and none repaid, and what it was
    priced under."""

    step: int
    committed: torch.Tensor
    copy_us: float
    bound_us: float
    unpriced: int = 0


class RefusalMemory:
    def __init__(self) -> None:
        self.last: Refusal | None = None

    def remember(self, step: int, committed: torch.Tensor, copy_us: float, bound_us: float) -> None:
        self.last = Refusal(step, committed, copy_us, bound_us)

    def answers(self, committed: torch.Tensor, copy_us: float, bound_us: float) -> bool:
        """Whether the last refusal answers a window (see the module docstring); counts it."""
        refusal = self.last
        if (
            refusal is None
            or refusal.unpriced >= MAX_UNPRICED
            or copy_us < refusal.copy_us
            or bound_us > REPRICE_GROWTH * refusal.bound_us
            or not torch.equal(refusal.committed, committed)
        ):
            return False
        refusal.unpriced += 1
        return True
