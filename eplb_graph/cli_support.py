"""What every ``eplb-graph`` subcommand shares at its boundary with the user.

The exit-status contract (0 success, 1 findings or a failed run, 2 usage, shape or unreadable
input) is only useful if status 2 comes *before* the expensive part: a demo that spawns ranks or a
simulation that replays 20k steps must not run for minutes and then lose its report to a
traceback because ``--json`` names a missing directory. So each command checks its options and
its report destinations first (:func:`check_destination`), reports a refusal as one line
(:func:`refuse`), and writes reports atomically (:func:`write_text_atomically`,
:func:`write_file_atomically`) so an interrupted run never leaves half a report behind.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import stat
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from eplb_graph.errors import EplbError

USAGE_STATUS = 2
logger = logging.getLogger("eplb_graph.cli")


class UsageError(EplbError, ValueError):
    """A command-line value the command cannot use; the message names the option and the fix."""


class HelpFormatter(argparse.HelpFormatter):
    """Ends every option's help with its default (what ``ArgumentDefaultsHelpFormatter`` does).

    A user should not have to read the source to learn what an option does when left out.
    ``None`` (no value: the option is off or computed), a flag's ``False`` and a help text that
    states its default itself are left as they are.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "(default" in text  # the help states its default itself
            or default is None
            or default is False
            or default is argparse.SUPPRESS
            or (
                not action.option_strings
                and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE)
            )
        ):
            return text
        return f"{text} (default: %(default)s)"


class OneLineArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one stderr line and exit status 2.

    Scripts and CI read the last line of stderr; argparse's default prints the whole usage block
    first, which for ``simulate`` is a dozen lines. Subparsers inherit this class, and with it
    :class:`HelpFormatter`, so every ``--help`` shows the defaults.
    """

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_STATUS, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def refuse(command: str, error: BaseException | str) -> int:
    """Write ``error`` as one stderr line prefixed by ``command``; return the usage status."""
    text = " ".join(str(error).split())  # one line, whatever the error's message holds
    sys.stderr.write(f"{command}: {text}\n")
    return USAGE_STATUS


def warn_if_window_capped(window_size: int, step_interval: int) -> None:
    """Warn that a window longer than the interval is cut to it (the run goes on).

    Load recorded before the previous rearrangement belongs to a placement that no longer
    exists, so the control plane plans on ``min(window, interval)`` steps; a user who asked for
    more should learn that the option did not do what it says.
    """
    if window_size > step_interval:
        logger.warning(
            "--window-size %d exceeds --step-interval %d: each rearrangement uses only the %d "
            "steps recorded since the previous one (older load describes a placement that no "
            "longer exists); set --window-size <= --step-interval to silence this",
            window_size,
            step_interval,
            step_interval,
        )


BUILT_IN_POLICIES = ("churn_aware", "default", "flash_lb", "random", "swift_balance")
"""The policies ``eplb_graph.policy`` registers, sorted as ``policy_names()`` lists them (a test
pins the two equal). Listed here because the registry imports torch, and ``--help`` must not."""


def policy_metavar() -> str:
    """``{name,...}`` of the policies, for an option's usage and help: the built-in ones, plus
    any registered since, when the registry is already loaded.

    Not argparse ``choices``: an unknown name is refused by the policy registry itself
    (``UnknownPolicyError``, exit 2), whose message is the same wherever a policy is named.
    """
    names = set(BUILT_IN_POLICIES)
    registry = sys.modules.get("eplb_graph.policy.registry")
    if registry is not None:
        names.update(registry.policy_names())
    return "{" + ",".join(sorted(names)) + "}"


def _integer(text: str) -> int:
    try:
        return int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse ``type`` for integers in ``[minimum, maximum]`` (no upper bound if None)."""

    def parse(text: str) -> int:
        value = _integer(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum}, got {value}")
        return value

    parse.__name__ = "integer"  # argparse names the type in "invalid <name> value" messages
    return parse


def float_between(minimum: float, maximum: float = math.inf) -> Callable[[str], float]:
    """An argparse ``type`` for finite floats in ``[minimum, maximum]``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or not minimum <= value <= maximum:
            bounds = f">= {minimum}" if maximum == math.inf else f"in [{minimum}, {maximum}]"
            raise argparse.ArgumentTypeError(f"must be a finite number {bounds}, got {text}")
        return value

    parse.__name__ = "number"
    return parse


def _report_target(path: str) -> tuple[Path, bool]:
    """``(file to write, is_regular)``: a symlink to a report is followed, so the link stays;
    an existing non-regular file (a pipe behind ``/dev/stdout``) is written where it is named."""
    given = Path(path)
    if given.exists() and not stat.S_ISREG(given.stat().st_mode):
        return given, False
    return Path(os.path.realpath(given)), True


def check_destination(path: str, option: str = "--json") -> Path:
    """Check, before any work, that a report can be written to ``path``; return its target.

    Refused (:class:`UsageError`): an empty path, a directory, a missing parent directory, a
    parent that is not a directory or cannot take a new file (tried, not guessed: permission
    bits say nothing on a read-only mount or for root), an existing file that is read-only.
    An existing non-regular file (``/dev/stdout``, a pipe) is written in place.
    """
    if not path:
        raise UsageError(f"{option}: the path is empty")
    target, regular = _report_target(path)
    shown = f"{option} {path}"
    if target.is_dir():
        raise UsageError(f"{shown}: is a directory; name a file inside it")
    parent = target.parent
    if not parent.exists():
        raise UsageError(f"{shown}: directory {parent} does not exist; create it first")
    if not parent.is_dir():
        raise UsageError(f"{shown}: {parent} is not a directory")
    if target.exists() and not os.access(target, os.W_OK):
        raise UsageError(f"{shown}: the file is read-only")
    if not regular:
        return target
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=f".{target.name}.", suffix=".probe"):
            pass
    except OSError as error:
        reason = error.strerror or str(error)
        raise UsageError(f"{shown}: cannot create a file in {parent} ({reason})") from error
    return target


def _new_file_mode() -> int:
    """The mode ``open(path, "w")`` would give a new file (the temp file starts at 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_file_atomically(path: str, write: Callable[[str], None]) -> None:
    """Have ``write(temp_path)`` write the file, then move it over ``path`` in one rename.

    A reader (or a crash) sees the old file or the new one, never half of one. The temp file
    sits next to the target (a rename cannot cross file systems) and keeps its suffix, so a
    writer that picks a format from the suffix (matplotlib) still does. Non-regular targets
    (``/dev/stdout``, a pipe) cannot be renamed over: they are written in place.
    """
    target, regular = _report_target(path)
    if not regular:
        write(str(target))
        return
    mode = stat.S_IMODE(target.stat().st_mode) if target.exists() else _new_file_mode()
    handle, temp = tempfile.mkstemp(
        dir=target.parent, prefix=f".{target.stem}.", suffix=target.suffix or ".tmp"
    )
    os.close(handle)
    try:
        write(temp)
        os.chmod(temp, mode)
        with open(temp, "rb") as written:
            os.fsync(written.fileno())
        os.replace(temp, target)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def write_text_atomically(path: str, text: str) -> None:
    """:func:`write_file_atomically` for a text report."""
    write_file_atomically(path, lambda temp: Path(temp).write_text(text))


def check_plotting(option: str) -> None:
    """Refuse ``option`` up front when matplotlib (the ``plot`` extra) is not installed."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError(
            f"{option} needs matplotlib: pip install 'eplb-graph[plot]' (or pass no plot option)"
        )
