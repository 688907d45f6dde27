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
  flight only: a worker copying weights on the same core would inflate them). Once a model is
  fitted, a call that took more than :data:`OUTLIER_FACTOR` times its prediction is left out:
  on a shared core a call the scheduler preempted can take ten times its work, and least squares
  would bend every coefficient toward such a call (one of them once put a fit's error at 230% of
  the mean call). What serving pays for preemption is no placement's doing;
- **placement epochs**: serving step time and tokens of decode steps under the placement
  committed now (``current``) and under the one before it (``previous``), with no rearrangement
  in flight; an epoch ends when the committed placement changes. This is how a plan that made
  steps slower is found and undone;
- **movement cost**: the time decode steps took, while a rearrangement was *moving weights*
  (asynchronous), beyond the mean of the last :data:`REFERENCE_STEPS` idle decode steps under
  the committed placement, or the time the window close itself took when it moved weights inline
  (synchronous): what a rearrangement cost serving, to weigh the next one against. Only moving
  counts: every window close hands the worker a job, and the steps while it merely reduces and
  plans (and then keeps the placement) are no move's cost; counted against the copies applied,
  they once tripled the measured price of a copy within an hour of serving and kept every later
  plan out. A moving step is priced only where its idle time is known (a decode step at a batch
  within :data:`COMPARABLE_TOKENS` of the reference's); the others (prefills, a batch that grew)
  are counted, and the priced steps' extra is scaled up to them. The extra is summed *signed*:
  a moving step faster than the reference takes off what a slower one added, so step noise
  cancels instead of adding up (see :data:`REFERENCE_STEPS`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from eplb_graph.control.cost_model import MOMENTS, CostMoments, ExpertCostModel

__all__ = ["Epoch", "ServingFeedback", "WindowFeedback", "feedback_size"]

_HEAD = 3  # ranks, recorded steps, ranks that recorded
_EPOCH = 4  # decode steps, Σ step µs, Σ tokens, Σ (step µs / 10)²
_TAIL = 4  # epoch index, movement extra µs, moving steps priced, moving steps in all
_WINDOW = 2  # window steps timed, ranks whose placement changed during the window

COMPARABLE_TOKENS = 0.2
"""Two batches are comparable when their mean tokens differ by at most this share: a moving
step is priced against its epoch's mean step, and a plan judged against the one before it, only
then (a larger batch is slower whatever the placement or the movement)."""
WARMUP_STEPS = 16
"""A window holding any of a rank's first steps is not measured: those pay one-off costs
(lazily compiled kernels, first allocations), and a placement measured there would be
remembered as far slower than it is (the starting placement was, 1.9x, on the drift
benchmark)."""
REFERENCE_STEPS = 32
"""A moving step is set against the mean of this many idle decode steps served just before it,
under the placement the move starts from. The whole epoch's mean was the reference before, and
each step's extra was counted only where positive: on a host whose steps vary by a tenth, half
the moving steps then added noise and none took it off, and an epoch that began under other
traffic set its steps against a batch of another cost. On the drift benchmark that priced a
3 MiB copy at 8 to 13 ms while a profile of the worker and the installs put their CPU time
below 1 ms per copy, and the gate refused moves that would have repaid."""
OUTLIER_FACTOR = 3.0
"""A call slower than this many times the fitted model's prediction is not a cost sample."""
OUTLIER_MIN_US = 1000
"""... and only when it is at least this much slower (µs): a short call's jitter is no outlier."""


def comparable_batches(tokens: float, reference: float) -> bool:
    """Whether ``tokens`` per step is within :data:`COMPARABLE_TOKENS` of ``reference``."""
    return abs(tokens - reference) <= COMPARABLE_TOKENS * max(reference, 1.0)


def feedback_size(num_ranks: int, num_layers: int = 1) -> int:
    """Length of the int64 vector a rank contributes to a window's reduction: the fixed part,
    then one cell per layer and rank for that rank's expert µs in that layer over the window's
    steps (layer-major)."""
    return _HEAD + MOMENTS + 2 * _EPOCH + _TAIL + _WINDOW + num_layers * num_ranks


@dataclass(frozen=True)
class Epoch:
    """Decode steps under one committed placement, with no rearrangement in flight."""

    steps: int
    step_us: int
    tokens: int
    squares: int = 0
    """Σ (step µs / 10)², for the spread of the step times (10 µs units keep a day of steps of a
    second summed over eight ranks inside int64)."""

    @property
    def mean_step_us(self) -> float | None:
        return self.step_us / self.steps if self.steps else None

    def mean_error_us(self, ranks: int) -> float | None:
        """Standard error of :attr:`mean_step_us` (µs). Every rank times the same steps (they run
        in lockstep), so the sample is the steps of one rank, not of all of them."""
        if self.steps < 2:
            return None
        mean = self.step_us / self.steps / 10
        variance = max(0.0, self.squares / self.steps - mean * mean) * 100
        return (variance / max(1, self.steps // max(1, ranks))) ** 0.5

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
    movement_steps_all: int = 0
    window_steps: int = 0
    window_mixed: bool = False
    window_expert_us: tuple = ()
    """Expert µs over the window's steps, per layer and rank (layer-major: ``l * ranks + r``)."""

    @classmethod
    def parse(cls, vector: torch.Tensor) -> WindowFeedback:
        v = [int(x) for x in torch.as_tensor(vector).tolist()]
        fixed = feedback_size(0)
        if len(v) <= fixed:
            raise ValueError(f"feedback vector has {len(v)} values, expected more than {fixed}")
        ranks = max(1, v[0])
        at = _HEAD + MOMENTS
        moments = torch.tensor(v[_HEAD:at], dtype=torch.int64)
        previous = Epoch(*v[at : at + _EPOCH])
        current = Epoch(*v[at + _EPOCH : at + 2 * _EPOCH])
        at += 2 * _EPOCH
        epoch_sum, extra, moved, moved_all = v[at : at + _TAIL]
        window_steps, mixed = v[at + _TAIL : fixed]
        return cls(
            ranks=ranks,
            recorded_steps=v[1],
            recording_ranks=v[2],
            moments=moments,
            previous=previous,
            current=current,
            epoch_index=epoch_sum // ranks,
            movement_extra_us=extra // ranks,
            movement_steps=moved // ranks,
            movement_steps_all=moved_all // ranks,
            window_steps=window_steps // ranks,
            window_mixed=mixed > 0,
            window_expert_us=tuple(v[fixed:]),
        )

    def to_vector(self) -> torch.Tensor:
        """The reduced vector this was parsed from (sums over ranks), for a window record."""
        ranks = self.ranks
        head = [ranks, self.recorded_steps, self.recording_ranks]
        epochs = []
        for epoch in (self.previous, self.current):
            epochs += [epoch.steps, epoch.step_us, epoch.tokens, epoch.squares]
        tail = [
            self.epoch_index * ranks,
            self.movement_extra_us * ranks,
            self.movement_steps * ranks,
            self.movement_steps_all * ranks,
        ]
        window = [self.window_steps * ranks, int(self.window_mixed)]
        values = head + self.moments.tolist() + epochs + tail + window
        return torch.tensor(values + list(self.window_expert_us), dtype=torch.int64)

    @property
    def movement_cost_us(self) -> float | None:
        """What moving has cost serving so far, per rank (µs): the priced moving steps' extra,
        scaled to every moving step (signed: noise can leave it below zero); ``None`` before any
        moving step was priced."""
        if not self.movement_steps:
            return None
        every = max(self.movement_steps_all, self.movement_steps)
        return self.movement_extra_us * every / self.movement_steps

    def measured_layer_us(self) -> list[list[float]] | None:
        """``[L][ranks]``: each rank's mean expert µs per step in each layer over the window's
        steps (``None`` if the window ran under more than one placement, or timed nothing)."""
        cells = self.window_expert_us
        if self.window_mixed or self.window_steps <= 0 or not any(cells) or len(cells) % self.ranks:
            return None
        ranks = self.ranks
        return [
            [total / self.window_steps for total in cells[start : start + ranks]]
            for start in range(0, len(cells), ranks)
        ]

    def measured_rank_us(self) -> list[float] | None:
        """Each rank's mean expert µs per step over the window's steps, all layers."""
        layers = self.measured_layer_us()
        if layers is None:
            return None
        return [sum(layer[rank] for layer in layers) for rank in range(self.ranks)]

    @property
    def steps_per_rank(self) -> float:
        """Steps whose load the window holds (each recording rank counts the same steps)."""
        return self.recorded_steps / self.recording_ranks if self.recording_ranks else 0.0


class ServingFeedback:
    """The per-step side of :class:`WindowFeedback`, owned by the controller's (serving) thread.

    The one per-step reader of the expert op's counters: runners take the step's expert time
    from :attr:`last_step_expert_ns` rather than reading them again.

    Args:
        expert_stats: ``EplbState.expert_stats`` (``[L, 3]``: rows, ns, active slots). Read only
            when it is a host tensor with the active-slot column; elsewhere no cost samples are
            taken (the model then has only what calibration gave it).
        model_source: returns the latest fitted model (or ``None``), the reference that outlier
            calls are judged against; ``None``: every call is a sample.
    """

    def __init__(
        self,
        expert_stats: torch.Tensor,
        rank: int = 0,
        num_ranks: int = 1,
        model_source: Callable[[], ExpertCostModel | None] | None = None,
    ) -> None:
        self._stats = expert_stats
        self._rank = rank
        self._num_ranks = num_ranks
        self._window_steps = 0
        self._steps_seen = 0
        self._window_us = [0] * expert_stats.shape[0]
        self._window_version: int | None = None
        self._window_mixed = False
        self._samples = expert_stats.device.type == "cpu" and expert_stats.shape[-1] >= 3
        self._seen: list[list[int]] = expert_stats.detach().cpu().tolist()
        self.moments = CostMoments()
        self.epoch_index = 0
        self._version: int | None = None
        self._current = [0, 0, 0, 0]
        self._previous = [0, 0, 0, 0]
        self._reference: deque[tuple[int, int]] = deque(maxlen=REFERENCE_STEPS)
        self.movement_extra_us = 0
        self.movement_steps = 0
        self.movement_steps_all = 0
        self.model_source = model_source
        self.last_step_expert_ns = 0
        """Expert-op ns of the last step (all layers; 0 where the op is not timed on the host)."""
        self.samples_taken = 0
        self.samples_dropped = 0

    def calibrate(self, rows, active, micros) -> None:
        """Add calls measured outside serving (a calibration at attach)."""
        self.moments.add(rows, active, micros)

    def step(
        self,
        *,
        step_us: int,
        tokens: int,
        decode: bool,
        in_flight: bool,
        version: int,
        in_window: bool = False,
        moving: bool = False,
    ) -> None:
        """One served step: its time, valid tokens, batch phase, whether a job was in flight on
        the worker (planning or moving) and whether it was moving weights, the committed
        placement version it ran under, and whether its load belongs to the window that closes
        next (its expert time is then set against the prediction)."""
        usable = decode and not in_flight
        layer_us = self._take_cost_samples(usable)
        self._steps_seen += 1
        if in_window and self._steps_seen <= WARMUP_STEPS:
            self._window_mixed = True  # not a measurement of the placement (see WARMUP_STEPS)
        if in_window:
            self._window_steps += 1
            for layer, micros in enumerate(layer_us):
                self._window_us[layer] += micros
            if self._window_version is not None and version != self._window_version:
                self._window_mixed = True
            self._window_version = version
        if in_flight or moving:
            if moving:
                self._price_moving_step(step_us, tokens, decode)
            return
        if version != self._version:
            if self._version is not None:
                self._roll_epoch()
            self._version = version
        if decode:
            self._current[0] += 1
            self._current[1] += step_us
            self._current[2] += tokens
            self._current[3] += (step_us // 10) ** 2
            self._reference.append((step_us, tokens))

    @property
    def movement_cost_us(self) -> float | None:
        """What moving weights has cost this rank's serving so far (µs), priced as the window
        reduction prices it (:attr:`WindowFeedback.movement_cost_us`); ``None`` before any
        moving step was priced."""
        if not self.movement_steps:
            return None
        every = max(self.movement_steps_all, self.movement_steps)
        return self.movement_extra_us * every / self.movement_steps

    def moved_inline(self, micros: int) -> None:
        """A synchronous rearrangement ran inside a step and took ``micros`` µs."""
        self.movement_extra_us += max(0, micros)
        self.movement_steps += 1
        self.movement_steps_all += 1

    def _price_moving_step(self, step_us: int, tokens: int, decode: bool) -> None:
        """Count a step that ran while weights moved; price it (signed, against the idle steps
        just before) where its idle time is known."""
        self.movement_steps_all += 1
        steps = len(self._reference)
        if not decode or not steps:
            return
        idle_us = sum(micros for micros, _ in self._reference)
        idle_tokens = sum(count for _, count in self._reference)
        if not comparable_batches(tokens, idle_tokens / steps):
            return
        self.movement_extra_us += step_us - idle_us // steps
        self.movement_steps += 1

    def take(self, recorded_steps: int) -> torch.Tensor:
        """The vector this rank contributes to the window's reduction; ages the cost samples
        and starts the next window's timing."""
        head = [1, recorded_steps, 1 if recorded_steps > 0 else 0]
        tail = [
            self.epoch_index,
            self.movement_extra_us,
            self.movement_steps,
            self.movement_steps_all,
        ]
        window = [self._window_steps, int(self._window_mixed)]
        per_rank = [0] * (self._num_ranks * len(self._window_us))
        for layer, micros in enumerate(self._window_us):
            per_rank[layer * self._num_ranks + self._rank] = micros
        vector = torch.tensor(
            head
            + self.moments.values.tolist()
            + self._previous
            + self._current
            + tail
            + window
            + per_rank,
            dtype=torch.int64,
        )
        self.moments.age_()
        self._window_steps = 0
        self._window_us = [0] * len(self._window_us)
        self._window_version, self._window_mixed = None, False
        return vector

    def _roll_epoch(self) -> None:
        if self._current[0]:
            self._previous = self._current
        self._current = [0, 0, 0, 0]
        self._reference.clear()  # idle steps of a placement no longer served
        self.epoch_index += 1

    def _take_cost_samples(self, usable: bool) -> list[int]:
        """Adds this step's per-layer calls to the moments when ``usable``; returns the step's
        expert µs per layer (none where the op is not timed on the host).

        Plain Python integers from one ``tolist`` of a few rows: this runs on the serving thread
        every step, where tensor bookkeeping cost more than the figures are worth.
        """
        self.last_step_expert_ns = 0
        if not self._samples:
            return []
        now = self._stats.tolist()
        seen, self._seen = self._seen, now
        model = self.model_source() if usable and self.model_source is not None else None
        total_ns = 0
        layer_us = [0] * len(now)
        for index, (layer, layer_seen) in enumerate(zip(now, seen, strict=True)):
            elapsed_ns = layer[1] - layer_seen[1]
            if elapsed_ns <= 0:
                continue  # this layer's op ran no call this step
            total_ns += elapsed_ns
            layer_us[index] = elapsed_ns // 1000
            if not usable:
                continue
            rows, active = layer[0] - layer_seen[0], layer[2] - layer_seen[2]
            micros = elapsed_ns // 1000
            if model is not None and _outlier(model, rows, active, micros):
                self.samples_dropped += 1
                continue
            self.samples_taken += 1
            self.moments.add_call(rows, active, micros)
        self.last_step_expert_ns = total_ns
        return layer_us

    def snapshot(self) -> dict:
        """Cost samples taken and left out as outliers (plain values, for the metrics files)."""
        return {"taken": self.samples_taken, "dropped_outliers": self.samples_dropped}


def _outlier(model: ExpertCostModel, rows: int, active: int, micros: int) -> bool:
    """A call more than :data:`OUTLIER_FACTOR` times (and :data:`OUTLIER_MIN_US` more than)
    what ``model`` predicts for it."""
    predicted = model.call_us(rows, active)
    return micros > OUTLIER_FACTOR * predicted and micros - predicted > OUTLIER_MIN_US


def empty_feedback(num_ranks: int, num_layers: int = 1) -> torch.Tensor:
    """A rank's vector when it has nothing to say (a failed fold still joins the reduction)."""
    return torch.zeros(feedback_size(num_ranks, num_layers), dtype=torch.int64)
