"""Process lifecycle of a local run: ranks die with their launcher, SIGTERM stops like Ctrl-C.

[Note: orphaned ranks] A rank spawned by `fusedzero train` whose launcher is killed (SIGKILL, an
OOM kill, a scheduler's SIGTERM) would go on training with PPID 1 and later block forever writing
its report into a pipe nobody reads. Two guards, because each has a gap:
- Linux `prctl(PR_SET_PDEATHSIG, SIGKILL)`: the kernel kills the rank the moment the launcher's
  thread that spawned it exits. Set after the fork, so a launcher that died before it is caught
  by comparing the parent pid right after.
- A daemon thread polling `os.getppid()` (every POLL_S): covers systems without prctl.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Iterator

# How often the watchdog thread checks that the launcher is alive: a rank outlives it by at most
# this on systems without PR_SET_PDEATHSIG.
POLL_S = 1.0
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


class Terminated(KeyboardInterrupt):
    """SIGTERM (or SIGHUP) received: unwinds like Ctrl-C, so the same cleanup runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def die_with_parent(parent_pid: int) -> None:
    """Call first thing in a spawned rank: end this process when `parent_pid` (the launcher) is
    gone. The rank's parent is the launcher, or on CPU the launcher's fork server
    (fusedzero/_spawn.py), which leaves as soon as the launcher does: either way the rank goes
    when its parent does (SIGKILL on the parent's death, and a watchdog)."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # no usable libc: the watchdog below still covers it
    if parent_pid not in (parent, _parent_of(parent)):  # it died before prctl took effect
        os._exit(1)

    # A fork server outlives the launcher while any of its children runs (they hold its
    # liveness pipe), so the launcher itself is watched, through a pidfd where there is one.
    try:
        launcher: int | None = os.pidfd_open(parent_pid)
    except (AttributeError, OSError):
        launcher = None

    def watch() -> None:
        while True:
            if launcher is not None:
                if select.select([launcher], [], [], POLL_S)[0]:
                    os._exit(1)  # the launcher exited: nobody is left to report to
            else:
                time.sleep(POLL_S)
            if os.getppid() != parent:
                os._exit(1)  # nobody is left to report to; no cleanup can help

    threading.Thread(target=watch, name="fusedzero-parent-watchdog", daemon=True).start()


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise `Terminated` (a KeyboardInterrupt) in the main
    thread, so `finally` blocks that stop the ranks run as they do for Ctrl-C. A no-op outside
    the main thread (Python delivers signals there only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise Terminated(signum)

    sigs = [signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    old = {s: signal.signal(s, handler) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
