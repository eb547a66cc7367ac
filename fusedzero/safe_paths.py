"""Paths given on the command line, written so that no write goes through a link.

    check_output(path, what)            refuse a link, FIFO, device, socket or folder there
    replace_file(path, write, what)     a fresh temporary beside `path`, renamed over it
    open_append(path, what)             append to a regular file (or a new one), never a link

`what` names the path in errors, as the user gave it (`--out-json`). Every refusal is an
UnsafePath (a ValueError): one line naming `what`, the path, what is there and the fix.

[Note: no write through a link] An output path is lstat-ed before anything is written: a
symlink (dangling or not) is refused, and so is anything but a regular file (a FIFO, whose open
for writing waits for a reader; a device; a socket; a folder). A replaced file is written to a
temporary created with O_CREAT|O_EXCL|O_NOFOLLOW under a fresh random name (a file or link
planted there in advance makes the open fail, never a write through it) and renamed over the
path: a rename replaces the name itself, so a link planted after the check is replaced, its
target untouched. An appended file is opened with O_NOFOLLOW|O_NONBLOCK (a link planted after
the check fails the open, a FIFO opens without waiting) and fstat-ed: only a regular file is
written to. The temporary is `fusedzero ckpt export`'s (checkpoint.format.create_temp), which
refuses its OUT the same way.
"""
from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from fusedzero.checkpoint.format import create_temp

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)

_KINDS = ((stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


class UnsafePath(ValueError):
    """A path the CLI refuses: an output that is a link or not a regular file."""


def kind(mode: int) -> str:
    """What a stat mode is, for an error message: "a symlink", "a FIFO", ..."""
    return next((k for test, k in _KINDS if test(mode)), "not a regular file")


def _show(path: str | os.PathLike[str]) -> str:
    return repr(os.fspath(path))


# -- outputs: See [Note: no write through a link] -------------------------------------------------
def _refuse_output(path: str | os.PathLike[str], mode: int, what: str) -> UnsafePath:
    k = kind(mode)
    why, fix = {"a symlink": ("writing through a link would change its target",
                              "remove the link or pass another path"),
                "a folder": ("a file is written there", "pass a file path")}.get(
        k, ("only a regular file is replaced or appended to", "remove it or pass another path"))
    return UnsafePath(f"{what} {_show(path)} is {k}; refusing to write there ({why}): {fix}")


def check_output(path: str | os.PathLike[str], what: str) -> None:
    """Raise UnsafePath unless `path` is absent or a regular file (not a link to one)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except NotADirectoryError:
        return  # a folder above it is a file: the write fails and says so
    if not stat.S_ISREG(st.st_mode):
        raise _refuse_output(path, st.st_mode, what)


def replace_file(path: str | os.PathLike[str], write: Callable[[BinaryIO], object],
                 what: str) -> None:
    """Write `path` anew: `write(f)` fills a temporary beside it, which is synced and renamed
    over `path`. A crash leaves the old file or the new one, never a torn one; a link or a
    non-regular file at `path` is refused (UnsafePath) before anything is written."""
    check_output(path, what)
    tmp, f = create_temp(Path(path))
    try:
        with f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def open_append(path: str | os.PathLike[str], what: str) -> BinaryIO:
    """`path` opened for appending, unbuffered (each write is one write(2)), created if absent
    (0666 less the umask); UnsafePath for a link or anything but a regular file."""
    check_output(path, what)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | _NONBLOCK
                     | _CLOEXEC, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:  # a link planted since the check
            raise _refuse_output(path, stat.S_IFLNK, what) from None
        if e.errno == errno.ENXIO:  # a FIFO with no reader, planted since the check
            raise _refuse_output(path, stat.S_IFIFO, what) from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _refuse_output(path, mode, what)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "ab", buffering=0)
