"""Deterministic, drifting, skewed traffic with a prefill/decode mix for the demo.

Every rank can compute every rank's batch (seeded by step and rank), so padding buckets and
phases are known everywhere without a collective. Tokens are drawn around "topic" directions:
a token of topic ``e`` leans towards the router column of expert ``e`` in layer 0 and of
``perm_l(e)`` in layer ``l`` (the layers' routers share columns, permuted), so expert
popularity follows a Zipf law that drifts over time, in every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TrafficSpec:
    num_experts: int
    hidden: int
    skew: float = 1.2  # Zipf exponent of topic popularity
    drift_every: int = 40  # steps between popularity changes
    drift_sigma: float = 0.6  # lognormal noise multiplied into popularity at each change
    prefill_fraction: float = 0.2
    decode_tokens: tuple[int, int] = (4, 16)
    prefill_tokens: tuple[int, int] = (24, 48)
    topic_strength: float = 3.0
    seed: int = 0


class DemoTraffic:
    def __init__(self, spec: TrafficSpec, world_size: int) -> None:
        self.spec = spec
        self.world_size = world_size
        generator = torch.Generator().manual_seed(spec.seed + 17)
        ranks = torch.arange(1, spec.num_experts + 1, dtype=torch.float64)
        self._base = (ranks ** (-spec.skew))[torch.randperm(spec.num_experts, generator=generator)]
        self._popularity_cache: dict[int, torch.Tensor] = {}

    def popularity(self, step: int) -> torch.Tensor:
        """``[N]`` topic popularity at ``step`` (a lognormal random walk every drift_every)."""
        epoch = step // self.spec.drift_every
        if epoch not in self._popularity_cache:
            current = self._base.clone()
            for e in range(1, epoch + 1):
                g = torch.Generator().manual_seed(self.spec.seed * 1000 + e)
                current = current * torch.exp(
                    torch.randn(len(current), generator=g, dtype=torch.float64)
                    * self.spec.drift_sigma
                )
            self._popularity_cache = {epoch: current / current.sum()}
        return self._popularity_cache[epoch]

    def batch_size(self, step: int, rank: int) -> tuple[int, bool]:
        """``(valid tokens, has_prefill)`` of ``rank``'s batch at ``step``."""
        g = torch.Generator().manual_seed((self.spec.seed + 1) * 7919 + step * 131 + rank)
        prefill = bool(torch.rand(1, generator=g) < self.spec.prefill_fraction)
        low, high = self.spec.prefill_tokens if prefill else self.spec.decode_tokens
        return int(torch.randint(low, high + 1, (1,), generator=g)), prefill

    def hidden(self, step: int, rank: int, topic_directions: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` hidden states of ``rank``'s batch; ``topic_directions [N, H]``."""
        count, _ = self.batch_size(step, rank)
        g = torch.Generator().manual_seed((self.spec.seed + 3) * 104729 + step * 257 + rank)
        topics = torch.multinomial(self.popularity(step), count, replacement=True, generator=g)
        noise = torch.randn(count, self.spec.hidden, generator=g, dtype=torch.float32)
        return noise + self.spec.topic_strength * topic_directions.index_select(0, topics)
