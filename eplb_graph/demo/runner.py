"""One rank of the end-to-end demo: what a compiled model runner does each step, with EPLB.

Per step: pick the padded batch size (the captured sizes), set the batch phase and valid-token
count, run the compiled forward, step the control plane, and let the commit scheduler install
what the movement worker published, between forwards. An EPLB-off twin (same weights, same
inputs, static placement) runs alongside, so balancedness and outputs compare step by step.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from eplb_graph.demo.options import (  # noqa: F401  (COMPILE_BACKENDS, MAX_SEED: re-exported)
    COMPILE_BACKENDS,
    MAX_SEED,
    DemoOptionError,
    DemoOptions,
)
from eplb_graph.demo.timing import StepTiming
from eplb_graph.demo.traffic import DemoTraffic, TrafficSpec
from eplb_graph.models.ep_moe import (
    CompiledRegions,
    EpMoERank,
    ExpertCheckpoint,
)
from eplb_graph.movement.transport import GroupRing
from eplb_graph.placement import Placement
from eplb_graph.policy.metrics import balancedness
from eplb_graph.progress import ProgressBar, announce
from eplb_graph.runtime import EplbRuntime
from eplb_graph.settings import RuntimeSettings
from eplb_graph.state import EplbState

logger = logging.getLogger(__name__)


@dataclass
class StepSeries:
    step: list[int] = field(default_factory=list)
    eplb: list[float] = field(default_factory=list)
    baseline: list[float] = field(default_factory=list)
    rank_load: list[list[float]] = field(default_factory=list)  # EPLB run, per rank
    rank_load_baseline: list[list[float]] = field(default_factory=list)  # EPLB off, per rank


def rank_loads(executed: list[torch.Tensor], counts: list[int], per_rank: int, world: int):
    """Per layer, the (token, k) rows each rank computed: ``[L, world]`` (valid rows only)."""
    loads = []
    for slots in executed:  # [world, T_pad, K]
        valid = torch.arange(slots.shape[1]).unsqueeze(0) < torch.tensor(counts).unsqueeze(1)
        chosen = slots[valid].reshape(-1) // per_rank
        loads.append(torch.bincount(chosen, minlength=world).to(torch.float64))
    return torch.stack(loads)


def weight_mismatches(model: EpMoERank, checkpoint: ExpertCheckpoint, state: EplbState) -> int:
    """Local slots whose tensors differ (bitwise) from their committed expert's checkpoint."""
    phy2log = state.placement.phy2log
    per_rank = model.slots_per_rank
    bad = 0
    for layer, tensors in enumerate(model.slot_tensors):
        experts = phy2log[layer, model.rank * per_rank : (model.rank + 1) * per_rank]
        expected = checkpoint.slot_tensors(layer, experts)
        for name, tensor in tensors.items():
            same = tensor.view(torch.uint8) == expected[name].view(torch.uint8)
            bad += int((~same.reshape(per_rank, -1).all(dim=1)).sum())
    return bad


