"""Weights for movement tests: every layer, expert and tensor position distinguishable.

``expert_payloads(format, layer, num_experts)`` builds a reference view with one slot per logical
expert, filled with seeded random values, and returns each expert's packed payload: the bytes
every slot holding that expert must carry after any rearrangement. Live per-rank views are then
initialized from a placement by unpacking those payloads, so checks are byte-exact over every
moved tensor (weights, scales, biases) of every format.
"""

from __future__ import annotations

import itertools

import torch

from eplb_graph.movement import from_nd, make_expert_view

HIDDEN, INTER = 64, 64  # multiples of the NZ tiles (int4 packs two per int8: 64 / 2 = 32)


def fill(shape, dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    info = torch.iinfo(dtype)
    low, high = max(info.min, -(2**40)), min(info.max, 2**40)
    return torch.randint(low, high, shape, generator=generator, dtype=torch.int64).to(dtype)


def nz(nd: torch.Tensor) -> torch.Tensor:
    """Fractal NZ with Ascend's block: 16 rows x 32 bytes."""
    return from_nd(nd, 16, 32 // nd.element_size())


def make_tensors(format_name: str, slots: int, seed: int) -> tuple[dict, dict]:
    """Live tensors of one layer with ``slots`` expert slots, in ``format_name``."""
    seeds = itertools.count(seed)
    h, i = HIDDEN, INTER
    tensors: dict[str, torch.Tensor] = {}
    if format_name.startswith("unquantized"):
        tensors = {
            "w13": fill((slots, 2 * i, h), torch.bfloat16, next(seeds)),
            "w2": fill((slots, h, i), torch.bfloat16, next(seeds)),
            "w13_bias": fill((slots, 2 * i), torch.bfloat16, next(seeds)),
            "w2_bias": fill((slots, h), torch.bfloat16, next(seeds)),
        }
    elif format_name.startswith(("w8a8", "w4a8")):
        pack = 2 if format_name.startswith("w4a8") else 1
        tensors = {
            "w13": fill((slots, 2 * i, h // pack), torch.int8, next(seeds)),
            "w2": fill((slots, h, i // pack), torch.int8, next(seeds)),
            "w13_scale": fill((slots, 2 * i), torch.float32, next(seeds)),
            "w2_scale": fill((slots, h), torch.float32, next(seeds)),
            "w13_fused_scale": fill((slots, 2 * i), torch.int64, next(seeds)),
            "w2_fused_scale": fill((slots, h), torch.int64, next(seeds)),
        }
        if pack == 2:
            tensors["w13_scale_bias"] = fill((slots, 2 * i), torch.float32, next(seeds))
            tensors["w2_scale_bias"] = fill((slots, h), torch.float32, next(seeds))
        tensors["w13_offset"] = fill((slots, 2 * i), torch.float32, next(seeds))
        tensors["w2_offset"] = fill((slots, h), torch.float32, next(seeds))
    elif format_name == "cpu_int8_packed":  # vLLM's VNNI packing: 4 compensation bytes a row
        tensors = {
            "w13": fill((slots, 2 * i, h + 4), torch.int8, next(seeds)),
            "w2": fill((slots, h, i + 4), torch.int8, next(seeds)),
            "w13_scale": fill((slots, 2 * i, 1), torch.float32, next(seeds)),
            "w2_scale": fill((slots, h), torch.float32, next(seeds)),
        }
    elif format_name == "cpu_int4_packed":  # vLLM's int4 tiles: 32 channels x 64 inputs each
        for stem, rows, cols in (("w13", 2 * i, h), ("w2", h, i)):
            tiles = (slots, rows // 32, cols // 64)
            tensors[stem] = fill((*tiles, 32 * 64 // 2 + 128), torch.uint8, next(seeds))
            tensors[f"{stem}_scale"] = fill((*tiles, 32), torch.float32, next(seeds))
            tensors[f"{stem}_zp"] = fill((*tiles, 32), torch.int8, next(seeds))
    elif format_name == "cpu_fp8_block":  # vLLM's packed fp8, one scale per 128x128 block
        tensors = {
            "w13": fill((slots, 2 * i, h), torch.float8_e4m3fn, next(seeds)),
            "w2": fill((slots, h, i), torch.float8_e4m3fn, next(seeds)),
            "w13_scale": fill((slots, 1, 1), torch.float32, next(seeds)),
            "w2_scale": fill((slots, 1, 1), torch.float32, next(seeds)),
        }
    elif format_name == "strided_packed":
        tensors = {
            "w13": fill((h, slots, 2 * i), torch.float16, next(seeds)),
            "w2": fill((i, slots, h), torch.float16, next(seeds)),
            "w2_scale": fill((h, slots), torch.float32, next(seeds)),
        }
        return tensors, {"expert_dim": 1}
    elif format_name == "nz":
        tensors = {
            "w13": nz(fill((slots, 2 * i, h), torch.float16, next(seeds))),
            "w2": nz(fill((slots, h, i), torch.float16, next(seeds))),
            "w13_scale": fill((slots, 2 * i), torch.float32, next(seeds)),
        }
        return tensors, {"nz_names": ("w13", "w2")}
    else:
        raise ValueError(format_name)
    if format_name.endswith("_nz"):
        tensors["w13"], tensors["w2"] = nz(tensors["w13"]), nz(tensors["w2"])
    return tensors, {}


def make_view(format_name: str, slots: int, seed: int):
    tensors, options = make_tensors(format_name, slots, seed)
    return make_expert_view(format_name, tensors, **options)


def expert_payloads(format_name: str, layer: int, num_experts: int) -> torch.Tensor:
    """``[N, slot_nbytes]`` uint8: the payload of every logical expert of ``layer``."""
    reference = make_view(format_name, num_experts, seed=1000 * (layer + 1))
    payloads = torch.empty(num_experts, reference.slot_nbytes, dtype=torch.uint8)
    for expert in range(num_experts):
        reference.pack_slot(expert, payloads[expert])
    return payloads


def rank_views(format_name: str, phy2log: torch.Tensor, rank: int, num_ranks: int, payloads):
    """One live view per layer for ``rank``, its slots holding ``phy2log``'s experts."""
    per_rank = phy2log.shape[1] // num_ranks
    views = []
    for layer in range(phy2log.shape[0]):
        view = make_view(format_name, per_rank, seed=7 + layer)  # garbage until filled below
        for slot in range(per_rank):
            view.unpack_slot_(slot, payloads[layer][int(phy2log[layer, rank * per_rank + slot])])
        views.append(view)
    return views


def slot_mismatches(views, phy2log, rank: int, num_ranks: int, payloads) -> list[tuple]:
    """(layer, slot, expected expert) for every local slot whose bytes are not its expert's."""
    per_rank = phy2log.shape[1] // num_ranks
    bad = []
    for layer, view in enumerate(views):
        out = torch.empty(view.slot_nbytes, dtype=torch.uint8)
        for slot in range(per_rank):
            expert = int(phy2log[layer, rank * per_rank + slot])
            view.pack_slot(slot, out)
            if not torch.equal(out, payloads[layer][expert]):
                bad.append((layer, slot, expert))
    return bad


def random_placement(generator, num_layers, num_experts, num_slots) -> torch.Tensor:
    """Every expert at least once, the remaining slots random, positions shuffled per layer."""
    rows = []
    for _ in range(num_layers):
        extra = torch.randint(0, num_experts, (num_slots - num_experts,), generator=generator)
        row = torch.cat([torch.arange(num_experts), extra])
        rows.append(row[torch.randperm(num_slots, generator=generator)])
    return torch.stack(rows)
