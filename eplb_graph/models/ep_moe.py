"""An expert-parallel MoE stack for the end-to-end demo: real routing, real movement.

One :class:`EpMoERank` per EP rank. Per layer:

1. ``route`` (compiled, ``fullgraph=True``): router logits -> softmax -> top-k logical ids ->
   ``map_and_record`` (physical slots, executed load recorded, padding rows excluded);
2. dispatch (eager, on the serving group): every rank all-gathers the tokens and their slots;
3. ``experts`` (compiled): each rank computes only the rows routed to *its* slots
   (``torch.ops.eplb_graph.local_experts``: other ranks' rows cost nothing, so a better placement
   shortens the busiest rank's step), reading the slot weights through the same tensors its
   :class:`~eplb_graph.movement.views.ExpertWeightView` moves, so a rearrangement really changes
   what the kernel reads;
4. combine (eager all-reduce, then compiled weighted sum): each token gets its K outputs back.

The expert computation is independent per (token, k) row and exact (fp32; the W8A8 variant
quantizes activations per token and multiplies small integers exactly), and every row has one
producing rank (others add exact zeros), so outputs are bit-identical whatever replica served a
token: an EPLB-on run must equal an EPLB-off run exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eplb_graph.models.formats import FORMATS
from eplb_graph.models.shape import MoEShape
from eplb_graph.movement.views import UnquantizedView, W8A8View
from eplb_graph.ops import local_experts, local_experts_w8a8, map_and_record
from eplb_graph.state import EplbState


@dataclass(frozen=True)
class EpMoEConfig(MoEShape):
    """The demo model: a :class:`MoEShape` plus its redundant slots, weight format and seed.

    No defaults: :meth:`DemoOptions.model_config <eplb_graph.demo.options.DemoOptions>` makes
    every instance, and the demo's options are where the model's defaults live.
    """

    num_redundant: int
    weight_format: str
    seed: int

    def __post_init__(self) -> None:
        if self.weight_format not in FORMATS:
            raise ValueError(
                f"weight_format must be one of {', '.join(FORMATS)}, got {self.weight_format!r}"
            )
        super().__post_init__()


class ExpertCheckpoint:
    """The logical experts' weights (identical on every rank: seeded), per layer.

    Unquantized: ``w13 [N, 2I, H]`` and ``w2 [N, H, I]`` fp32. W8A8: int8 weights with fp32
    per-output-channel scales and the scales' bits packed into int64 "fused" scales (what an
    MC2-style kernel reads), which the movement plane must move with the weights.
    """

    def __init__(self, config: EpMoEConfig) -> None:
        generator = torch.Generator().manual_seed(config.seed)
        n, h, i = config.num_experts, config.hidden, config.intermediate
        self.layers = []
        for _ in range(config.num_layers):
            w13 = torch.randn(n, 2 * i, h, generator=generator) / h**0.5
            w2 = torch.randn(n, h, i, generator=generator) / i**0.5
            if config.weight_format == "unquantized":
                self.layers.append({"w13": w13, "w2": w2})
            else:
                layer = {}
                for name, weight in (("w13", w13), ("w2", w2)):
                    scale = weight.abs().amax(dim=2) / 127.0
                    layer[name] = torch.round(weight / scale.unsqueeze(2)).to(torch.int8)
                    layer[f"{name}_scale"] = scale.to(torch.float32)
                    layer[f"{name}_fused_scale"] = (
                        scale.to(torch.float32).view(torch.int32).to(torch.int64)
                    )
                self.layers.append(layer)

    def slot_tensors(self, layer: int, experts: torch.Tensor) -> dict[str, torch.Tensor]:
        """Fresh (contiguous) slot tensors holding ``experts`` of ``layer``."""
        return {
            name: tensor.index_select(0, experts).contiguous()
            for name, tensor in self.layers[layer].items()
        }


def make_layer_view(config: EpMoEConfig, tensors: dict[str, torch.Tensor]):
    if config.weight_format == "unquantized":
        return UnquantizedView(tensors["w13"], tensors["w2"])
    return W8A8View(
        tensors["w13"],
        tensors["w2"],
        tensors["w13_scale"],
        tensors["w2_scale"],
        tensors["w13_fused_scale"],
        tensors["w2_fused_scale"],
    )


# -- compiled regions ----------------------------------------------------------------------------


def route(hidden, router, log2phy, replica_count, offset, load, num_valid, record, top_k: int):
    """``hidden [T, H]`` -> (physical slots ``[T, K]``, combine weights ``[T, K]``).

    ``top_k`` is a model constant (the graph specializes on it once); everything that changes
    per step or per commit is a tensor.
    """
    logits = hidden @ router
    weights, logical = torch.topk(torch.softmax(logits, dim=-1), k=top_k, dim=-1)
    slots = map_and_record(logical, log2phy, replica_count, offset, load, num_valid, record)
    return slots, weights


def experts_unquantized(tokens, local_slot, local_rows, stats, w13, w2):
    """Rows ``[M, H]`` routed to local slots (``local_slot [M]``, -1: not ours) -> ``[M, H]``.

    One (token, k) row per input row, weight 1: the op computes only this rank's rows (others
    cost nothing and come back as exact zeros) and adds their rows and time to ``stats``.
    ``local_rows [S]`` is the identity map of the rank's S slots.
    """
    rows = tokens.shape[0]
    ones = torch.ones(rows, 1, dtype=torch.float32, device=tokens.device)
    valid = torch.full((), rows, dtype=torch.int64, device=tokens.device)
    return local_experts(tokens, local_slot.unsqueeze(1), ones, local_rows, w13, w2, stats, valid)


def experts_w8a8(tokens, local_slot, local_rows, stats, w13, w2, w13_scale, w2_scale):
    """W8A8 (:func:`experts_unquantized`'s contract): per-row dynamic activation quantization,
    int8 weights, per-channel scales; integer products summed in fp32, exact for these sizes."""
    rows = tokens.shape[0]
    ones = torch.ones(rows, 1, dtype=torch.float32, device=tokens.device)
    valid = torch.full((), rows, dtype=torch.int64, device=tokens.device)
    return local_experts_w8a8(
        tokens,
        local_slot.unsqueeze(1),
        ones,
        local_rows,
        w13,
        w2,
        w13_scale,
        w2_scale,
        stats,
        valid,
    )


def combine(hidden, expert_out, weights):
    """``hidden [T, H] + sum_k weights[t, k] * expert_out[t, k]`` in a fixed k order."""
    return hidden + (expert_out * weights.unsqueeze(2)).sum(dim=1)


class CompiledRegions:
    """The three compiled functions, shared by every layer and by the EPLB-on/off models (the
    per-layer tensors are graph inputs, so one graph per padded batch size serves all)."""

    def __init__(self, config: EpMoEConfig, backend: str | None) -> None:
        experts = experts_unquantized if config.weight_format == "unquantized" else experts_w8a8
        if backend is None:
            self.route, self.experts, self.combine = route, experts, combine
        else:
            options = {"backend": backend, "fullgraph": True, "dynamic": False}
            self.route = torch.compile(route, **options)
            self.experts = torch.compile(experts, **options)
            self.combine = torch.compile(combine, **options)


def make_routers(config: EpMoEConfig) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per-layer routers ``[H, N]`` sharing one set of columns, permuted per layer, and the unit
    "topic" directions ``[N, H]``: a token near direction ``e`` prefers one expert per layer,
    so a skewed topic mix gives skewed load in every layer."""
    generator = torch.Generator().manual_seed(config.seed + 1)
    base = torch.randn(config.hidden, config.num_experts, generator=generator)
    base = base / base.norm(dim=0, keepdim=True)
    routers = [base] + [
        base[:, torch.randperm(config.num_experts, generator=generator)].contiguous()
        for _ in range(config.num_layers - 1)
    ]
    return routers, base.t().contiguous()


class EpMoERank:
    """One EP rank of the demo model.

    Args:
        config: model shape and weight format.
        state: this rank's EPLB state (its placement decides which experts the local slots hold).
        rank, world_size: position in the serving group.
        regions: compiled functions (shared).
        group: the serving process group (dispatch/combine collectives); default group if None.
    """

    def __init__(
        self,
        config: EpMoEConfig,
        state: EplbState,
        rank: int,
        world_size: int,
        regions: CompiledRegions,
        checkpoint: ExpertCheckpoint,
        group=None,
    ) -> None:
        self.config = config
        self.state = state
        self.rank = rank
        self.world_size = world_size
        self.regions = regions
        self.group = group
        self.router, self.topic_directions = make_routers(config)
        per_rank = state.num_slots // world_size
        self.slots_per_rank = per_rank
        self.local_rows = torch.arange(per_rank, dtype=torch.int64)  # slot -> row: identity
        phy2log = state.placement.phy2log
        self.slot_tensors = []
        self.views = []
        for layer in range(config.num_layers):
            local = phy2log[layer, rank * per_rank : (rank + 1) * per_rank]
            tensors = checkpoint.slot_tensors(layer, local)
            self.slot_tensors.append(tensors)
            self.views.append(make_layer_view(config, tensors))

    def _expert_args(self, layer: int) -> tuple:
        t = self.slot_tensors[layer]
        if self.config.weight_format == "unquantized":
            return (t["w13"], t["w2"])
        return (t["w13"], t["w2"], t["w13_scale"], t["w2_scale"])

    def forward(self, hidden: torch.Tensor, *, executed: list | None = None) -> torch.Tensor:
        """``hidden [T_pad, H]`` (padded; the state's valid-token count says how many rows are
        real) -> ``[T_pad, H]``. ``executed`` collects, per layer, the global slots of this
        step's valid rows on every rank (for the demo's balancedness)."""
        import torch.distributed as dist

        s = self.state
        k = self.config.top_k
        num_rows = hidden.shape[0]
        for layer in range(self.config.num_layers):
            slots, weights = self.regions.route(
                hidden,
                self.router[layer],
                s.log2phy[layer],
                s.replica_count[layer],
                s.offset,
                s.load[layer],
                s.num_valid_tokens,
                s.record_enabled,
                k,
            )
            # Dispatch: everyone sees every rank's rows and their slots (fixed-size buffers; the
            # slot ids ride along as floats, exact below 2**24, to keep it one collective).
            packed = torch.cat([hidden, slots.to(hidden.dtype)], dim=1)
            gathered = [torch.empty_like(packed) for _ in range(self.world_size)]
            dist.all_gather(gathered, packed, group=self.group)
            everything = torch.cat(gathered)  # [W*T, H+K]
            tokens = everything[:, : hidden.shape[1]].repeat_interleave(k, dim=0)
            global_slot = everything[:, hidden.shape[1] :].round().to(torch.int64).reshape(-1)
            if executed is not None:
                executed.append(global_slot.view(self.world_size, num_rows, k))
            local = global_slot - self.rank * self.slots_per_rank
            local = torch.where(
                (local >= 0) & (local < self.slots_per_rank), local, torch.full_like(local, -1)
            )
            out = self.regions.experts(
                tokens, local, self.local_rows, s.expert_stats[layer], *self._expert_args(layer)
            )
            # Combine: exactly one rank produced each row; the others contribute exact zeros.
            dist.all_reduce(out, group=self.group)
            mine = out.view(self.world_size, num_rows, k, -1)[self.rank]
            hidden = self.regions.combine(hidden, mine, weights)
        return hidden
