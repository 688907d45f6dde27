"""Whether routing reads the live EPLB tables or a copy of them.

A model that routes through a copy of the lookup passes every other check: it compiles once,
never syncs, never recompiles, and the state's tensors keep their addresses. Its routing just
never changes when a placement is committed, because the commit writes the state's tensors in
place and the model reads something else: a buffer cloned at init, a table captured as a
constant, a Python-side mirror rebuilt as a tensor, or a view of a tensor the state has since
replaced. The same holds for a private copy of ``load``: the load it records never reaches the
rebalancing window.

:class:`LiveTableProbe` tells these apart from correct models by data flow, not by values (a copy
holds the right values until the first commit): during one eager call it follows which tensors
are *derived from* a live state tensor, at the storage level. A tensor is derived from
``state.log2phy`` if it shares that tensor's storage (any view of it) or was computed in this
call by ops that read such a tensor, including writes into another buffer (``buf.copy_(live)``).
Derivation through the host (``.item()``, ``.tolist()``) is lost on purpose: a captured graph
bakes such a value in as a constant. Every table argument of a custom op (an argument named
like one of :data:`TABLES`, as in the ``eplb_graph`` op schemas) must be derived from the live
state tensor of that name. Step inputs (``offset``, ``num_valid_tokens``, ``record_enabled``)
are not required to be the state's: a host engine may own them (vLLM's glue passes its own), and
a frozen one is found by the recompile and Python-value checks.

Storage addresses are reused after a free, so a derivation entry is kept only while some tensor
seen with that storage is still alive (weak references); a fresh allocation at a reused address
starts underived.
"""

from __future__ import annotations

import traceback
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from eplb_graph.audit.findings import Finding, pick_user_frame
from eplb_graph.audit.report import NO_STATE, CheckResult
from eplb_graph.audit.sync_ops import is_custom_op

#: State tensors a custom op's same-named argument must be derived from: the tables a commit
#: writes (``log2phy``, ``replica_count``, ``phy2log``) and the load the window reads.
TABLES = ("log2phy", "replica_count", "phy2log", "load")
#: Tables a commit writes; a routing that reads none of them live cannot follow a commit.
ROUTING_TABLES = ("log2phy", "replica_count", "phy2log")


def fix_hint(table: str) -> str:
    """How to fix a model that reads a copy of ``table``."""
    return (
        f"pass the EplbState's own `{table}` or a view of it (state.{table}[layer]) on every "
        "call; a clone, a buffer filled at init, a constant, a Python-side mirror or a view of a "
        "tensor the state replaced keeps old values"
    )


_StorageKey = tuple[str, int | None, int]

#: Ops whose result depends on their input's shape and dtype only, never on its values.
_VALUE_FREE = frozenset(
    {
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
        "rand_like",
        "randn_like",
        "randint_like",
        "new_empty",
        "new_empty_strided",
        "new_zeros",
        "new_ones",
        "new_full",
    }
)
#: In-place ops whose result does not depend on the old contents of the tensor they write.
_OVERWRITES = frozenset({"copy_", "fill_", "zero_"})


def _op_name(func: object) -> str:
    packet = getattr(func, "overloadpacket", None)
    return getattr(packet, "__name__", "")


def _covers_storage(tensor: torch.Tensor) -> bool:
    """Whether writing ``tensor`` overwrites every byte of its storage."""
    try:
        size = tensor.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return False
    return (
        tensor.storage_offset() == 0
        and tensor.is_contiguous()
        and tensor.numel() * tensor.element_size() == size
    )


def _storage_key(tensor: torch.Tensor) -> _StorageKey | None:
    """Identity of ``tensor``'s memory (device and storage address); ``None`` when it has none."""
    try:
        pointer = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse, nested, functional wrappers
        return None
    if not pointer:  # empty storages all sit at address 0
        return None
    return tensor.device.type, tensor.device.index, pointer


@dataclass(frozen=True)
class CopiedTable:
    """One custom-op call that read a table argument not derived from the live state tensor."""

    op: str
    argument: str
    location: str | None

    @property
    def message(self) -> str:
        consequence = (
            "the load it records never reaches the rebalancing window"
            if self.argument == "load"
            else "commits written in place never reach this routing"
        )
        return (
            f"`{self.argument}` passed to {self.op} is not read from the live "
            f"EplbState.{self.argument}: {consequence}"
        )

    @property
    def hint(self) -> str:
        return fix_hint(self.argument)


@dataclass
class ProbeResult:
    """What the probed call read: table arguments that were copies, and live tensors read."""

    copies: list[CopiedTable] = field(default_factory=list)
    live_reads: set[str] = field(default_factory=set)

    @property
    def reads_no_live_routing_table(self) -> bool:
        return not self.live_reads.intersection(ROUTING_TABLES)

    def problems(self) -> list[tuple[str, str | None, str]]:
        """``(message, location, hint)`` per defect; location ``None``: the whole callable."""
        found: dict[tuple[str, str | None, str], None] = {}
        for copy in self.copies:
            found[copy.message, copy.location, copy.hint] = None
        if not self.copies and self.reads_no_live_routing_table:
            tables = ", ".join(ROUTING_TABLES)
            message = (
                f"no op reads the live EplbState routing tables ({tables}): commits cannot "
                "change this routing"
            )
            found[message, None, fix_hint("log2phy")] = None
        return list(found)


