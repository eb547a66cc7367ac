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


def die_with_parent(parent_pid: int) -> None:
    """Call first thing in a spawned rank: end this process when `parent_pid` is gone."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # no usable libc: the watchdog below still covers it
    if os.getppid() != parent_pid:  # the launcher died before prctl took effect
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(POLL_S)
            if os.getppid() != parent_pid:
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
