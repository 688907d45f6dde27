"""What an audit finding is, and how it points at the *user's* source line.

Every finding carries the file:line of the code the user wrote (the ``.item()`` call, the Python
attribute read, the rebinding assignment), never a line inside torch or inside the op wrappers:
a report that points at ``torch/_dynamo/...`` tells a runner author nothing. Frames are taken from
dynamo's user stacks, from ``node.meta['stack_trace']`` of graph nodes, or from guard-failure
traces, and the innermost frame outside the library directories wins.
"""

from __future__ import annotations

import inspect
import os
import re
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import eplb_graph.ops

#: Finding kinds, in the order the report lists their checks.
KINDS = (
    "graph_break",
    "fullgraph_failed",
    "host_sync",
    "dynamic_shape",
    "compile_error",
    "recompile",
    "non_static_input",
    "address_changed",
    "python_value",
    "stale_table",
)

_FILE_LINE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')
_AUDIT_DIR = str(Path(__file__).resolve().parent)


def library_dirs() -> tuple[str, ...]:
    """Directories whose frames are never "the user's line": torch, the op wrappers, the audit."""
    return (
        str(Path(torch.__file__).resolve().parent),
        str(Path(eplb_graph.ops.__file__).resolve().parent),
        _AUDIT_DIR,
    )


def _is_library(filename: str, skip: Sequence[str]) -> bool:
    resolved = os.path.realpath(filename)
    return any(resolved.startswith(directory + os.sep) for directory in skip)


def pick_user_frame(frames: Iterable[tuple[str, int]]) -> str | None:
    """``file:line`` of the innermost frame outside :func:`library_dirs` (else the innermost)."""
    frames = [(str(file), int(line)) for file, line in frames]
    if not frames:
        return None
    skip = library_dirs()
    user = [frame for frame in frames if not _is_library(frame[0], skip)]
    file, line = (user or frames)[-1]
    return f"{file}:{line}"


def location_from_stack(stack: Sequence[traceback.FrameSummary] | None) -> str | None:
    """Location from a ``FrameSummary`` list (dynamo ``user_stack``/``real_stack``)."""
    if not stack:
        return None
    return pick_user_frame((frame.filename, frame.lineno or 0) for frame in stack)


def location_from_text(text: str | None) -> str | None:
    """Location from a formatted traceback (``node.meta['stack_trace']``, guard reasons)."""
    if not text:
        return None
    return pick_user_frame(
        (match["file"], int(match["line"])) for match in _FILE_LINE.finditer(text)
    )


def location_of_callable(fn: Callable) -> str:
    """Where ``fn`` is defined (a module's ``forward``): the fallback when nothing finer exists."""
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    target = inspect.unwrap(getattr(target, "__func__", target))
    try:
        file = inspect.getsourcefile(target) or inspect.getfile(target)
        _, line = inspect.getsourcelines(target)
    except (TypeError, OSError):
        return f"<{getattr(target, '__qualname__', type(target).__name__)}>:0"
    return f"{file}:{line}"


def relative_location(location: str, root: str | os.PathLike) -> str:
    """Show ``location`` relative to ``root`` when it lies under it (stable across checkouts)."""
    file, sep, line = location.rpartition(":")
    if not sep or not file:
        return location
    root_path = os.path.realpath(root)
    resolved = os.path.realpath(file)
    if resolved.startswith(root_path + os.sep):
        return f"{Path(os.path.relpath(resolved, root_path)).as_posix()}:{line}"
    return location


@dataclass(frozen=True)
class Finding:
    """One graph-safety defect.

    Attributes:
        kind: one of :data:`KINDS`.
        check: the check that produced it (see ``eplb_graph.audit.checks.CHECKS``).
        message: one line saying what is wrong.
        location: ``file:line`` of the user's source that causes it.
        detail: optional extra line (the failed guard, the op body's line, a hint).
    """

    kind: str
    check: str
    message: str
    location: str
    detail: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown finding kind {self.kind!r}; expected one of {KINDS}")

    def relative_to(self, root: str | os.PathLike) -> Finding:
        return Finding(
            self.kind, self.check, self.message, relative_location(self.location, root), self.detail
        )

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


def sort_key(finding: Finding) -> tuple:
    """Report order inside one check: by file, line, kind, message (discovery order varies)."""
    file, _, line = finding.location.rpartition(":")
    return (file, int(line) if line.isdigit() else 0, finding.kind, finding.message)
