"""Setting up a group's shared-memory collectives (fusedzero/shm.py): one anonymous memory file
per rank (memfd), mapped by every rank of the group, agreed on by a handshake over the group.

Every rank creates its memfd (sparse, the header backed), the ranks exchange (able, pid, fd,
token, arena size) over gloo, open each other's through /proc/<pid>/fd/<fd>, map them and check
the token each wrote in its header (on another host or in another pid namespace that path is
some other process's, or nothing), then agree that all mapped. A memfd has no name in any file
system: its memory goes when the last rank holding it exits, however it exits (a file in
/dev/shm outlives a rank killed before unlinking it, and counts against /dev/shm's size, 64 MB
in a default Docker container). If any rank could not, every rank gets None
(fusedzero/direct.py then runs).
"""
from __future__ import annotations

import mmap
import os
import platform
import secrets
from collections.abc import Callable

import torch
import torch.distributed as dist

from fusedzero.shm import _ALIGN, _DONE, _MAGIC, HEADER, Channel


def supported() -> bool:
    """Linux on x86-64: the futex call, and x86's store order ([Note: shared-memory
    collectives])."""
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")


def open_channel(group: dist.ProcessGroup | None, rank: int, world: int,
                 wait: Callable[[dist.Work, str], None]) -> Channel | None:
    """Collective over `group`: map every rank's arena, or None on every rank if any rank cannot
    (another host or pid namespace, another platform). `wait(work, what)` waits on the
    handshake's gloo collectives (comm.wait: a silent peer ends in a timeout naming them)."""
    cap = int(float(os.environ.get("FUSEDZERO_SHM_MB", "256")) * 2**20) // _ALIGN * _ALIGN
    token = secrets.randbits(62)
    fd, mine = -1, None
    if supported() and cap > 0 and hasattr(os, "memfd_create"):
        try:
            fd = os.memfd_create(f"fusedzero-{token:x}", os.MFD_CLOEXEC)
            os.ftruncate(fd, HEADER + cap)  # sparse: backed as regions reach further
            os.posix_fallocate(fd, 0, HEADER)
            mine = mmap.mmap(fd, HEADER + cap)
            hdr = memoryview(mine)[:HEADER].cast("q")
            hdr[_MAGIC], hdr[_DONE] = token, -1
            hdr.release()
        except OSError:
            mine = None
    # Tensors, not all_gather_object (whose unpickling needs numpy): (ok, pid, fd, token, cap).
    me = torch.tensor([mine is not None, os.getpid(), fd, token, cap], dtype=torch.int64)
    infos = [torch.empty(5, dtype=torch.int64) for _ in range(world)]
    wait(dist.all_gather(infos, me, group=group, async_op=True),
         "the setup of shared-memory collectives (the group's first collective)")
    cap = min(int(i[4]) for i in infos)
    maps: list[mmap.mmap | None] = [None] * world
    if all(bool(i[0]) for i in infos):
        maps[rank] = mine
        for q, i in enumerate(infos):
            if q != rank:
                maps[q] = _map_peer(f"/proc/{int(i[1])}/fd/{int(i[2])}", int(i[3]),
                                    HEADER + cap)
    ok = torch.tensor([all(m is not None for m in maps)], dtype=torch.int64)
    wait(dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group, async_op=True),
         "the setup of shared-memory collectives (every rank mapped)")
    if not bool(ok):
        if fd >= 0:
            os.close(fd)
        return None
    return Channel(rank, world, fd, maps, cap)


def _map_peer(path: str, token: int, size: int) -> mmap.mmap | None:
    """A peer's arena through its memfd, if it opens here and holds the token the peer wrote
    (another host's or pid namespace's process of the same pid holds no such file)."""
    try:
        with open(path, "r+b") as f:
            m = mmap.mmap(f.fileno(), size)
    except (OSError, ValueError):
        return None
    hdr = memoryview(m)[:HEADER].cast("q")
    same = hdr[_MAGIC] == token
    hdr.release()
    return m if same else None
