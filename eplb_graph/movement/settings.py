"""``MovementSettings``: how the movement plane stages, agrees and commits, as plain values."""

from __future__ import annotations

from dataclasses import dataclass

from eplb_graph.arguments import SettingsError, as_int, as_seconds


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
    """

    layers_per_step: int = 1
    commit_margin_steps: int = 8
    exchange_timeout_s: float = 30.0
    agree_timeout_s: float = 30.0
    install_wait_s: float = 120.0
    max_batch_ops: int = 32
    staging_blocks: int | None = None

    def __post_init__(self) -> None:
        for name in ("layers_per_step", "commit_margin_steps", "max_batch_ops"):
            as_int(name, getattr(self, name), minimum=1, error=SettingsError)
        for name in ("exchange_timeout_s", "agree_timeout_s", "install_wait_s"):
            as_seconds(name, getattr(self, name), error=SettingsError)
        if self.staging_blocks is not None:
            as_int("staging_blocks", self.staging_blocks, minimum=1, error=SettingsError)

    @property
    def num_staging_blocks(self) -> int:
        return self.staging_blocks or 2 * self.layers_per_step
