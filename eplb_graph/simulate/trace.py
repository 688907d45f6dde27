"""Load traces for the simulator: file format, validation, and a synthetic generator.

Format (``.npz``, written by :func:`save_trace`, ``format_version`` 1)::

    popularity   float32 [G, L, N]  expected routed picks per token of each expert, per
                                    popularity segment (each [l] row sums to top_k)
    segment      int32   [T]        popularity segment of each step
    tokens       int32   [T]        valid tokens of each step (padding excluded)
    is_prefill   bool    [T]        batch phase of each step (any prefill -> prefill)
    top_k        int64   0-d
    format_version int64 0-d

The executed logical load of step t is ``tokens[t] * popularity[segment[t]]`` (expected picks,
``[L, N]``). Storing popularity per segment instead of counts per step keeps a 20k-step
DeepSeek-V3-sized trace at a few MB instead of gigabytes, and drift is still step-accurate.
"""

from __future__ import annotations

import math
import os
import stat
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from eplb_graph.errors import EplbError

FORMAT_VERSION = 1


class TraceError(EplbError, ValueError):
    """A trace file is malformed; the message names the array and the defect."""


@dataclass(frozen=True)
class LoadTrace:
    popularity: np.ndarray  # float32 [G, L, N]
    segment: np.ndarray  # int32 [T]
    tokens: np.ndarray  # int32 [T]
    is_prefill: np.ndarray  # bool [T]
    top_k: int

    def __post_init__(self) -> None:
        validate_trace(self)

    @property
    def num_steps(self) -> int:
        return int(self.segment.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.popularity.shape[1])

    @property
    def num_experts(self) -> int:
        return int(self.popularity.shape[2])

    def step_load(self, step: int) -> np.ndarray:
        """Expected logical picks ``[L, N]`` (float) executed at ``step``."""
        return self.popularity[self.segment[step]] * float(self.tokens[step])


def validate_trace(trace: LoadTrace) -> None:
    popularity = trace.popularity
    if popularity.ndim != 3:
        raise TraceError(f"popularity must be [G, L, N], got shape {popularity.shape}")
    if popularity.shape[0] < 1 or popularity.shape[1] < 1 or popularity.shape[2] < 1:
        raise TraceError(f"popularity must be non-empty, got shape {popularity.shape}")
    if not np.all(np.isfinite(popularity)) or np.any(popularity < 0):
        raise TraceError("popularity must be finite and non-negative")
    steps = trace.segment.shape
    for name in ("segment", "tokens", "is_prefill"):
        array = getattr(trace, name)
        if array.ndim != 1 or array.shape != steps:
            raise TraceError(f"{name} must be [T] like segment {steps}, got {array.shape}")
    if steps[0] < 1:
        raise TraceError("a trace needs at least one step")
    if trace.segment.min() < 0 or trace.segment.max() >= popularity.shape[0]:
        raise TraceError(f"segment ids must be in [0, {popularity.shape[0]})")
    if trace.tokens.min() < 0:
        raise TraceError("tokens must be >= 0")
    if not 1 <= trace.top_k <= popularity.shape[2]:
        raise TraceError(
            f"top_k must be >= 1 and <= the number of experts ({popularity.shape[2]}), "
            f"got {trace.top_k}"
        )


def save_trace(trace: LoadTrace, path: str | Path) -> None:
    np.savez_compressed(
        path,
        popularity=trace.popularity.astype(np.float32),
        segment=trace.segment.astype(np.int32),
        tokens=trace.tokens.astype(np.int32),
        is_prefill=trace.is_prefill.astype(bool),
        top_k=np.int64(trace.top_k),
        format_version=np.int64(FORMAT_VERSION),
    )


