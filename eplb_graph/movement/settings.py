"""``MovementSettings``: how the movement plane stages, agrees and commits, as plain values."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MovementSettings:
    layers_per_step: int = 1  # layers committed together at one agreed step
    commit_margin_steps: int = 8  # fence distance: steps a decision may take before a veto
    exchange_timeout_s: float = 30.0
    agree_timeout_s: float = 30.0
    max_batch_ops: int = 32
    staging_blocks: int | None = None  # default: 2 x layers_per_step (stage ahead of commit)

    def __post_init__(self) -> None:
        for name in ("layers_per_step", "commit_margin_steps", "max_batch_ops"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.exchange_timeout_s <= 0 or self.agree_timeout_s <= 0:
            raise ValueError("timeouts must be positive")

    @property
    def num_staging_blocks(self) -> int:
        return self.staging_blocks or 2 * self.layers_per_step
