"""Checks of the file paths a setting names, made at initialization.

A path that cannot work (missing, a directory, unreadable, a symlink loop, in a directory that
does not exist or is not writable) is found when the configuration is read, not at the first
window close hours later.

Writability is tested by doing what the run will do: create a file in the directory and rename
it (then remove it). ``os.access`` alone is not enough: as root it says yes to ``/sys/fs`` or a
read-only mount, and the workers then die minutes later on their first write. The probe file is
hidden (``.eplb-graph-probe-*``) and removed at once; a metrics directory that does not exist
yet is created by its check (the run would create it at start-up anyway). Nothing else is
created.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from pathlib import Path

from eplb_graph.expert_map import MAX_EXPERT_MAP_BYTES
from eplb_graph.integrations.settings.fields import ConfigError
from eplb_graph.safe_files import RefusedFileError, check_regular_file


def check_json_path(name: str, value: str) -> None:
    if not value.strip():
        raise ConfigError(name, "must be a non-empty path to a .json file")
    if not value.endswith(".json"):
        raise ConfigError(name, f"must end in .json (expert maps are JSON), got {value!r}")


def check_map_path(name: str, value: str) -> None:
    """The static map must exist and be readable now, not at the first MoE layer's init.

    The file rules are the map loader's (a regular file after symlinks, at most
    ``MAX_EXPERT_MAP_BYTES``), so a FIFO, a device or a huge file is refused here without
    being opened.
    """
    check_json_path(name, value)
    path = Path(value)
    try:
        status = path.stat()
    except FileNotFoundError:
        raise ConfigError(
            name, f"{value!r} does not exist; record a map first or fix the path"
        ) from None
    except OSError as error:  # a symlink loop, a path through a file, a denied directory
        raise ConfigError(name, f"{value!r} cannot be opened: {_reason(error)}") from None
    try:
        check_regular_file(path, status, max_bytes=MAX_EXPERT_MAP_BYTES, what="an expert map")
    except IsADirectoryError:
        raise ConfigError(name, f"{value!r} is not a regular file (a directory)") from None
    except RefusedFileError as error:
        raise ConfigError(name, f"{value!r} {error.problem}") from None
    if not os.access(path, os.R_OK):
        raise ConfigError(name, f"{value!r} is not readable; fix its permissions")


def check_record_path(name: str, value: str) -> None:
    """The record target's directory must exist and be writable (we create no directories at
    configuration time: validation has no side effects)."""
    check_json_path(name, value)
    path = Path(value)
    if path.is_dir():
        raise ConfigError(name, f"{value!r} is a directory; give a file path ending in .json")
    parent = path.parent
    if not parent.is_dir():
        raise ConfigError(name, f"directory {str(parent)!r} does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(name, f"directory {str(parent)!r} is not writable")
    _probe_write(name, parent)


def check_directory_path(name: str, value: str) -> None:
    """A directory to write into: an existing writable directory, or a new one whose parent is
    an existing writable directory (created here; the run would create it at start-up)."""
    if not value.strip():
        raise ConfigError(name, "must be a non-empty directory path")
    path = Path(value)
    if path.exists():
        if not path.is_dir():
            raise ConfigError(name, f"{value!r} exists and is not a directory")
        target = path
    else:
        target = path.parent
        if not target.is_dir():
            raise ConfigError(name, f"directory {str(target)!r} does not exist; create it first")
    if not os.access(target, os.W_OK | os.X_OK):
        raise ConfigError(name, f"directory {str(target)!r} is not writable")
    if target is not path:
        try:
            path.mkdir(exist_ok=True)
        except OSError as error:
            raise ConfigError(
                name, f"cannot create directory {value!r}: {_reason(error)}; choose another"
            ) from None
    _probe_write(name, path)


PROBE_PREFIX = ".eplb-graph-probe-"


def _probe_write(name: str, directory: Path) -> None:
    """Create, rename and remove a small file in ``directory``: what every later write does."""
    try:
        handle, first = tempfile.mkstemp(prefix=PROBE_PREFIX, dir=directory)
    except OSError as error:
        raise _not_writable(name, directory, error) from None
    second = f"{first}.renamed"
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(b"eplb-graph write test\n")
        os.replace(first, second)
    except OSError as error:
        raise _not_writable(name, directory, error) from None
    finally:
        for leftover in (first, second):
            with contextlib.suppress(OSError):
                os.unlink(leftover)


def _not_writable(name: str, directory: Path, error: OSError) -> ConfigError:
    return ConfigError(
        name,
        f"cannot write in directory {str(directory)!r} (creating and renaming a test file "
        f"failed: {_reason(error)}); choose a directory on a writable file system",
    )


def _reason(error: OSError) -> str:
    if error.errno == errno.ELOOP:
        return "a symlink loop (too many levels of symbolic links)"
    return error.strerror or type(error).__name__
