"""Build, cache and load the native CPU kernels (``custom_ops/csrc/*.cpp``: routing, experts).

Lifecycle:
- ``import eplb_graph`` calls :func:`install`. If a build for this exact source and torch version
  is already cached it is loaded at once (a ``dlopen``, milliseconds).
- Otherwise a *trampoline* CPU kernel is registered: the first CPU call builds the library with
  ``torch.utils.cpp_extension`` (about 30 s cold on 2 cores), removes the trampoline, loads the
  native kernels and re-dispatches. Importing never compiles.
- Where no compiler or ninja exists, the build fails once, a warning is logged, and the ATen
  reference kernel serves CPU calls from then on.

``EPLB_GRAPH_NATIVE``: ``auto`` (default, as above), ``off`` (never build; reference kernel) or
``require`` (build at install time and raise if that fails, for CI and benchmarks).
``EPLB_GRAPH_CACHE``: cache directory (default ``~/.cache/eplb_graph``).

The C++ source is found in one of two places: ``eplb_graph/ops/csrc/`` in an installed wheel
(``setup.py`` copies ``custom_ops/csrc`` there at build time), or ``custom_ops/csrc/`` of the
source tree beside the package (an editable install or a checkout on ``PYTHONPATH``).
"""

from __future__ import annotations

import enum
import hashlib
import logging
import os
import shutil
import threading
from pathlib import Path

import torch

from eplb_graph.errors import EplbError
from eplb_graph.ops.registration import NAMESPACE, op_handles

logger = logging.getLogger(__name__)

_SOURCE_NAME = "eplb_graph_cpu.cpp"
#: Compiled into the same library: the expert-compute kernels (local_experts*).
_EXTRA_SOURCES = ("eplb_graph_experts_cpu.cpp",)
_SOURCE_CANDIDATES = (
    Path(__file__).with_name("csrc") / _SOURCE_NAME,  # wheel install
    Path(__file__).resolve().parents[2] / "custom_ops" / "csrc" / _SOURCE_NAME,  # source tree
)
_EXTENSION_NAME = "eplb_graph_native_cpu"


class NativeStatus(enum.Enum):
    """Where CPU calls of the ops currently go."""

    NOT_INSTALLED = "not-installed"  # install() not called yet
    PENDING = "pending"  # trampoline registered; builds on the first CPU call
    LOADED = "loaded"  # fused native kernel serves CPU calls
    DISABLED = "disabled"  # EPLB_GRAPH_NATIVE=off: reference kernel on purpose
    UNAVAILABLE = "unavailable"  # build failed: reference kernel, warning logged


class NativeBuildError(EplbError, RuntimeError):
    """The native kernel was required (``EPLB_GRAPH_NATIVE=require``) but could not be built."""


_lock = threading.RLock()
_status = NativeStatus.NOT_INSTALLED
_failure: str | None = None
_trampoline: torch.library.Library | None = None


def status() -> NativeStatus:
    return _status


def failure_reason() -> str | None:
    """Why the native kernel is unavailable (``None`` when it is loaded or pending)."""
    return _failure


def source_file() -> Path:
    """The C++ source of the kernel: the wheel's copy first, else the source tree's."""
    for candidate in _SOURCE_CANDIDATES:
        if candidate.is_file():
            return candidate
    searched = ", ".join(str(candidate) for candidate in _SOURCE_CANDIDATES)
    raise FileNotFoundError(f"the native kernel source is missing (searched {searched})")


def source_files() -> list[Path]:
    """Every C++ source of the library: the routing kernels' file, then the expert kernels'."""
    main = source_file()
    return [main] + [main.with_name(name) for name in _EXTRA_SOURCES]


def _mode() -> str:
    mode = os.environ.get("EPLB_GRAPH_NATIVE", "auto").strip().lower()
    if mode not in ("auto", "off", "require"):
        raise ValueError(f"EPLB_GRAPH_NATIVE must be one of auto, off, require; got {mode!r}")
    return mode


def build_directory() -> Path:
    """Cache folder keyed by source hash, torch version and ABI, so stale builds never load."""
    root = Path(os.environ.get("EPLB_GRAPH_CACHE", Path.home() / ".cache" / "eplb_graph"))
    key = hashlib.sha256()
    for source in source_files():
        key.update(source.read_bytes())
    key.update(torch.__version__.encode())
    key.update(str(torch._C._GLIBCXX_USE_CXX11_ABI).encode())
    return root / f"native-{key.hexdigest()[:16]}"


def _library_file(directory: Path) -> Path:
    return directory / f"{_EXTENSION_NAME}.so"


def _load_file(path: Path) -> None:
    torch.ops.load_library(str(path))


def _build() -> Path:
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None and not cpp_extension.is_ninja_available():
        raise RuntimeError("ninja is not installed (pip install ninja)")
    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    logger.info("building the native eplb_graph CPU kernel in %s (first use only)", directory)
    cpp_extension.load(
        name=_EXTENSION_NAME,
        sources=[str(source) for source in source_files()],
        build_directory=str(directory),
        extra_cflags=["-O3"],
        is_python_module=False,
        verbose=False,
    )
    path = _library_file(directory)
    if not path.exists():
        raise RuntimeError(f"the build finished but {path} is missing")
    return path


def _remove_trampoline() -> None:
    global _trampoline
    if _trampoline is not None:
        _trampoline._destroy()
        _trampoline = None


def ensure_loaded() -> bool:
    """Load (building if needed) the native kernel now; True when CPU calls go native."""
    global _status, _failure
    with _lock:
        if _status in (NativeStatus.LOADED, NativeStatus.DISABLED, NativeStatus.UNAVAILABLE):
            return _status is NativeStatus.LOADED
        _remove_trampoline()
        try:
            cached = _library_file(build_directory())
            _load_file(cached if cached.exists() else _build())
        except Exception as error:  # compiler missing, ninja missing, build error: all degrade
            _status = NativeStatus.UNAVAILABLE
            _failure = f"{type(error).__name__}: {error}".splitlines()[0]
            if _mode() == "require":
                raise NativeBuildError(
                    f"EPLB_GRAPH_NATIVE=require but the native CPU kernel failed: {_failure}"
                ) from error
            logger.warning(
                "eplb_graph: native CPU kernel unavailable (%s); using the ATen reference kernel, "
                "which is several times slower on CPU",
                _failure,
            )
            return False
        _status = NativeStatus.LOADED
        _failure = None
        return True


def _make_trampoline(name: str):
    handle = op_handles()[name]

    def trampoline(*args):
        ensure_loaded()
        return handle(*args)

    trampoline.__name__ = f"{name}_build_native_then_dispatch"
    return trampoline


def install() -> NativeStatus:
    """Decide where CPU calls go (see module docstring). Idempotent; cheap unless ``require``."""
    global _status, _trampoline
    with _lock:
        if _status is not NativeStatus.NOT_INSTALLED:
            return _status
        mode = _mode()
        if mode == "off":
            _status = NativeStatus.DISABLED
            return _status
        cached = _library_file(build_directory())
        if mode == "require" or cached.exists():
            _status = NativeStatus.PENDING
            ensure_loaded()
            return _status
        library = torch.library.Library(NAMESPACE, "IMPL")
        for name in op_handles():
            library.impl(name, _make_trampoline(name), "CPU")
        _trampoline = library
        _status = NativeStatus.PENDING
        return _status