# What each array of a version-1 file may hold: dtype kinds ("f" float, "i"/"u" integer,
# "b" bool) and number of dimensions. Anything else is refused before its data is read.
_ARRAY_KINDS = {
    "popularity": ("fiu", 3, "a float [G, L, N] array"),
    "segment": ("iu", 1, "an integer [T] array"),
    "tokens": ("iu", 1, "an integer [T] array"),
    "is_prefill": ("biu", 1, "a bool [T] array"),
    "top_k": ("iu", 0, "a 0-d integer"),
    "format_version": ("iu", 0, "a 0-d integer"),
}
# A DeepSeek-V3-sized trace of a million steps is a few million elements per array; the cap
# bounds what a file can make the reader allocate (a header may declare any shape).
MAX_TRACE_ELEMENTS = 2**28
_INT32_MAX = 2**31 - 1
# Ways a damaged archive or array fails while it is read (truncated, corrupt, not a zip).
_READ_ERRORS = (OSError, EOFError, ValueError, zipfile.BadZipFile, zlib.error)


def load_trace(path: str | Path) -> LoadTrace:
    """Read a ``.npz`` trace written by :func:`save_trace` (format version 1).

    Raises:
        TraceError: the path is not a readable regular file (a FIFO or a device would block or
            never end), the file is not a zip archive (empty, truncated, corrupt), an array is
            missing, has the wrong dtype or rank, is larger than :data:`MAX_TRACE_ELEMENTS`, or
            its values fail :func:`validate_trace`. The message names the file and the array.
    """
    with _open_regular_file(path) as handle:
        try:
            archive = zipfile.ZipFile(handle)
        except _READ_ERRORS as error:
            raise TraceError(
                f"{path}: not a readable .npz trace (not a zip archive: {error})"
            ) from error
        with archive:
            missing = [name for name in _ARRAY_KINDS if f"{name}.npy" not in archive.namelist()]
            if missing:
                raise TraceError(f"{path}: missing arrays {missing}")
            arrays = {name: _read_array(archive, name, path) for name in _ARRAY_KINDS}
    version = int(arrays["format_version"])
    if version != FORMAT_VERSION:
        raise TraceError(f"{path}: format_version {version}, this reader handles {FORMAT_VERSION}")
    for name in ("segment", "tokens"):  # checked before the int32 cast could wrap them
        values = arrays[name]
        if values.size and (values.min() < 0 or values.max() > _INT32_MAX):
            raise TraceError(f"{path}: {name} values must be in [0, {_INT32_MAX}]")
    return LoadTrace(
        popularity=arrays["popularity"].astype(np.float32),
        segment=arrays["segment"].astype(np.int32),
        tokens=arrays["tokens"].astype(np.int32),
        is_prefill=arrays["is_prefill"].astype(bool),
        top_k=int(arrays["top_k"]),
    )


def _open_regular_file(path: str | Path) -> BinaryIO:
    """Open ``path`` for reading without blocking, and only if it is a regular file."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as error:
        raise TraceError(f"{path}: cannot read the trace: {error.strerror or error}") from error
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise TraceError(f"{path}: not a regular file; pass a .npz trace file")
    return os.fdopen(descriptor, "rb")


def _read_array(archive: zipfile.ZipFile, name: str, path: str | Path) -> np.ndarray:
    """One member's array: its header checked (dtype, rank, size) before its data is read."""
    kinds, ndim, expected = _ARRAY_KINDS[name]
    member = f"{name}.npy"
    try:
        with archive.open(member) as stream:
            version = np.lib.format.read_magic(stream)
            if version == (1, 0):
                shape, _, dtype = np.lib.format.read_array_header_1_0(stream)
            elif version == (2, 0):
                shape, _, dtype = np.lib.format.read_array_header_2_0(stream)
            else:
                raise TraceError(f"{path}: {name}: unsupported .npy version {version}")
        if dtype.kind not in kinds or len(shape) != ndim:
            raise TraceError(f"{path}: {name} must be {expected}, got {dtype} with shape {shape}")
        if math.prod(shape) > MAX_TRACE_ELEMENTS:
            raise TraceError(
                f"{path}: {name} has {math.prod(shape)} elements, more than the "
                f"{MAX_TRACE_ELEMENTS} this reader accepts"
            )
        with archive.open(member) as stream:
            return np.lib.format.read_array(stream, allow_pickle=False)
    except TraceError:
        raise
    except _READ_ERRORS as error:
        raise TraceError(f"{path}: {name}: damaged array ({error})") from error


