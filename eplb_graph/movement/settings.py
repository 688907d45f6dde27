"""``MovementSettings``: how the movement plane stages, agrees and commits, as plain values."""

from __future__ import annotations

from dataclasses import dataclass, replace

from eplb_graph.arguments import SettingsError, as_int, as_seconds

DEFAULT_STAGING_BUDGET_BYTES = 16 << 30


@dataclass(frozen=True)
class MovementSettings:
    """Args:
    layers_per_step: layers committed together at one agreed step.
    commit_margin_steps: fence distance: serving steps a commit decision may take before the
        main thread vetoes it. The smallest distance: after a veto the worker doubles it (up to
        64 times this), and every commit shrinks it back by an eighth.
    exchange_timeout_s: longest wait for a peer in a point-to-point batch.
    agree_timeout_s: longest wait for a collective (window reduction, group probe) and, with
        ``exchange_timeout_s``, for the votes of a decision.
    install_wait_s: longest the worker waits for *its own* main thread to install earlier
        layers (a staging block back, or every block free before the next rearrangement). That
        wait ends when serving reaches the agreed commit steps, so it is sized in serving time,
        not in peer latency: a slow step rate must not abort a healthy rearrangement.
    max_batch_ops: transfers per exchange batch across the whole group.
    staging_blocks: staging blocks (default ``2 x layers_per_step``: stage ahead of commit).
    staging_budget_bytes: the most CPU memory the staging blocks may take. Each block holds
        ``2 x slots_per_rank x slot_nbytes`` bytes, allocated once at start-up; a runtime whose
        blocks would exceed this fails there with :class:`StagingBudgetError` (never an
        out-of-memory kill later). The default, 16 GiB, holds the default two blocks of a
        DeepSeek-V3-sized bf16 layer at 8 EP ranks (about 12 GB).

    A model with fewer layers than ``layers_per_step`` or the block count gets no more than it
    can use (:meth:`for_layers`): a rearrangement stages at most every layer once.
    """

    layers_per_step: int = 1
    commit_margin_steps: int = 8
    exchange_timeout_s: float = 30.0
    agree_timeout_s: float = 30.0
    install_wait_s: float = 120.0
    max_batch_ops: int = 32
    staging_blocks: int | None = None
    staging_budget_bytes: int = DEFAULT_STAGING_BUDGET_BYTES

    def __post_init__(self) -> None:
        for name in ("layers_per_step", "commit_margin_steps", "max_batch_ops"):
            as_int(name, getattr(self, name), minimum=1, error=SettingsError)
        for name in ("exchange_timeout_s", "agree_timeout_s", "install_wait_s"):
            as_seconds(name, getattr(self, name), error=SettingsError)
        if self.staging_blocks is not None:
            as_int("staging_blocks", self.staging_blocks, minimum=1, error=SettingsError)
        as_int(
            "staging_budget_bytes",
            self.staging_budget_bytes,
            minimum=1,
            maximum=None,
            error=SettingsError,
        )

    @property
    def num_staging_blocks(self) -> int:
        return self.staging_blocks or 2 * self.layers_per_step

    def for_layers(self, num_layers: int) -> MovementSettings:
        """These settings capped by a model of ``num_layers`` MoE layers.

        A chunk never holds more layers than the model has, and a rearrangement stages each
        changed layer once, so more than ``num_layers`` blocks would never be used: a
        ``layers_per_step`` of 65536 on a 2-layer model must not allocate 131072 blocks.
        """
        as_int("num_layers", num_layers, minimum=1, error=SettingsError)
        layers = min(self.layers_per_step, num_layers)
        blocks = min(self.staging_blocks or 2 * layers, num_layers)
        return replace(self, layers_per_step=layers, staging_blocks=max(blocks, layers))
