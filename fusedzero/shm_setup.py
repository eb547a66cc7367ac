"""Setting up a group's shared-memory collectives (fusedzero/shm.py): one file per rank in
/dev/shm, mapped by every rank of the group, agreed on by a handshake over the group itself.

Every rank creates its file (sparse, the header backed), the ranks exchange (able, pid, token,
arena size) over gloo, map each other's files and check the token each wrote in its header (a
file of the same name on another host or in another container holds another), then agree that
all mapped; each unlinks its file at once, so nothing is left in /dev/shm whatever happens to
the ranks later. If any rank could not, every rank gets None (fusedzero/direct.py then runs).
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
    (another host, a private /dev/shm, another platform). `wait(work, what)` waits on the
    handshake's gloo collectives (comm.wait: a silent peer ends in a timeout naming them)."""
    cap = int(float(os.environ.get("FUSEDZERO_SHM_MB", "256")) * 2**20) // _ALIGN * _ALIGN
    token = secrets.randbits(62)
    fd, mine = -1, None
    path = f"/dev/shm/fusedzero-{os.getpid()}-{token:x}"
    if supported() and cap > 0:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, HEADER + cap)  # sparse: backed as regions reach further
            os.posix_fallocate(fd, 0, HEADER)
            mine = mmap.mmap(fd, HEADER + cap)
            hdr = memoryview(mine)[:HEADER].cast("q")
            hdr[_MAGIC], hdr[_DONE] = token, -1
            hdr.release()
        except OSError:
            mine = None
    # Tensors, not all_gather_object (whose unpickling needs numpy): (ok, pid, token, cap).
    me = torch.tensor([mine is not None, os.getpid(), token, cap], dtype=torch.int64)
    infos = [torch.empty(4, dtype=torch.int64) for _ in range(world)]
    wait(dist.all_gather(infos, me, group=group, async_op=True),
         "the setup of shared-memory collectives (the group's first collective)")
    cap = min(int(i[3]) for i in infos)
    maps: list[mmap.mmap | None] = [None] * world
    if all(bool(i[0]) for i in infos):
        maps[rank] = mine
        for q, i in enumerate(infos):
            if q != rank:
                maps[q] = _map_peer(f"/dev/shm/fusedzero-{int(i[1])}-{int(i[2]):x}",
                                    int(i[2]), HEADER + cap)
    ok = torch.tensor([all(m is not None for m in maps)], dtype=torch.int64)
    wait(dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group, async_op=True),
         "the setup of shared-memory collectives (every rank mapped)")
    if mine is not None:
        try:
            os.unlink(path)  # mappings stay; nothing is left in /dev/shm if a rank dies
        except OSError:
            pass
    if not bool(ok):
        if fd >= 0:
            os.close(fd)
        return None
    return Channel(rank, world, fd, maps, cap)


def _map_peer(path: str, token: int, size: int) -> mmap.mmap | None:
    """A peer's arena, if its file opens here and holds the token the peer wrote (not another
    host's or container's file of the same name)."""
    try:
        with open(path, "r+b") as f:
            m = mmap.mmap(f.fileno(), size)
    except (OSError, ValueError):
        return None
    hdr = memoryview(m)[:HEADER].cast("q")
    same = hdr[_MAGIC] == token
    hdr.release()
    return m if same else None
