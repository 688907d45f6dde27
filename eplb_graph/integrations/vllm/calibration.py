"""A short calibration of the expert cost model on this rank's own kernel and weights.

Serving samples alone fit the model slowly where they all look alike: at a steady decode batch
every call has about the same rows over about the same active slots, and rows and reads cannot be
told apart. Before the first window closes, each rank therefore replays its expert op
(``torch.ops.eplb_graph.vllm_local_experts``, with the arguments of its newest real call: the
same kernel, format and live weights) on synthetic rows spanning the corners serving has not
reached: 1 to all local slots active, 1 to 16 rows each. Each point is timed a few times and the
fastest kept (a shared core only ever makes a call slower). About 36 calls, a fraction of a
second on the benefit benchmark's model; the samples age out as serving adds its own.
"""

from __future__ import annotations

import logging
import time

import torch

from eplb_graph.integrations.vllm.local_rows import LAST_CALL, local_experts_cpu

logger = logging.getLogger(__name__)

ROWS_PER_SLOT = (1, 4, 16)
REPEATS = 3


def calibrate_local_experts() -> tuple[list[int], list[int], list[int]] | None:
    """``(rows, active slots, µs)`` of calibration calls, or ``None`` before any real call."""
    call = LAST_CALL[0]
    if call is None:
        return None
    expert_map, weights, kernel, activation, isa, on_input, dtype, hidden_size, ids_dtype = call
    local_slots = torch.nonzero(expert_map >= 0).squeeze(1)
    count = int(local_slots.numel())
    if count == 0:
        return None
    generator = torch.Generator().manual_seed(0)
    scratch = torch.zeros(3, dtype=torch.int64)
    rows_out, active_out, micros_out = [], [], []
    for active in sorted({1, max(1, count // 4), max(1, count // 2), count}):
        for per_slot in ROWS_PER_SLOT:
            tokens = active * per_slot
            ids = local_slots[:active].repeat(per_slot).view(tokens, 1).to(ids_dtype)
            hidden = (0.1 * torch.randn(tokens, hidden_size, generator=generator)).to(dtype)
            weights_k = torch.ones(tokens, 1, dtype=torch.float32)
            fastest = None
            for _ in range(REPEATS):
                started = time.perf_counter_ns()
                local_experts_cpu(
                    hidden, ids, weights_k, expert_map, weights, scratch, kernel, activation,
                    isa, on_input,
                )  # fmt: skip
                elapsed = time.perf_counter_ns() - started
                fastest = elapsed if fastest is None else min(fastest, elapsed)
            rows_out.append(tokens)
            active_out.append(active)
            micros_out.append(fastest // 1000)
    LAST_CALL[0] = call  # the replays above are not serving calls
    return rows_out, active_out, micros_out
