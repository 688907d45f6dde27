"""Checks of the file paths a setting names, made at initialization (without side effects).

A path that cannot work (missing, a directory, unreadable, in a directory that does not exist or
is not writable) is found when the configuration is read, not at the first window close hours
later. Checking creates nothing: validation has no side effects.
"""

from __future__ import annotations

import os
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
    if not path.exists():
        raise ConfigError(name, f"{value!r} does not exist; record a map first or fix the path")
    try:
        check_regular_file(path, path.stat(), max_bytes=MAX_EXPERT_MAP_BYTES, what="an expert map")
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


def check_directory_path(name: str, value: str) -> None:
    """A directory to write into: an existing writable directory, or a new one whose parent is
    an existing writable directory (it is created when the run starts)."""
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
