"""The demo's options, checked in the parent before any rank is spawned.

Kept apart from ``demo.runner`` (which imports torch) so the command line can build the demo's
parser, with these defaults, and refuse a bad flag without importing torch: the checks that need
the policy registry or the traffic model import them when an instance is made.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from eplb_graph.errors import EplbError
from eplb_graph.models.formats import FORMATS

if TYPE_CHECKING:
    from eplb_graph.models.ep_moe import EpMoEConfig

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")  # the compile modes the audit kit drives
MAX_SEED = 2**32 - 1  # the traffic derives per-step generator seeds from it; keep them in range


class DemoOptionError(EplbError, ValueError):
    """A demo option the ranks could not run with; the message names the ``eplb-graph demo`` flag.

    Raised by :class:`DemoOptions` itself, so a bad value is refused in the parent before any
    rank is spawned, never as a traceback from inside the ranks.
    """


# field -> (command-line flag, smallest allowed value); the demo's parser spells its integer
# flags from here too, so the flag a check names is the flag the parser defines.
INTEGER_FIELDS = {
    "ranks": ("--ranks", 2),
    "steps": ("--steps", 1),
    "layers": ("--layers", 1),
    "experts": ("--experts", 1),
    "hidden": ("--hidden", 1),
    "intermediate": ("--intermediate", 1),
    "top_k": ("--top-k", 1),
    "redundant": ("--redundant", 0),
    "window_size": ("--window-size", 1),
    "step_interval": ("--step-interval", 1),
    "layers_per_step": ("--layers-per-step", 1),
    "seed": ("--seed", 0),
    "threads": ("threads", 1),
    "series_points": ("series_points", 1),
}


@dataclass(frozen=True)
class DemoOptions:
    ranks: int = 4
    steps: int = 300
    layers: int = 4
    experts: int = 16
    hidden: int = 64
    intermediate: int = 64
    top_k: int = 2
    redundant: int = 8
    weight_format: str = "unquantized"
    policy: str = "default"
    rearrange: str = "always"
    window_size: int = 20
    step_interval: int = 60
    layers_per_step: int = 1
    backend: str = "inductor"
    buckets: tuple[int, ...] = (8, 16, 32, 64)
    seed: int = 0
    threads: int = 1  # torch intra-op threads per rank (ranks already share the cores)
    progress: bool = True
    series_points: int = 300

    def __post_init__(self) -> None:
        """Every check a rank would otherwise fail on, here, in the parent (DemoOptionError)."""
        for name, (flag, minimum) in INTEGER_FIELDS.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise DemoOptionError(f"{flag} must be an integer, got {value!r}")
            if value < minimum:
                raise DemoOptionError(f"{flag} must be >= {minimum}, got {value}")
        if self.seed > MAX_SEED:
            raise DemoOptionError(f"--seed must be <= {MAX_SEED}, got {self.seed}")
        if (self.experts + self.redundant) % self.ranks != 0:
            raise DemoOptionError(
                f"--experts + --redundant ({self.experts} + {self.redundant}) must be divisible "
                f"by --ranks ({self.ranks})"
            )
        if self.top_k > self.experts:
            raise DemoOptionError(
                f"--top-k must be in [1, --experts={self.experts}], got {self.top_k}"
            )
        from eplb_graph.demo.traffic import TrafficSpec
        from eplb_graph.policy.registry import UnknownPolicyError, get_policy

        if self.weight_format not in FORMATS:
            raise DemoOptionError(
                f"--format must be one of {', '.join(FORMATS)}, got {self.weight_format!r}"
            )
        if self.backend not in COMPILE_BACKENDS:
            raise DemoOptionError(
                f"--backend must be one of {', '.join(COMPILE_BACKENDS)}, got {self.backend!r}"
            )
        try:
            get_policy(self.policy)
        except UnknownPolicyError as error:
            raise DemoOptionError(f"--policy: {error}") from None
        if self.rearrange not in ("always", "when_it_pays"):
            raise DemoOptionError(
                f"--rearrange must be 'always' or 'when_it_pays', got {self.rearrange!r}"
            )
        if (
            not self.buckets
            or any(not isinstance(size, int) or size < 1 for size in self.buckets)
            or list(self.buckets) != sorted(set(self.buckets))
        ):
            raise DemoOptionError(
                f"buckets must be increasing positive batch sizes, got {self.buckets!r}"
            )
        if max(TrafficSpec(self.experts, self.hidden).prefill_tokens) > max(self.buckets):
            raise DemoOptionError(
                f"the largest batch does not fit the largest bucket {self.buckets}"
            )

    def model_config(self) -> EpMoEConfig:
        from eplb_graph.models.ep_moe import EpMoEConfig

        return EpMoEConfig(
            num_layers=self.layers,
            hidden=self.hidden,
            intermediate=self.intermediate,
            num_experts=self.experts,
            top_k=self.top_k,
            num_redundant=self.redundant,
            weight_format=self.weight_format,
            seed=self.seed,
        )


def option_defaults() -> dict[str, Any]:
    """Every :class:`DemoOptions` field's default, without building (and checking) an instance."""
    return {field.name: field.default for field in dataclasses.fields(DemoOptions)}
