"""Files a user names: read in bounded time and memory, replaced atomically.

A path from a command line or a configuration can name anything: a FIFO (opening it for reading
blocks until some writer comes), a link to ``/dev/zero`` (a read never ends), a socket, or a
multi-gigabyte file. A loader that expects a few kilobytes of JSON must refuse those before it
commits to reading them, and must not trust the size it was told either (``/proc`` files report
0 bytes; a file may grow between the check and the read). A file that is rewritten while others
may read it (a recorded expert map) must never be seen half-written, even after a crash.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path

from eplb_graph.errors import EplbError

_FILE_KINDS = {
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


class RefusedFileError(EplbError, OSError):
    """A path was refused before (or while) reading: not a regular file, or over a size cap.

    An ``OSError``: like a missing file it is input that cannot be read (fix the path), which
    callers already tell apart from content that is wrong (fix the file). ``strerror`` holds the
    problem alone and ``filename`` the path; ``str()`` names both.
    """

    def __init__(self, problem: str, *, path: str | os.PathLike, code: int = errno.EINVAL) -> None:
        super().__init__(code, problem, os.fspath(path))
        self.path = os.fspath(path)
        self.problem = problem

    def __str__(self) -> str:
        return f"{self.path}: {self.problem}"

    def __reduce__(self) -> tuple[object, ...]:
        return _rebuild, (type(self), self.problem, self.path, self.errno)


def _rebuild(kind: type[RefusedFileError], problem: str, path: str, code: int) -> RefusedFileError:
    return kind(problem, path=path, code=code)


def check_regular_file(
    path: str | os.PathLike,
    status: os.stat_result,
    *,
    max_bytes: int,
    what: str,
    error: type[RefusedFileError] = RefusedFileError,
) -> None:
    """Refuse, from its ``stat`` alone, a file that cannot be ``what`` (kind and size).

    Raises:
        IsADirectoryError: a directory (as opening one for reading would).
        RefusedFileError (or ``error``): any other non-regular file, or more than ``max_bytes``.
    """
    mode = status.st_mode
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), os.fspath(path))
    if not stat.S_ISREG(mode):
        kind = _FILE_KINDS.get(stat.S_IFMT(mode), "not a regular file")
        target = os.path.realpath(path)
        via = f" (the link resolves to {target})" if target != os.path.abspath(path) else ""
        raise error(f"is {kind}{via}, not a regular file; {what} is a file on disk", path=path)
    if status.st_size > max_bytes:
        raise too_large(path, status.st_size, max_bytes=max_bytes, what=what, error=error)


def too_large(
    path: str | os.PathLike,
    size: int,
    *,
    max_bytes: int,
    what: str,
    error: type[RefusedFileError] = RefusedFileError,
    exact: bool = True,
) -> RefusedFileError:
    """The error for a file of ``size`` bytes (``exact=False``: at least) over ``max_bytes``."""
    shown = f"{size} bytes" if exact else f"more than {max_bytes} bytes"
    return error(
        f"is {shown}, over the {max_bytes}-byte limit of {what}; check the path",
        path=path,
        code=errno.EFBIG,
    )


def read_regular_file(
    path: str | os.PathLike,
    *,
    max_bytes: int,
    what: str,
    error: type[RefusedFileError] = RefusedFileError,
) -> bytes:
    """The bytes of a regular file of at most ``max_bytes``, read in bounded time and memory.

    The path (symlinks resolved) is checked before it is opened, opened without blocking, and
    checked again on the open descriptor (the path may have been replaced in between); then at
    most ``max_bytes + 1`` bytes are read, so a file that grows, or reports no size, still costs
    a bounded read.

    Args:
        what: how messages name the expected content (``"an expert map"``).
        error: the refusal type to raise (a subclass with its own message prefix).

    Raises:
        OSError: missing, a directory (``IsADirectoryError``), not permitted.
        RefusedFileError (or ``error``): not a regular file, or larger than ``max_bytes``.
    """
    check_regular_file(path, os.stat(path), max_bytes=max_bytes, what=what, error=error)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    with open(os.open(path, flags), "rb") as handle:
        status = os.fstat(handle.fileno())
        check_regular_file(path, status, max_bytes=max_bytes, what=what, error=error)
        raw = handle.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise too_large(path, len(raw), max_bytes=max_bytes, what=what, error=error, exact=False)
    return raw


def write_text_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that a reader sees the old content or the new, never a
    mix, even across a crash: a temporary file in the same directory is written and fsynced, then
    ``os.replace``d over the target (atomic within one filesystem) and the directory fsynced.
    An existing file's permission bits are kept; a new file gets 0644.

    Raises:
        OSError: the directory is missing or not writable (nothing is replaced).
    """
    directory = path.parent
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o644
    handle = tempfile.NamedTemporaryFile(  # noqa: SIM115 (closed explicitly before the replace)
        mode="w",
        encoding="utf-8",
        dir=directory,
        prefix=f".{path.name}.",
        suffix=".tmp",
        delete=False,
    )
    temporary = Path(handle.name)
    try:
        with handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_directory(directory)


def _fsync_directory(directory: Path) -> None:
    """Persist the rename itself (POSIX); a no-op where directories cannot be opened."""
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)
