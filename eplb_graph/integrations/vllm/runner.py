"""eplb-graph's EPLB in place of vLLM's, inside vLLM's CPU model runner.

After vLLM has loaded (and repacked) the weights, ``attach`` (``attach.py``) builds one rank's
EPLB: an ``EplbState`` whose rows every MoE router now reads, weight views over the live expert
tensors, and an ``EplbRuntime`` moving them over eplb-graph's own gloo groups. It then stands a
:class:`VllmEplbAdapter` where vLLM's ``EplbState`` would be (``runner.eplb_state``), so vLLM's
own call sites drive it: ``prepare_forward`` before every real forward becomes
``EplbRuntime.begin_step`` (commits land between steps) and the step after sampling becomes
``end_step``. Nothing is added to the serving thread's per-step collectives.

Routing on vLLM's CPU expert parallelism is replicated (every rank routes every token and the
combine all-reduces partial sums), so two things differ from a runner that routes each rank's own
tokens: every rank uses the same replica offset (a token's replica must be the same everywhere),
and only EP rank 0 records load (every rank would count the same tokens).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from typing import Any

from eplb_graph.integrations.settings import RuntimeSettings
from eplb_graph.integrations.vllm.calibration import calibrate_local_experts
from eplb_graph.integrations.vllm.metrics import (
    BackgroundWriter,
    RankMetricsFile,
    compile_counters,
    compile_figures,
    model_is_compiled,
    placement_digest,
)
from eplb_graph.integrations.vllm.slot_digests import DigestLog
from eplb_graph.runtime import EplbRuntime

logger = logging.getLogger(__name__)

GROUP_RING_SIZE = 4
GROUP_TIMEOUT_S = 60.0
STEP_TIMES_KEPT = 4096
RECENT_DECODE_STEPS = 512
"""Decode step times kept in order in the metrics file (``decode_step_ms_recent``)."""
STEPS_NOT_TIMED = 8
"""The first steps of an engine pay one-off costs (lazily compiled kernels, first allocations,
seconds on a 2-rank CPU engine); they would dominate any percentile of serving step times."""


class VllmEplbAdapter:
    """Stands where vLLM's ``EplbState`` would be, and forwards to ``EplbRuntime``."""

    is_async = False  # vLLM starts its own async loop only for its own EplbState

    def __init__(
        self,
        runner: Any,
        runtime: EplbRuntime,
        settings: RuntimeSettings,
        ep_rank: int,
        ep_size: int,
    ) -> None:
        self.runner = runner
        self.runtime = runtime
        self.state = runtime.state
        self.settings = settings
        self.ep_rank = ep_rank
        self.ep_size = ep_size
        self.steps = 0
        self.closed = False
        self._open = False
        self._graphs_at_first_step: int | None = None
        self._model_compiled = model_is_compiled(runner.vllm_config)
        self._step_started = 0.0
        self._step_busy = False
        self._hook_seconds = {
            "idle": deque(maxlen=STEP_TIMES_KEPT),
            "rearranging": deque(maxlen=STEP_TIMES_KEPT),
        }
        self._hook_started = 0.0
        # Serving step times (commits + forward + sampling + end of step), split by whether a
        # rearrangement was in flight: what a rearrangement costs serving, measured where it runs.
        self._step_seconds = {
            "idle": deque(maxlen=STEP_TIMES_KEPT),
            "rearranging": deque(maxlen=STEP_TIMES_KEPT),
        }
        # This rank's time in its expert op per step (the op's own clock, expert_stats ns), by
        # placement version: what a better placement is for, measured where the work runs.
        self._expert_seconds: deque[float] = deque(maxlen=STEP_TIMES_KEPT)
        # Running totals and the newest decode step times, in order: what a caller diffs
        # between two reads of the file to measure one period (a benchmark's batch size).
        self._expert_total_s = 0.0
        self._expert_steps = 0
        self._decode_steps = 0
        self._decode_recent: deque[float] = deque(maxlen=RECENT_DECODE_STEPS)
        self._has_prefill = False
        self._digest = (-1, "")  # (placement version, digest), computed on this thread
        self._progress = runtime.progress()  # at the last step
        self._logged = runtime.progress()  # at the last rearrangement log line
        self._rearrangement_started = 0.0
        # rearrange="when_it_pays": the cost model gets a calibration before its first window.
        self._calibrated = settings.rearrange != "when_it_pays"
        self._metrics = None
        self.weight_digests: DigestLog | None = None
        if settings.metrics_path is not None:
            file = RankMetricsFile(settings.metrics_path, ep_rank)
            self._metrics = BackgroundWriter(file, self.snapshot, heartbeat=lambda: self.steps)

    # -- vLLM's call sites ---------------------------------------------------------------------
    def prepare_forward(self, model_config, num_tokens_unpadded, ubatch_slices=None) -> None:
        """Before a real forward: commit due layers, set this step's valid-token count."""
        if model_config is not self.runner.model_config:
            return  # not the target model (refused at start-up; never route a second model)
        if self._open:
            self._end_step()  # a forward whose step hook never came: close it first
        if self._graphs_at_first_step is None and self._model_compiled:
            self._graphs_at_first_step = compile_counters()["unique_graphs"]
        if not self._calibrated:
            self._calibrate()
        self._step_started = time.perf_counter()
        self._step_busy = self.runtime.moving
        self._has_prefill = self._batch_has_prefill()
        self.runtime.begin_step(
            has_prefill=self._has_prefill, num_valid_tokens=int(num_tokens_unpadded)
        )
        self._hook_started = time.perf_counter() - self._step_started
        self._open = True

    def step(self, is_dummy: bool = False, is_profile: bool = False, log_stats: bool = False):
        """After sampling (and after every dummy run, which has no forward of ours)."""
        if is_dummy or not self._open:
            return
        self._end_step()

    # -- internals -------------------------------------------------------------------------------
    def _batch_has_prefill(self) -> bool:
        """Whether this step's batch holds a prompt (vLLM V1's runner: from its input batch)."""
        return _has_prefill(self.runner)

    def _end_step(self) -> None:
        ending = time.perf_counter()
        before = self._progress
        self.runtime.end_step()
        self._progress = self.runtime.progress()
        # Sync mode runs the whole rearrangement inside this end_step: that step rearranged.
        if self._progress.rearrangements_started != before.rearrangements_started:
            self._step_busy = self._step_busy or not self.runtime.use_async
        # Dummy runs between real steps never call prepare_forward: make them record nothing.
        self.state.set_step_inputs_(0, False)
        if self.steps >= STEPS_NOT_TIMED:
            ended = time.perf_counter()
            kind = "rearranging" if self._step_busy else "idle"
            self._step_seconds[kind].append(ended - self._step_started)
            self._hook_seconds[kind].append(self._hook_started + ended - ending)
            expert_seconds = self._record_expert_time()
            self._expert_total_s += expert_seconds
            self._expert_steps += 1
            if not self._has_prefill:
                self._decode_steps += 1
                self._decode_recent.append(ended - self._step_started)
        self._open = False
        self.steps += 1
        self._log_rearrangement()
        if self._metrics is not None:
            self._refresh_digest()
            self._record_weight_digests()
            self._metrics.notify(self._progress)

    def _calibrate(self) -> None:
        """Time this rank's kernel on synthetic rows once (before the first real step's
        forward, after the warm-up made a call to replay): the cost model's first samples."""
        samples = calibrate_local_experts()
        if samples is None:
            return  # no call of the expert op yet: the next step's forward makes one
        self._calibrated = True
        self.runtime.calibrate_expert_cost(*samples)
        logger.info(
            "eplb-graph cost calibration on EP rank %d: %d kernel calls, %.1f ms",
            self.ep_rank,
            len(samples[0]),
            sum(samples[2]) / 1e3,
        )

    def _record_expert_time(self) -> float:
        """This step's expert-op time, as the controller's feedback read it from the op's
        counters in this very ``end_step`` (one reader per step, not two)."""
        seconds = self.runtime.last_step_expert_ns / 1e9
        self._expert_seconds.append(seconds)
        return seconds

    def _expert_figures(self) -> dict[str, Any]:
        """``expert_ms`` (recent steps) and the running totals a caller diffs between reads."""
        return {
            "expert_ms": _summary(list(self._expert_seconds)),
            "expert_ms_total": 1e3 * self._expert_total_s,
            "expert_steps": self._expert_steps,
            "decode_steps": self._decode_steps,
            "decode_step_ms_recent": [round(1e3 * s, 3) for s in self._decode_recent],
            "expert_rows": int(self.state.expert_stats[:, 0].sum()),
        }

    def _log_rearrangement(self) -> None:
        """One INFO line per rearrangement that committed layers or aborted (EP rank 0):
        layers, bytes, time, balancedness; numbered as the metrics files count them.

        Reads the cheap progress counters every step; the full stats only for a line. A window
        that kept the placement ends a job too, with nothing to say here: the decision's own
        line says why it kept still (``eplb_graph.control.decision_log``).
        """
        now, logged = self._progress, self._logged
        if now.rearrangements_started != logged.rearrangements_started:
            self._rearrangement_started = self._step_started
        if now.rearrangements_finished == logged.rearrangements_finished:
            return  # nothing ended (layers may be committing meanwhile)
        committed = now.layers_committed != logged.layers_committed
        aborted = now.rearrangements_aborted != logged.rearrangements_aborted
        self._logged = now
        if not (committed or aborted):
            return  # a window that kept the placement
        stats = self.runtime.stats()
        if self.ep_rank == 0:
            hotness = stats.last_hotness or {}
            logger.info(
                "eplb-graph rearrangement %d %s: %d layers committed, %.0f ms, balancedness "
                "%s under the old placement -> %s planned (last window's load)%s",
                stats.rearrangements_completed + stats.rearrangements_aborted,
                "aborted" if aborted else "done",
                now.layers_committed - logged.layers_committed,
                1e3 * (time.perf_counter() - self._rearrangement_started),
                _fmt(stats.last_window_balancedness),
                _fmt(hotness.get("updated_balancedness")),
                f": {stats.last_error}" if aborted else "",
            )

    def _refresh_digest(self) -> None:
        """The digest of the committed placement, recomputed on the thread that commits."""
        version, placement = self.state.committed_snapshot()
        if version != self._digest[0]:
            self._digest = (version, placement_digest(placement))

    def _record_weight_digests(self) -> None:
        """Hash the kernel's slots when the committed placement changed (opt-in debugging)."""
        if self.weight_digests is not None:
            self.weight_digests.record(*self.state.committed_snapshot())

    def snapshot(self) -> dict[str, Any]:
        """This rank's figures (what the metrics file holds)."""
        stats = self.runtime.stats()
        gate = stats.gate
        return {
            "rank": self.ep_rank,
            "ep_size": self.ep_size,
            "steps": self.steps,
            "async": stats.is_async,
            "policy": self.settings.policy,
            "windows_closed": stats.windows_closed,
            "rearrangements_started": stats.rearrangements_started,
            "rearrangements": stats.rearrangements_completed,
            "aborted": stats.rearrangements_aborted,
            "noop": stats.rearrangements_noop,
            "plans_recorded": stats.plans_recorded,
            "layers_committed": stats.layers_committed,
            "bytes_received": stats.bytes_received,
            "movement_cost_ms": stats.movement_cost_ms,
            "balancedness": stats.last_window_balancedness,
            "hotness": stats.last_hotness,
            "placement_version": stats.placement_version,
            "placement_digest": self._digest[1],
            "last_decision": stats.last_decision,
            "planning_failures": stats.planning_failures,
            "moves": [] if gate is None else gate["moves"],
            "last_error": stats.last_error,
            "balancedness_windows": list(stats.window_balancedness),
            "compile": compile_figures(self._model_compiled, self._graphs_at_first_step),
            "step_ms": {name: _summary(list(times)) for name, times in self._step_seconds.items()},
            "eplb_hooks_ms": {
                name: _summary(list(times)) for name, times in self._hook_seconds.items()
            },
            **self._expert_figures(),
            "rearrange": self.settings.rearrange,
            "cost_model": gate,
            "cost_samples": {
                "taken": stats.cost_samples_taken,
                "dropped_outliers": stats.cost_samples_dropped,
            },
            "policy_ms_total": 1e3 * stats.planning_seconds,
            "closed": self.closed,
            **(
                {"weight_digests": self.weight_digests.document()}
                if self.weight_digests is not None
                else {}
            ),
            "closed_by": "worker" if self.closed else None,
            "pid": os.getpid(),
        }

    def close(self) -> None:
        """Write the final figures and log them first, then stop the runtime.

        vLLM's server SIGKILLs workers about a second after a stop signal (its engine core gets
        ``shutdown_timeout`` = 0 s): stopping the runtime may wait on a peer that is already
        gone, so the final file and line come before anything that can block; the file is
        rewritten afterwards only if stopping changed a counter (an aborted rearrangement).
        """
        if self.closed:
            return
        self.closed = True
        if self._metrics is not None:
            self._refresh_digest()
            self._metrics.close(self.runtime.progress())
        stats = self.runtime.stats()
        logger.info(
            "eplb-graph closing on EP rank %d: %d steps, %d rearrangements (%d aborted), "
            "%d layers committed, metrics %s",
            self.ep_rank,
            self.steps,
            stats.rearrangements_completed,
            stats.rearrangements_aborted,
            stats.layers_committed,
            self.settings.metrics_path or "off",
        )
        self.runtime.close()
        if self._metrics is not None:
            self._refresh_digest()
            self._metrics.file.update(self.runtime.progress(), self.snapshot)


def _summary(seconds) -> dict[str, float | int | None]:
    """Count, median and 99th percentile of step times, in milliseconds (``None`` without
    samples: no number is better than a misleading one)."""
    ordered = sorted(seconds)
    if not ordered:
        return {"count": 0, "p50": None, "p99": None}
    return {
        "count": len(ordered),
        "p50": 1e3 * ordered[len(ordered) // 2],
        "p99": 1e3 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
    }


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _has_prefill(runner: Any) -> bool:
    """Whether the scheduled batch holds any request still in its prompt."""
    for request_id in runner.input_batch.req_ids:
        request = runner.requests.get(request_id)
        if request is not None and request.num_computed_tokens < request.num_prompt_tokens:
            return True
    return False