@dataclass(frozen=True)
class TraceSpec:
    """Parameters of a synthetic trace (see :func:`generate_trace`)."""

    num_layers: int = 58
    num_experts: int = 256
    top_k: int = 8
    num_steps: int = 20_000
    shape: str = "zipf"  # "zipf" | "lognormal"
    skew: float = 1.0  # zipf exponent, or lognormal sigma
    drift_sigma: float = 0.2  # lognormal noise multiplied in per segment (random walk)
    segment_steps: int = 500  # steps per popularity segment
    prefill_fraction: float = 0.1
    prefill_tokens: int = 4096
    decode_tokens: int = 128
    seed: int = 0


#: ``eplb-graph simulate``'s flag names (argparse dests) for the :class:`TraceSpec` fields it
#: spells differently; every other field's flag is its own name. One table, so the command and
#: ``tools/gen_trace.py`` share one vocabulary and map flags to fields the same way.
SPEC_FLAGS = {"num_layers": "layers", "num_experts": "experts", "num_steps": "steps"}


def spec_from_flags(values: object) -> TraceSpec:
    """The :class:`TraceSpec` that parsed flags ask for; a field without a flag keeps its default.

    ``values`` is an ``argparse.Namespace`` (or anything with the flags as attributes).
    """
    names = {field: SPEC_FLAGS.get(field, field) for field in vars(TraceSpec())}
    return TraceSpec(
        **{field: getattr(values, flag) for field, flag in names.items() if hasattr(values, flag)}
    )


def base_popularity(spec: TraceSpec, rng: np.random.Generator) -> np.ndarray:
    """``[L, N]`` popularity with the requested shape, an independent expert order per layer."""
    ranks = np.arange(1, spec.num_experts + 1, dtype=np.float64)
    if spec.shape == "zipf":
        weights = ranks ** (-spec.skew)
    elif spec.shape == "lognormal":
        weights = rng.lognormal(0.0, spec.skew, size=spec.num_experts)
    else:
        raise ValueError(f"trace shape must be 'zipf' or 'lognormal', got {spec.shape!r}")
    layers = np.stack([rng.permutation(weights) for _ in range(spec.num_layers)])
    return layers / layers.sum(axis=1, keepdims=True)


def generate_trace(spec: TraceSpec) -> LoadTrace:
    """Zipf/lognormal popularity drifting by lognormal noise per segment, with a prefill mix."""
    if spec.num_steps < 1 or spec.segment_steps < 1:
        raise ValueError("num_steps and segment_steps must be >= 1")
    if not 0.0 <= spec.prefill_fraction <= 1.0:
        raise ValueError(f"prefill_fraction must be in [0, 1], got {spec.prefill_fraction}")
    rng = np.random.default_rng(spec.seed)
    segments = math.ceil(spec.num_steps / spec.segment_steps)
    popularity = np.empty((segments, spec.num_layers, spec.num_experts), dtype=np.float64)
    current = base_popularity(spec, rng)
    for index in range(segments):
        popularity[index] = current
        noise = rng.lognormal(0.0, spec.drift_sigma, size=current.shape)
        current = current * noise
        current /= current.sum(axis=1, keepdims=True)
    popularity *= spec.top_k  # each token makes top_k picks
    is_prefill = rng.random(spec.num_steps) < spec.prefill_fraction
    jitter = rng.uniform(0.5, 1.0, size=spec.num_steps)
    tokens = np.where(is_prefill, spec.prefill_tokens, spec.decode_tokens) * jitter
    return LoadTrace(
        popularity=popularity.astype(np.float32),
        segment=(np.arange(spec.num_steps) // spec.segment_steps).astype(np.int32),
        tokens=np.maximum(tokens, 1).astype(np.int32),
        is_prefill=is_prefill,
        top_k=spec.top_k,
    )
