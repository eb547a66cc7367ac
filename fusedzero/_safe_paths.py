"""Paths given on the command line, read and written so that no write goes through a link and no
read waits on a FIFO or reads a device.

    check_output(path, what)            refuse a link, FIFO, device, socket or folder there
    replace_file(path, write, what)     a fresh temporary beside `path`, renamed over it
    open_append(path, what)             append to a regular file (or a new one), never a link
    check_input(path, what)             a regular file (or folder), never a FIFO or device
    read_bytes(path, what, limit=None)  a regular file's bytes, at most `limit` of them
    read_json(path, what, limit)        ... parsed; nesting too deep is an error, not a crash
    parse_json(text, where)             json.loads with that error

`what` names the path in errors, as the user gave it (`--out-json`, `--data`). Every refusal is
an UnsafePath (a ValueError): one line naming `what`, the path, what is there and the fix.

[Note: no write through a link] An output path is lstat-ed before anything is written: a
symlink (dangling or not) is refused, and so is anything but a regular file (a FIFO, whose open
for writing waits for a reader; a device; a socket; a folder). A replaced file is written to a
temporary created with O_CREAT|O_EXCL|O_NOFOLLOW under a fresh random name (a file or link
planted there in advance makes the open fail, never a write through it) and renamed over the
path: a rename replaces the name itself, so a link planted after the check is replaced, its
target untouched. An appended file is opened with O_NOFOLLOW|O_NONBLOCK (a link planted after
the check fails the open, a FIFO opens without waiting) and fstat-ed: only a regular file is
written to. The temporary is `fusedzero ckpt export`'s (checkpoint._format.create_temp), which
refuses its OUT the same way.

[Note: no read from a FIFO or device] An input path is followed (a link to a regular file is
read as that file) and must end at a regular file (or, where a folder is asked for, a folder):
reading a FIFO waits for a writer forever, /dev/zero never ends (a `*.txt -> /dev/zero` link in a
corpus folder read until memory ran out), a socket cannot be opened. The check is made on the
opened file (O_NONBLOCK, so a FIFO opens at once; then fstat), not on the name before it, so a
FIFO swapped in between is refused too.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from fusedzero.checkpoint._format import create_temp, file_kind

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)

# Why each kind is refused, as the error says it.
_WHY_NOT_READ = {
    "a FIFO": "a read would wait for a writer forever",
    "a character device": "a device is not a file: /dev/zero never ends",
    "a block device": "a device is not a file",
    "a socket": "a socket cannot be read as a file",
}


class UnsafePath(ValueError):
    """A path the CLI refuses: an output that is a link or not a regular file, an input that is
    a FIFO, a device or a socket, or a file too large or too deeply nested to read."""


def _show(path: str | os.PathLike[str]) -> str:
    return repr(os.fspath(path))


# -- outputs: See [Note: no write through a link] -------------------------------------------------
def _refuse_output(path: str | os.PathLike[str], mode: int, what: str) -> UnsafePath:
    k = file_kind(mode)
    why, fix = {
        "a symlink": (
            "writing through a link would change its target",
            "remove the link or pass another path",
        ),
        "a folder": ("a file is written there", "pass a file path"),
    }.get(k, ("only a regular file is replaced or appended to", "remove it or pass another path"))
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


def replace_file(
    path: str | os.PathLike[str], write: Callable[[BinaryIO], object], what: str
) -> None:
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
        fd = os.open(
            path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | _NONBLOCK | _CLOEXEC, 0o666
        )
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


# -- inputs: See [Note: no read from a FIFO or device] --------------------------------------------
def _refuse_input(path: str | os.PathLike[str], mode: int, what: str, folder: bool) -> UnsafePath:
    k = file_kind(mode)
    want = "a regular file or a folder" if folder else "a regular file"
    why = _WHY_NOT_READ.get(k, f"not {want}")
    return UnsafePath(f"{what} {_show(path)} is {k}; refusing to read it ({why}): pass {want}")


def check_input(path: str | os.PathLike[str], what: str, *, folder: bool = False) -> None:
    """Raise UnsafePath unless `path` (links followed) is a regular file, or with `folder` a
    folder. A path that does not exist passes: the caller says what it needs there."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return
    if not (stat.S_ISREG(st.st_mode) or (folder and stat.S_ISDIR(st.st_mode))):
        raise _refuse_input(path, st.st_mode, what, folder)


def read_bytes(path: str | os.PathLike[str], what: str, limit: int | None = None) -> bytes:
    """The bytes of the regular file at `path` (links followed); UnsafePath for a FIFO, a device
    or a socket, or for a file of more than `limit` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | _NONBLOCK | _CLOEXEC)  # a FIFO opens without a writer
    except OSError as e:
        if e.errno == errno.ENXIO:  # a socket (or a device with no driver behind it)
            raise _refuse_input(path, os.stat(path).st_mode, what, folder=False) from None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse_input(path, st.st_mode, what, folder=False)
        if limit is None:
            return f.read()
        data = f.read(limit + 1)  # the size read, not the size stat says (it may grow)
    if len(data) > limit:
        raise UnsafePath(
            f"{what} {_show(path)} holds more than {limit} bytes; refusing to read "
            "it (no such file is that large): pass the right file"
        )
    return data


def parse_json(text: str | bytes, where: str) -> Any:
    """json.loads, with nesting too deep for Python's parser (a RecursionError, say 100000
    nested lists) raised as UnsafePath naming `where`. Malformed JSON stays a JSONDecodeError."""
    try:
        return json.loads(text)
    except RecursionError:
        raise UnsafePath(
            f"{where}: JSON nested too deeply to parse (Python's parser recurses "
            "once per level); pass a real JSON file"
        ) from None


def read_json(path: str | os.PathLike[str], what: str, limit: int) -> Any:
    """A JSON file of at most `limit` bytes, parsed (read_bytes, then parse_json); a file that
    is not JSON is a ValueError naming `what` and the path."""
    data = read_bytes(path, what, limit)
    try:
        return parse_json(data, f"{what} {_show(path)}")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{what} {_show(path)} is not JSON ({e}); pass a JSON file") from None
