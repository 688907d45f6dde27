"""``run_audit``: run every check on one target and leave the target as it was found.

The audit runs the target several times (eagerly, under ``explain``, compiled) and commits a
different placement, so it snapshots the EPLB tensors first and restores the committed placement
and every tensor's contents afterwards (in place, into whatever tensors the state holds then).
It resets Dynamo's caches before each of its compiles and once more at the end so nothing it
compiled leaks into the caller's later ``torch.compile`` calls.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from eplb_graph.audit.checks import CHECKS, AuditContext
from eplb_graph.audit.report import AuditReport
from eplb_graph.audit.sync_ops import is_custom_op
from eplb_graph.errors import EplbError

logger = logging.getLogger(__name__)

#: Methods an ``eplb_state`` must have (``EplbState`` or anything shaped like it).
STATE_METHODS = ("graph_tensors", "data_ptrs", "commit_", "set_step_inputs_", "advance_offset_")


class TargetRaised(EplbError, RuntimeError):
    """The target failed when simply called eagerly, or tried to exit the process during the
    audit: nothing about graphs can be said."""


def describe_escape(error: BaseException) -> str:
    """One-line account of a ``BaseException`` that is not an ``Exception`` (``sys.exit``...).

    A target that calls ``sys.exit(0)`` would otherwise end the CLI with status 0 and no output,
    which reads as a clean audit; callers turn it into a usage error with this text.
    """
    if isinstance(error, SystemExit):
        return f"raised SystemExit({error.code!r}) (sys.exit)"
    text = str(error).splitlines()[0] if str(error) else ""
    return f"raised {type(error).__name__}" + (f": {text}" if text else "")


class _CustomOpCalls(TorchDispatchMode):
    """Keeps copies of the arguments of the first eager call of each custom op (for body audit).

    Higher-order ops (``cond``...) pass through untouched: custom ops inside their branches are
    not recorded, so their bodies are reported as opaque rather than audited.
    """

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_custom_op(func) and func not in self.calls:

            def copy(value):
                return value.clone() if isinstance(value, torch.Tensor) else value

            self.calls[func] = (
                tuple(copy(arg) for arg in args),
                {key: copy(value) for key, value in kwargs.items()},
            )
        return func(*args, **kwargs)


@contextlib.contextmanager
def _quiet_dynamo() -> Iterator[None]:
    """Silence Dynamo's own warnings while auditing: the report states every break itself."""
    dynamo_logger = logging.getLogger("torch._dynamo")
    previous = dynamo_logger.level
    dynamo_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        dynamo_logger.setLevel(previous)


@contextlib.contextmanager
def _restored(state) -> Iterator[None]:
    if state is None:
        yield
        return
    placement = state.placement
    saved = {name: tensor.clone() for name, tensor in state.graph_tensors().items()}
    try:
        yield
    finally:
        try:
            state.commit_(placement)
        except Exception as error:  # a broken commit_ must not hide the report
            logger.warning("could not restore the committed placement: %s", error)
        for name, tensor in state.graph_tensors().items():
            if name in saved and saved[name].shape == tensor.shape:
                tensor.copy_(saved[name])


def check_state(state) -> None:
    """Raise ``TypeError`` unless ``state`` is ``None`` or has the EPLB state interface."""
    if state is None:
        return
    missing = [name for name in (*STATE_METHODS, "placement") if not hasattr(state, name)]
    if missing:
        raise TypeError(
            f"eplb_state must be an EplbState (or None); {type(state).__name__} lacks "
            f"{', '.join(missing)}"
        )


def run_audit(
    fn: Callable,
    example_args: Sequence,
    eplb_state=None,
    *,
    target: str | None = None,
    checks: Sequence[str] | None = None,
) -> AuditReport:
    """Audit ``fn(*example_args)`` for graph safety; return the report (never raises on findings).

    Args:
        fn: the routed callable or ``nn.Module``.
        example_args: positional arguments for one call (tensors of a representative step).
        eplb_state: the state ``fn`` reads; ``None`` skips the commit/toggle checks (reported as
            skipped, not failed).
        target: name shown in the report (default: ``fn``'s qualified name).
        checks: subset of ``eplb_graph.audit.checks.CHECKS`` to run (default: all, in order).

    Raises:
        TypeError: ``eplb_state`` lacks the EPLB state interface, or ``example_args`` is not a
            sequence.
        ValueError: an unknown check name.
        TargetRaised: ``fn(*example_args)`` raises when called eagerly, or ``fn`` raises a
            ``BaseException`` other than ``KeyboardInterrupt`` (``sys.exit``) at any call.
    """
    check_state(eplb_state)
    if isinstance(example_args, torch.Tensor) or not isinstance(example_args, Sequence):
        raise TypeError(f"example_args must be a tuple or list, got {type(example_args).__name__}")
    names = list(CHECKS) if checks is None else list(checks)
    unknown = [name for name in names if name not in CHECKS]
    if unknown:
        raise ValueError(f"unknown checks {unknown}; available: {list(CHECKS)}")
    args = tuple(example_args)
    label = target or getattr(fn, "__qualname__", type(fn).__qualname__)
    recorder = _CustomOpCalls()
    try:
        with _quiet_dynamo(), _restored(eplb_state):
            try:
                with recorder:
                    fn(*args)
            except Exception:  # maybe the recording mode itself; the plain call decides
                logger.info("recording custom-op calls failed; calling %s without it", label)
                try:
                    fn(*args)
                except Exception as error:
                    raise TargetRaised(f"{label} raised when called eagerly: {error}") from error
            context = AuditContext(fn, args, eplb_state, eager_op_calls=recorder.calls)
            try:
                results = [CHECKS[name](context) for name in names]
            finally:
                torch._dynamo.reset()
    except (Exception, KeyboardInterrupt):
        raise
    except BaseException as error:  # sys.exit() in the target must not pass for a clean audit
        raise TargetRaised(
            f"{label} {describe_escape(error)} during the audit; a target must not exit the process"
        ) from error
    return AuditReport(label, results)