class LiveTableProbe(TorchDispatchMode):
    """Dispatch mode that follows derivation from the live state tensors through one call.

    Use as a context manager around an eager call; :attr:`result` holds what it found.
    """

    supports_higher_order_operators = True

    def __init__(self, live: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        self._live: dict[_StorageKey, set[str]] = {}
        for name, tensor in live.items():
            key = _storage_key(tensor)
            if key is not None:
                self._live.setdefault(key, set()).add(name)
        self._tables = set(TABLES).intersection(live)
        self._derived: dict[_StorageKey, tuple[set[str], list[weakref.ref]]] = {}
        self.result = ProbeResult()

    def _entry(self, key: _StorageKey) -> tuple[set[str], list[weakref.ref]] | None:
        """The derivation recorded for ``key``, dropped once no tensor seen with it is alive."""
        entry = self._derived.get(key)
        if entry is None:
            return None
        if any((alive := ref()) is not None and _storage_key(alive) == key for ref in entry[1]):
            return entry
        del self._derived[key]  # the memory was freed; its address may now hold anything
        return None

    def sources(self, tensor: torch.Tensor) -> set[str]:
        """Names of the live state tensors ``tensor`` is derived from (empty: none)."""
        key = _storage_key(tensor)
        if key is None:
            return set()
        names = set(self._live.get(key, ()))
        entry = self._entry(key)
        return names | entry[0] if entry is not None else names

    def _mark(self, tensor: torch.Tensor, names: set[str], *, replace: bool) -> None:
        """Record that ``tensor``'s memory now holds data derived from ``names``.

        ``replace`` forgets what the memory held before (a new allocation, or an overwrite of
        the whole storage); otherwise the names are added (a view, or a partial write).
        """
        key = _storage_key(tensor)
        if key is None:
            return
        entry = self._entry(key)
        if replace or entry is None:
            self._derived[key] = (set(names), [weakref.ref(tensor)])
            return
        entry[0].update(names)
        entry[1].append(weakref.ref(tensor))

    def _check_tables(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> None:
        for index, argument in enumerate(func._schema.arguments):
            if argument.name not in self._tables:
                continue
            value = args[index] if index < len(args) else kwargs.get(argument.name)
            if not isinstance(value, torch.Tensor) or argument.name in self.sources(value):
                continue
            frames = traceback.extract_stack()
            location = pick_user_frame((frame.filename, frame.lineno or 0) for frame in frames)
            self.result.copies.append(CopiedTable(func._schema.name, argument.name, location))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [leaf for leaf in pytree.tree_leaves((args, kwargs)) if torch.is_tensor(leaf)]
        read = [self.sources(tensor) for tensor in inputs]
        name = _op_name(func)
        derived: set[str] = set() if name in _VALUE_FREE else set().union(*read)
        self.result.live_reads |= derived
        if is_custom_op(func):
            self._check_tables(func, args, kwargs)
        writes = self._written_args(func, args, kwargs)
        out = func(*args, **kwargs)
        input_keys = {_storage_key(tensor) for tensor in inputs}
        for tensor in pytree.tree_leaves(out):
            if torch.is_tensor(tensor):  # a new allocation forgets what its address held before
                self._mark(tensor, derived, replace=_storage_key(tensor) not in input_keys)
        for target in writes:
            if name in _OVERWRITES:  # copy_/fill_/zero_: the old contents do not matter
                written = set().union(
                    *(
                        names
                        for tensor, names in zip(inputs, read, strict=True)
                        if tensor is not target
                    )
                )
                self._mark(target, written, replace=_covers_storage(target))
            else:
                self._mark(target, derived, replace=False)
        return out

    @staticmethod
    def _written_args(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """Tensors the op writes in place (schema ``Tensor(a!)`` arguments, ``out=`` included)."""
        schema = getattr(func, "_schema", None)
        written = []
        for index, argument in enumerate(schema.arguments if schema is not None else ()):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = args[index] if index < len(args) else kwargs.get(argument.name)
            written += [leaf for leaf in pytree.tree_leaves(value) if torch.is_tensor(leaf)]
        return written


class _Audit(Protocol):
    """What the check needs of ``eplb_graph.audit.checks.AuditContext``."""

    fn: Callable
    args: tuple
    state: object | None
    steps: Sequence  # the commit and toggle steps, run (once) on first access
    fallback_location: str


def live_tables(ctx: _Audit) -> CheckResult:
    """Every EPLB table the target's ops read must be the live state tensor (or derived from it).

    Runs after the commit and toggle steps, so a view of a tensor the commit replaced and a
    cache filled on the first call are seen as the copies they are.
    """
    if ctx.state is None:
        return CheckResult("live_tables", "skipped", NO_STATE)
    steps = [outcome.name for outcome in ctx.steps]
    probe = LiveTableProbe(ctx.state.graph_tensors())
    try:
        with probe:
            ctx.fn(*ctx.args)
    except Exception as error:
        first_line = (str(error) or type(error).__name__).splitlines()[0]
        finding = Finding(
            "compile_error",
            "live_tables",
            f"the target raised when called eagerly under the live-table probe: {first_line}",
            ctx.fallback_location,
        )
        return CheckResult("live_tables", "ran", "the eager call failed", [finding])
    findings = [
        Finding("stale_table", "live_tables", message, location or ctx.fallback_location, hint)
        for message, location, hint in probe.result.problems()
    ]
    read = [name for name in ctx.state.graph_tensors() if name in probe.result.live_reads]
    when = f"after {', '.join(steps)}" if steps else "without steps"
    note = f"eager call {when}; live EPLB tensors read: {', '.join(read) or '-'}"
    return CheckResult("live_tables", "ran", note, findings)
