"""Reading an operator's input file (a config, the relay's secrets, a job, a recorded stream): one place
that turns every way a path can fail into one line.

Rule: only a regular file is read. A missing path, a directory, a FIFO, socket or device, a file the
process may not open (EACCES) and one whose read fails (EIO) each raise ``UnreadableFile`` with its own
message naming the path and what it was meant to be; the caller prints it and exits 2, never a traceback.
The file is opened non-blocking and checked on the descriptor, so a FIFO with no writer does not hang the
check and nothing can swap the path between the check and the read.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import BinaryIO

__all__ = ["UnreadableFile", "open_input", "read_error", "read_input"]

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


class UnreadableFile(ValueError):
    """A path that cannot be read as the input it was given for; the message is one line."""


def read_error(path: str | os.PathLike[str], what: str, exc: OSError) -> UnreadableFile:
    """The one-line error for ``exc``, raised opening or reading ``path`` (``what``: "config file"...)."""
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return UnreadableFile(f"no such {what}: {os.fspath(path)}")
    if exc.errno == errno.EISDIR:
        return UnreadableFile(f"{what} {os.fspath(path)} is a directory, not a regular file")
    return UnreadableFile(f"cannot read {what} {os.fspath(path)}: {exc.strerror or exc}")


def open_input(path: str | os.PathLike[str], what: str) -> BinaryIO:
    """``path`` opened for reading, once it is known to be a regular file. Raises ``UnreadableFile``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise read_error(path, what, exc) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((f"{name}, not" for test, name in _KINDS if test(mode)), "not")
            raise UnreadableFile(f"{what} {os.fspath(path)} is {kind} a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_input(path: str | os.PathLike[str], what: str) -> bytes:
    """The whole content of the regular file ``path``. Raises ``UnreadableFile``."""
    with open_input(path, what) as f:
        try:
            return f.read()
        except OSError as exc:  # EIO, or a file system that refuses the read after the open
            raise read_error(path, what, exc) from None
