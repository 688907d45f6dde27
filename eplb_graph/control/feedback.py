"""What serving measured, gathered per step for the planner: the evidence a plan must answer to.

The controller times every step (from ``begin_step`` to ``end_step``: the forward and whatever
the runner does before ending the step) and reads the expert op's own counters. Per step that is
a few host reads and additions (no collective, no device sync: ``expert_stats`` is read only
where it lives on the host). At a window close the figures become one int64 vector that rides
along in the window reduction the pipeline already does, so every rank plans on the same sums
(plans are agreed by digest).

Three things are gathered:

- **cost samples**: per layer and step, the expert op's ``(rows, active slots, µs)`` deltas, for
  :class:`~eplb_graph.control.cost_model.ExpertCostModel` (decode steps with no rearrangement in
  flight only: a worker copying weights on the same core would inflate them);
- **placement epochs**: serving step time and tokens of decode steps under the placement
  committed now (``current``) and under the one before it (``previous``), with no rearrangement
  in flight; an epoch ends when the committed placement changes. This is how a plan that made
  steps slower is found and undone;
- **movement cost**: the time steps took beyond the current epoch's mean while a rearrangement
  was in flight (asynchronous), or the time the window close itself took when it moved weights
  inline (synchronous): what a rearrangement cost serving, to weigh the next one against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eplb_graph.control.cost_model import MOMENTS, CostMoments

__all__ = ["FEEDBACK_SIZE", "Epoch", "ServingFeedback", "WindowFeedback"]

_HEAD = 3  # ranks, recorded steps, ranks that recorded
_EPOCH = 3  # decode steps, Σ step µs, Σ tokens
FEEDBACK_SIZE = _HEAD + MOMENTS + 2 * _EPOCH + 3
"""Length of the int64 vector a rank contributes to a window's reduction."""


@dataclass(frozen=True)
class Epoch:
    """Decode steps under one committed placement, with no rearrangement in flight."""

    steps: int
    step_us: int
    tokens: int

    @property
    def mean_step_us(self) -> float | None:
        return self.step_us / self.steps if self.steps else None

    @property
    def mean_tokens(self) -> float | None:
        return self.tokens / self.steps if self.steps else None


@dataclass(frozen=True)
class WindowFeedback:
    """The reduced vector of one window, identical on every rank (sums over ranks)."""

    ranks: int
    recorded_steps: int
    recording_ranks: int
    moments: torch.Tensor
    previous: Epoch
    current: Epoch
    epoch_index: int
    movement_extra_us: int
    movement_steps: int

    @classmethod
    def parse(cls, vector: torch.Tensor) -> WindowFeedback:
        v = [int(x) for x in torch.as_tensor(vector).tolist()]
        if len(v) != FEEDBACK_SIZE:
            raise ValueError(f"feedback vector has {len(v)} values, expected {FEEDBACK_SIZE}")
        ranks = max(1, v[0])
        at = _HEAD + MOMENTS
        previous = Epoch(*v[at : at + _EPOCH])
        current = Epoch(*v[at + _EPOCH : at + 2 * _EPOCH])
        epoch_sum, extra, moved = v[at + 2 * _EPOCH :]
        return cls(
            ranks=ranks,
            recorded_steps=v[1],
            recording_ranks=v[2],
            moments=torch.tensor(v[_HEAD:at], dtype=torch.int64),
            previous=previous,
            current=current,
            epoch_index=epoch_sum // ranks,
            movement_extra_us=extra // ranks,
            movement_steps=moved // ranks,
        )

    @property
    def steps_per_rank(self) -> float:
        """Steps whose load the window holds (each recording rank counts the same steps)."""
        return self.recorded_steps / self.recording_ranks if self.recording_ranks else 0.0


class ServingFeedback:
    """The per-step side of :class:`WindowFeedback`, owned by the controller's (serving) thread.

    Args:
        expert_stats: ``EplbState.expert_stats`` (``[L, 3]``: rows, ns, active slots). Read only
            when it is a host tensor with the active-slot column; elsewhere no cost samples are
            taken (the model then has only what calibration gave it).
    """

    def __init__(self, expert_stats: torch.Tensor) -> None:
        self._stats = expert_stats
        self._samples = expert_stats.device.type == "cpu" and expert_stats.shape[-1] >= 3
        self._seen = expert_stats.detach().to("cpu", copy=True)
        self.moments = CostMoments()
        self.epoch_index = 0
        self._version: int | None = None
        self._current = [0, 0, 0]
        self._previous = [0, 0, 0]
        self.movement_extra_us = 0
        self.movement_steps = 0

    def calibrate(self, rows, active, micros) -> None:
        """Add calls measured outside serving (a calibration at attach)."""
        self.moments.add(rows, active, micros)

    def step(
        self, *, step_us: int, tokens: int, decode: bool, in_flight: bool, version: int
    ) -> None:
        """One served step: its time, valid tokens, batch phase, whether a rearrangement was in
        flight, and the committed placement version it ran under."""
        usable = decode and not in_flight
        self._take_cost_samples(usable)
        if in_flight:
            mean = self._mean_current()
            if mean is not None:
                self.movement_extra_us += max(0, step_us - int(mean))
                self.movement_steps += 1
            return
        if version != self._version:
            if self._version is not None:
                self._roll_epoch()
            self._version = version
        if decode:
            self._current[0] += 1
            self._current[1] += step_us
            self._current[2] += tokens

    def moved_inline(self, micros: int) -> None:
        """A synchronous rearrangement ran inside a step and took ``micros`` µs."""
        self.movement_extra_us += max(0, micros)
        self.movement_steps += 1

    def take(self, recorded_steps: int) -> torch.Tensor:
        """The vector this rank contributes to the window's reduction; ages the cost samples."""
        head = [1, recorded_steps, 1 if recorded_steps > 0 else 0]
        tail = [self.epoch_index, self.movement_extra_us, self.movement_steps]
        vector = torch.tensor(
            head + self.moments.values.tolist() + self._previous + self._current + tail,
            dtype=torch.int64,
        )
        self.moments.halve_()
        return vector

    def _mean_current(self) -> float | None:
        steps, micros, _ = self._current
        return micros / steps if steps else None

    def _roll_epoch(self) -> None:
        if self._current[0]:
            self._previous = self._current
        self._current = [0, 0, 0]
        self.epoch_index += 1

    def _take_cost_samples(self, usable: bool) -> None:
        if not self._samples:
            return
        now = self._stats.detach().clone()
        delta = now - self._seen
        self._seen = now
        if not usable:
            return
        timed = delta[:, 1] > 0
        if not bool(timed.any()):
            return
        delta = delta[timed]
        self.moments.add(delta[:, 0].numpy(), delta[:, 2].numpy(), (delta[:, 1] // 1000).numpy())


def empty_feedback() -> torch.Tensor:
    """A rank's vector when it has nothing to say (a failed fold still joins the reduction)."""
    return torch.zeros(FEEDBACK_SIZE, dtype=torch.int64)
