"""The audit's own compile of the target and the commit/toggle steps it drives.

One ``torch.compile`` with ``capture_scalar_outputs`` and ``capture_dynamic_output_shape_ops``
on, so host syncs and data-dependent shapes land *inside* the graph where the ATen walk sees them
(instead of being hidden behind a graph break that the graph-break check reports anyway). Its
backend keeps each Dynamo graph with its real example inputs and runs AOTAutograd to get the
ATen forward graph; it returns the Dynamo graph's own ``forward`` so nothing is code-generated.

The same compiled callable then replays after each step (commit a different placement in place,
flip the record flag, change the valid-token count, advance the offset). A step "recompiled" when
the backend ran again; Dynamo's guard-failure reasons (``torch._dynamo.utils.guard_failures``)
say which guard failed and which user line installed it. Addresses are compared before and after
each step, and every attribute assignment to an EPLB tensor name during a step is traced to its
source line (see :func:`watch_rebinds`).
"""

from __future__ import annotations

import contextlib
import logging
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from eplb_graph.audit.findings import location_from_stack

logger = logging.getLogger(__name__)

CAPTURE_CONFIG = {"capture_scalar_outputs": True, "capture_dynamic_output_shape_ops": True}


@dataclass
class CompiledGraph:
    """One Dynamo graph the audit's compile produced."""

    gm: torch.fx.GraphModule
    example_inputs: list
    step: str
    state_storages: dict[int, str]
    aten_graphs: list[torch.fx.GraphModule] = field(default_factory=list)
    aot_error: BaseException | None = None


@dataclass
class StepOutcome:
    """What one commit/toggle step did to the compiled callable and the EPLB tensors."""

    name: str
    new_graphs: int = 0
    guard_failures: list[str] = field(default_factory=list)
    moved: list[str] = field(default_factory=list)
    rebind_sites: dict[str, str] = field(default_factory=dict)
    error: str | None = None


def storage_ptrs(state) -> dict[int, str]:
    """EPLB tensor name by storage address (matches views of a state tensor too)."""
    if state is None:
        return {}
    return {
        tensor.untyped_storage().data_ptr(): name for name, tensor in state.graph_tensors().items()
    }


class CaptureSession:
    """Compiles ``fn`` once with the capture config and records every graph it produces."""

    def __init__(self, fn: Callable, args: tuple, state) -> None:
        self.fn = fn
        self.args = args
        self.state = state
        self.graphs: list[CompiledGraph] = []
        self.step = "initial"
        self.error: BaseException | None = None  # set when the first call fails
        self._compiled = torch.compile(fn, backend=self._backend)

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list):
        from torch._functorch.aot_autograd import aot_module_simplified

        record = CompiledGraph(gm, list(example_inputs), self.step, storage_ptrs(self.state))
        self.graphs.append(record)

        def keep_forward(graph, _inputs):
            record.aten_graphs.append(graph)
            return graph.forward

        try:
            return aot_module_simplified(gm, example_inputs, fw_compiler=keep_forward)
        except Exception as error:  # the ATen graph is unavailable; keep auditing the rest
            logger.info("AOTAutograd failed on a graph of the target: %s", error)
            record.aot_error = error
            return gm.forward

    def call(self):
        with torch._dynamo.config.patch(**CAPTURE_CONFIG):
            return self._compiled(*self.args)

    @property
    def aten_graphs(self) -> list[torch.fx.GraphModule]:
        return [graph for record in self.graphs for graph in record.aten_graphs]


def _guard_failure_counts() -> dict:
    from torch._dynamo.utils import guard_failures

    return {code: len(reasons) for code, reasons in guard_failures.items()}


def _new_guard_failures(before: dict) -> list[str]:
    from torch._dynamo.utils import guard_failures

    new: list[str] = []
    for code, reasons in guard_failures.items():
        new.extend(str(reason) for reason in reasons[before.get(code, 0) :])
    return new


@contextlib.contextmanager
def watch_rebinds(state, names: set[str]) -> Iterator[dict[str, str]]:
    """Record the source line of every assignment ``state.<name> = ...`` for EPLB tensor names.

    Swaps the instance's class for a subclass whose ``__setattr__`` records the caller, for the
    duration of a step's mutation only (never while the compiled callable runs: Dynamo guards on
    the state's type). Classes that refuse ``__class__`` assignment are simply not watched.
    """
    sites: dict[str, str] = {}
    original = type(state)

    def __setattr__(self, name, value):
        if name in names and name not in sites:
            location = location_from_stack(traceback.extract_stack()[:-1])
            if location is not None:
                sites[name] = location
        original.__setattr__(self, name, value)

    try:
        watcher = type(original.__name__, (original,), {"__setattr__": __setattr__})
        watcher.__module__ = original.__module__
        watcher.__qualname__ = original.__qualname__
        state.__class__ = watcher
    except TypeError:
        yield sites
        return
    try:
        yield sites
    finally:
        state.__class__ = original


def run_step(session: CaptureSession, name: str, mutate: Callable[[], None]) -> StepOutcome:
    """Apply ``mutate`` to the state, replay the compiled callable, and report what changed."""
    state = session.state
    outcome = StepOutcome(name)
    pointers = state.data_ptrs()
    graphs_before = len(session.graphs)
    failures_before = _guard_failure_counts()
    session.step = name
    with watch_rebinds(state, set(pointers)) as sites:
        mutate()
    try:
        session.call()
    except Exception as error:
        outcome.error = (
            f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        )
    after = state.data_ptrs()
    outcome.moved = [key for key in pointers if after.get(key) != pointers[key]]
    outcome.rebind_sites = {key: site for key, site in sites.items() if key in outcome.moved}
    outcome.new_graphs = len(session.graphs) - graphs_before
    outcome.guard_failures = _new_guard_failures(failures_before)
    return outcome