def _graph_counters() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def run_rank(rank: int, world_size: int, options: DemoOptions) -> dict | None:
    """Run the demo on this rank (inside an initialized default process group)."""
    started = time.perf_counter()
    torch.set_num_threads(options.threads)
    config = options.model_config()
    placement = Placement.default(options.layers, options.experts, options.redundant, world_size)
    state = EplbState(placement, rank=rank)
    baseline_state = EplbState(placement, rank=rank)
    regions = CompiledRegions(config, options.backend)
    checkpoint = ExpertCheckpoint(config)
    model = EpMoERank(config, state, rank, world_size, regions, checkpoint)
    baseline = EpMoERank(config, baseline_state, rank, world_size, regions, checkpoint)
    groups = GroupRing(size=4, timeout_s=120)  # the EPLB groups: gloo, never the serving group
    runtime = EplbRuntime(
        state,
        model.views,
        RuntimeSettings(
            window_size=options.window_size,
            step_interval=options.step_interval,
            policy=options.policy,
            rearrange=options.rearrange,
            layers_per_step=options.layers_per_step,
            commit_margin_steps=8,
        ),
        groups,
        rank,
    )
    pointers = [view.data_ptrs() for view in model.views], state.data_ptrs()
    traffic = DemoTraffic(
        TrafficSpec(options.experts, options.hidden, seed=options.seed), world_size
    )

    # Warm-up: compile every captured batch size once, recording off, in both models.
    announce(
        f"eplb-graph demo: warming up, compiling {len(options.buckets)} batch sizes in the "
        "EPLB-on and EPLB-off models (the slow part on a small machine)",
        enabled=options.progress and rank == 0,
    )
    for bucket in options.buckets:
        for twin in (model, baseline):
            twin.state.set_step_inputs_(0, False)
            twin.forward(torch.zeros(bucket, options.hidden))
    state.reset_load_()
    graphs_after_warmup, breaks_after_warmup = _graph_counters()
    warmup_seconds = time.perf_counter() - started
    logger.info(
        "demo rank %d: warm-up done in %.1f s; %d slots per layer here",
        rank,
        warmup_seconds,
        model.slots_per_rank,
    )

    series = StepSeries()
    every = max(1, options.steps // options.series_points)
    sums = {"eplb": 0.0, "baseline": 0.0}
    max_abs_diff = 0.0
    commit_steps: list[tuple[int, int]] = []
    per_rank = state.num_slots // world_size
    timing = StepTiming(state, baseline_state)
    with ProgressBar(
        options.steps, "eplb-graph demo", enabled=options.progress and rank == 0
    ) as bar:
        for step in range(options.steps):
            batches = [traffic.batch_size(step, r) for r in range(world_size)]
            counts = [count for count, _ in batches]
            bucket = next(b for b in options.buckets if b >= max(counts))
            count, has_prefill = batches[rank]
            hidden = torch.zeros(bucket, options.hidden)
            hidden[:count] = traffic.hidden(step, rank, model.topic_directions)

            committed = runtime.begin_step(has_prefill=has_prefill, num_valid_tokens=count)
            commit_steps.extend((step, layer) for layer in committed)
            if committed:
                logger.info("demo rank %d: step %d committed layers %s", rank, step, committed)
            executed: list = []
            on_started = time.perf_counter()
            out = model.forward(hidden, executed=executed)
            on_seconds = time.perf_counter() - on_started
            baseline_state.set_step_inputs_(count, False)
            executed_off: list = []
            off_started = time.perf_counter()
            out_off = baseline.forward(hidden, executed=executed_off)
            off_seconds = time.perf_counter() - off_started
            runtime.end_step()
            timing.add(on_seconds, off_seconds, state, baseline_state)

            if count:
                diff = float((out[:count] - out_off[:count]).abs().max())
                max_abs_diff = max(max_abs_diff, diff)
            loads = rank_loads(executed, counts, per_rank, world_size)
            loads_off = rank_loads(executed_off, counts, per_rank, world_size)
            value, value_off = balancedness(loads), balancedness(loads_off)
            sums["eplb"] += value
            sums["baseline"] += value_off
            if step % every == 0:
                series.step.append(step)
                series.eplb.append(value)
                series.baseline.append(value_off)
                series.rank_load.append(loads.sum(dim=0).tolist())
                series.rank_load_baseline.append(loads_off.sum(dim=0).tolist())
            bar.update(1, suffix=f"this step's balancedness: on {value:.2f}, off {value_off:.2f}")

    # Idle the worker, then check movement was exact: every local slot holds, bit for bit, the
    # checkpoint tensors (weights AND scales) of the expert the committed placement names.
    runtime.close()
    slot_mismatches = weight_mismatches(model, checkpoint, state)
    stats = runtime.stats()
    graphs_end, breaks_end = _graph_counters()
    logger.info(
        "demo rank %d: %d rearrangements completed (%d layers), %d aborted, %d bytes received",
        rank,
        stats.rearrangements_completed,
        stats.layers_committed,
        stats.rearrangements_aborted,
        stats.bytes_received,
    )
    commit_seconds = [ms / 1e3 for ms in stats.commit_ms]
    pointers_stable = pointers == ([v.data_ptrs() for v in model.views], state.data_ptrs())
    # Cross-rank totals (one collective at the end, on the serving group).
    totals = torch.tensor(
        [
            float(stats.bytes_received),
            float(graphs_end - graphs_after_warmup),
            float(breaks_end),
            max_abs_diff,
            max(commit_seconds, default=0.0),
            float(not pointers_stable),
            float(stats.rearrangements_aborted),
            float(slot_mismatches),
        ],
        dtype=torch.float64,
    )
    summed = totals.clone()
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    dist.all_reduce(totals, op=dist.ReduceOp.MAX)
    step_time = timing.summary(world_size)  # collective: every rank calls it
    if rank != 0:
        return None
    return {
        "balancedness_eplb": sums["eplb"] / options.steps,
        "balancedness_baseline": sums["baseline"] / options.steps,
        "step_time": step_time,
        "rearrangements": stats.rearrangements_completed,
        "layers_committed": stats.layers_committed,
        "bytes_moved": int(summed[0]),
        "recompiles": int(totals[1]),
        "graph_breaks": int(totals[2]),
        "max_abs_diff": float(totals[3]),
        "steps": options.steps,
        "ranks": world_size,
        "commit_latency_ms": {
            "mean": 1e3 * sum(commit_seconds) / max(1, len(commit_seconds)),
            "max": 1e3 * float(totals[4]),
        },
        "aborted": int(totals[6]),
        "addresses_stable": not bool(totals[5]),
        "weights_exact": int(summed[7]) == 0,
        "vetoes": stats.vetoes or 0,
        "commit_steps": commit_steps,
        # rearrange=when_it_pays: the control plane's cost model and decisions (the same
        # implementation the vLLM plugin runs), as rank 0's planner saw them.
        "cost_model": stats.gate,
        "options": {
            k: (list(v) if isinstance(v, tuple) else v)
            for k, v in dataclasses.asdict(options).items()
        },
        "series": dataclasses.asdict(series),
        "warmup_seconds": warmup_seconds,
        "wall_seconds": time.perf_counter() - started,
        "graphs_after_warmup": graphs_after_warmup,
        "graph_breaks_after_warmup": breaks_end - breaks_after_warmup,
    }
