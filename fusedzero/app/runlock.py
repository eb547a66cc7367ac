"""The run folder (`--ckpt-dir`): an exclusive lock for the life of one run, and the checks a
run makes before it trains (writable paths; a new run does not mix into an old run's steps).

Two runs writing one checkpoint folder replace each other's steps and move `latest` back and
forth. The first run takes `<folder>/.fusedzero.lock`; a second one is refused with an error
naming the holder (host, pid, command line, start time).

[Note: lock mechanism] The lock is an `fcntl.flock` on the lock file, so the kernel releases it
when its holder dies in any way (SIGKILL, power loss on a local disk): a lock file left by a dead
process is stale by construction and the next run takes it over, rewriting the owner record.
The owner record is what the error message shows; the flock is what decides. On a network file
system without working flock the lock may not exclude runs on other hosts; the owner record
still names the holder there.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fusedzero import _safe_paths as safe_paths

LOCK_NAME = ".fusedzero.lock"

try:
    import fcntl
except ImportError:  # Windows: no flock; the lock file alone (O_EXCL) excludes, stale ones stay
    fcntl = None  # type: ignore[assignment]


class RunFolderError(ValueError):
    """A run folder or output path that a run must not start with (one line, names the fix)."""


class RunLockError(RunFolderError):
    """The folder is locked by another live run."""


def _owner() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join(sys.argv)[:500],
    }


def _describe(path: Path) -> str:
    try:
        o = json.loads(path.read_text())
        return (
            f"pid {o.get('pid')} on host {o.get('host')!r} since {o.get('started')} "
            f"({o.get('command')!r})"
        )
    except (OSError, ValueError, AttributeError):
        return "an unknown process (unreadable owner record)"


class RunLock:
    """`with RunLock(folder):` holds the folder's lock; `acquire`/`release` for longer scopes.

    Raises RunLockError naming the holder when another live run has the folder.
    """

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self._fd: int | None = None
        self.took_over: str | None = None
        """The owner record of a stale lock this one replaced (its holder was dead)."""

    def acquire(self) -> RunLock:
        if self._fd is not None:
            return self
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            if fcntl is None:
                return self._acquire_exclusive()
            return self._acquire_flock()
        except OSError as e:
            raise RunFolderError(f"cannot lock {str(self.path)!r}: {e.strerror or e}") from None

    def _acquire_flock(self) -> RunLock:
        while True:
            # O_NOFOLLOW: a planted symlink must not make us lock (and rewrite) another file.
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RunLockError(
                    f"{self.folder} is in use by another run: {_describe(self.path)}; wait for "
                    f"it to finish or use another folder (its lock file is {self.path})"
                ) from None
            except BaseException:
                os.close(fd)
                raise
            # The holder may have unlinked the file between our open and flock: then we hold a
            # lock on a file no one else will see. Retry on the file now at the path.
            try:
                same = os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        if os.fstat(fd).st_size:
            self.took_over = _describe(self.path)  # the previous holder died holding it
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps(_owner()) + "\n").encode())
        self._fd = fd
        return self

    def _acquire_exclusive(self) -> RunLock:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            raise RunLockError(
                f"{self.folder} is in use by another run: {_describe(self.path)}; if that "
                f"process is gone, delete {self.path}"
            ) from None
        os.write(fd, (json.dumps(_owner()) + "\n").encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            # Unlink while still holding the flock: a run waiting on the old inode re-checks the
            # path (see acquire) instead of sharing a lock no one else sees.
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


# -- pre-flight checks ---------------------------------------------------------------------------
def check_ckpt_dir(root: str | os.PathLike[str], *, resume: bool, overwrite: bool) -> None:
    """Resuming needs a checkpoint in `root`; a new run must not write into an old run's steps
    (same-step checkpoints replaced, `latest` moved backwards) unless told to `overwrite`."""
    from fusedzero import checkpoint

    root = Path(root)
    found = checkpoint.list_checkpoints(root) if root.is_dir() else []
    if resume and not found:
        raise RunFolderError(
            f"--resume: no complete checkpoint in {str(root)!r}; drop --resume to start a new run"
        )
    if found and not resume and not overwrite:
        raise RunFolderError(
            f"--ckpt-dir {str(root)!r} already holds {len(found)} checkpoint(s) (newest "
            f"{found[-1].name}); pass --resume to continue that run or --overwrite to start "
            "over (the old ones are removed after this run's first save)"
        )


def _probe(folder: Path, flag: str) -> None:
    """Create and remove a file in `folder` (made if missing): permission bits say nothing for
    root or on a read-only mount; a real write does."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=folder, prefix=".fusedzero-probe-")
        os.close(fd)
        os.unlink(name)
    except (FileExistsError, NotADirectoryError):
        raise RunFolderError(
            f"{flag}: {str(folder)!r} (or a folder above it) is a file, not a "
            "folder; pass a folder path"
        ) from None
    except OSError as e:
        raise RunFolderError(
            f"{flag}: cannot write in {str(folder)!r}: {e.strerror or e}; pass a writable folder"
        ) from None


def check_writable(
    ckpt_dir: str | os.PathLike[str] | None, out_json: str | os.PathLike[str] | None
) -> None:
    """Fail now, not after the run (or at its first save), if the checkpoint folder or the
    summary file cannot be written."""
    if ckpt_dir is not None:
        root = Path(ckpt_dir)
        if root.exists() and not root.is_dir():
            raise RunFolderError(
                f"--ckpt-dir {str(root)!r} is a file, not a folder; pass a folder path"
            )
        _probe(root, "--ckpt-dir")
    if out_json is not None:
        out = Path(out_json)
        if out.is_dir():
            raise RunFolderError(f"--out-json {str(out)!r} is a folder; pass a file path")
        _probe(out.parent, "--out-json")
        # The summary replaces the file by a rename (safe_paths.replace_file): the folder's
        # write permission is what counts, and a link there is refused, not written through.
        try:
            safe_paths.check_output(out, "--out-json")
        except safe_paths.UnsafePath as e:
            raise RunFolderError(str(e)) from None
