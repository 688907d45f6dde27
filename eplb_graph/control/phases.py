"""Batch phases and the load-collection phase filter.

A batch's phase is decided once per step: any prefill request makes the whole batch a prefill
batch (token counts are not consulted). A batch outside the configured collection phase
contributes zero load, but it still advances the window and takes part in every collective, so
all ranks keep taking the same steps whatever their local batch is.
"""

from __future__ import annotations

import enum


class BatchPhase(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"

    @classmethod
    def of_batch(cls, has_prefill: bool) -> BatchPhase:
        return cls.PREFILL if has_prefill else cls.DECODE


class CollectionPhase(enum.Enum):
    """Which batches' load is collected (``load_collection_phase``)."""

    ALL = "all"
    PREFILL = "prefill"
    DECODE = "decode"

    @classmethod
    def parse(cls, value: str | CollectionPhase) -> CollectionPhase:
        if isinstance(value, CollectionPhase):
            return value
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(repr(member.value) for member in cls)
            raise ValueError(
                f"load_collection_phase must be one of {choices}, got {value!r}"
            ) from None

    def collects(self, phase: BatchPhase) -> bool:
        return self is CollectionPhase.ALL or self.value == phase.value
