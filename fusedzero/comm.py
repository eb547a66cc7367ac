"""Collectives as free functions, each counted in bytes on the wire.

Every call is `async_op=True` and returns a handle (or None when the group has one rank: world
size 1 is the degenerate case of the same code, with nothing to send). On NCCL (GPU) they are
torch.distributed's collectives and the work handle orders the streams; on gloo (CPU) the wait
blocks the host. torch.distributed is the only transport, as in every peer we compare with.

Bytes are counted per rank by the ring formulas, with n the full (unsharded) element count of the
collective and b its element size: all-reduce 2(W-1)/W*n*b, reduce-scatter and all-gather
(W-1)/W*n*b. These are exact integers because n is a multiple of W for every sharded buffer.
"""
from __future__ import annotations

import dataclasses
import datetime
import enum
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

# A process group, or None for the default (world) group.
Group = Optional[dist.ProcessGroup]
# What an async collective returns: a work handle, or None where nothing was sent (1 rank).
Handle = Optional[dist.Work]



class CollectiveKind(str, enum.Enum):
    """The collectives the optimizer issues per step. The values are the keys of
    `CommCounter`'s dicts and of `--out-json`'s comm_bytes_per_step."""

    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    ALL_TO_ALL = "all_to_all"  # compressed wire (fusedzero.wire): (W-1)/W of the packed bytes


KINDS: tuple[str, ...] = tuple(k.value for k in CollectiveKind)

# How long a wait on other ranks may take before the run ends with an error naming the wait, when
# the process group was created with torch's default timeout (gloo: 30 minutes, long enough for a
# silent stall to waste a job). 10 minutes covers a first Triton compile and a large checkpoint
# write on a slow disk; pass `timeout=` to `init_process_group` (or `fusedzero train --timeout`)
# to choose another value: a group's own non-default timeout is used as it is.
DEFAULT_TIMEOUT_S = 600.0


class CollectiveTimeout(RuntimeError):
    """A wait on other ranks did not finish in time: some rank stalled or took another path."""


@dataclasses.dataclass
class CommCounter:
    """Bytes on the wire and element counts per collective kind, for this rank."""

    bytes: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    numel: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    calls: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(KINDS, 0))

    def add(self, kind: CollectiveKind, numel: int, element_size: int, world_size: int) -> None:
        # Ring algorithms: an all-reduce is a reduce-scatter followed by an all-gather.
        factor = 2 if kind is CollectiveKind.ALL_REDUCE else 1
        key = kind.value
        self.bytes[key] += factor * (world_size - 1) * numel * element_size // world_size
        self.numel[key] += numel
        self.calls[key] += 1

    def reset(self) -> None:
        for d in (self.bytes, self.numel, self.calls):
            for k in d:
                d[k] = 0

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {"bytes": dict(self.bytes), "numel": dict(self.numel), "calls": dict(self.calls)}

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommContext:
    """What whoever issues collectives needs: the group, its size and this rank's place in it,
    the byte counter, the optional event trace (tests read the order of collectives), and how
    waits on the group behave. Build it with `CommContext.of(group, counter, trace)`."""

    group: Group
    world_size: int
    rank: int
    counter: CommCounter
    trace: list[tuple[str, Any]] | None = None
    # Read from the process group once, here: a wait inside a forward hook runs under
    # torch.compile, whose tracer refuses the process group's private attributes.
    timeout: float = DEFAULT_TIMEOUT_S
    host_blocking: bool = True

    @classmethod
    def of(cls, group: Group, counter: CommCounter, trace: list[tuple[str, Any]] | None = None,
           device: torch.device | None = None) -> CommContext:
        """`device` is accepted for symmetry with the callers; nothing is set up per device."""
        del device
        return cls(group=group, world_size=group_size(group), rank=group_rank(group),
                   counter=counter, trace=trace, timeout=group_timeout(group),
                   host_blocking=_host_blocking(group))

    def record(self, event: str, detail: Any) -> None:
        if self.trace is not None:
            self.trace.append((event, detail))

    def wait(self, handle: Handle, what: str) -> None:
        wait(handle, what=what, group=self.group, timeout=self.timeout,
             host_blocking=self.host_blocking)


def group_size(group: Group) -> int:
    if group is None and not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: Group) -> int:
    if group is None and not dist.is_initialized():
        return 0
    return dist.get_rank(group)


# torch 2.13 renamed the tensor collectives to *_single and deprecated the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: Group, world_size: int,
                   counter: CommCounter) -> Handle:
    """Sum `inp` over ranks; this rank's 1/W slice lands in `out` (may alias that slice)."""
    if world_size == 1:
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return None
    counter.add(CollectiveKind.REDUCE_SCATTER, inp.numel(), inp.element_size(), world_size)
    return _reduce_scatter(out, inp, group=group, async_op=True)


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: Group, world_size: int,
               counter: CommCounter) -> Handle:
    """Concatenate every rank's `inp` into `out` (`inp` may be this rank's slice of `out`)."""
    if world_size == 1:
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return None
    counter.add(CollectiveKind.ALL_GATHER, out.numel(), out.element_size(), world_size)
    return _all_gather(out, inp, group=group, async_op=True)


def all_to_all(out: torch.Tensor, inp: torch.Tensor, group: Group, world_size: int,
               counter: CommCounter) -> Handle:
    """Chunk r of `inp` goes to rank r, chunk s of `out` comes from rank s (W equal chunks).
    Counted as the reduce-scatter it replaces: this rank sends W-1 of its W chunks."""
    if world_size == 1:
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return None
    counter.add(CollectiveKind.ALL_TO_ALL, inp.numel(), inp.element_size(), world_size)
    return dist.all_to_all_single(out, inp, group=group, async_op=True)


def all_reduce(t: torch.Tensor, group: Group, world_size: int, counter: CommCounter) -> Handle:
    """Sum `t` over ranks in place."""
    if world_size == 1:
        return None
    counter.add(CollectiveKind.ALL_REDUCE, t.numel(), t.element_size(), world_size)
    return dist.all_reduce(t, group=group, async_op=True)


def group_timeout(group: Group = None) -> float:
    """Seconds a wait on `group` may take: the group's timeout if it was set explicitly at
    `init_process_group`/`new_group`, else DEFAULT_TIMEOUT_S (never torch's 30-minute default)."""
    if not dist.is_initialized():
        return DEFAULT_TIMEOUT_S
    pg = group if group is not None else dist.group.WORLD
    for dev in getattr(pg, "_device_types", ()):
        try:
            t = pg._get_backend(dev).options._timeout
        except (AttributeError, RuntimeError):
            continue  # a backend without readable options: use the default
        if isinstance(t, datetime.timedelta) and t != dist.default_pg_timeout:
            return t.total_seconds()
    return DEFAULT_TIMEOUT_S


def _host_blocking(group: Group) -> bool:
    """True where `Work.wait` blocks the host anyway (gloo). On NCCL a wait only orders streams;
    passing it a timeout would turn it into a host sync in `step()`, so NCCL is left to its
    watchdog, which aborts the communicator after the group's timeout."""
    try:
        return dist.get_backend(group) != "nccl"
    except (RuntimeError, ValueError):
        return True


# Dynamo cannot trace a wait on other ranks (nor the process-group internals it reads): when a
# compiled model's hook waits, the graph breaks here, once, with this function named.
@torch.compiler.disable(reason="fusedzero.comm.wait blocks on other ranks")
def wait(handle: Handle, what: str = "a collective", group: Group = None,
         timeout: float | None = None, host_blocking: bool | None = None) -> None:
    """Wait for `handle`; past `timeout` seconds (default: `group_timeout(group)`) raise
    CollectiveTimeout naming this rank and `what` it waited for (e.g. "all-gather of unit 3
    params"), so a stalled or diverged rank ends the run instead of hanging it.
    `host_blocking` (default: asked of the group) says whether the wait blocks the host."""
    if handle is None:
        return
    if not (_host_blocking(group) if host_blocking is None else host_blocking):
        handle.wait()
        return
    limit = group_timeout(group) if timeout is None else timeout
    t0 = time.monotonic()
    try:
        handle.wait(datetime.timedelta(seconds=limit))
    except RuntimeError as e:
        elapsed = time.monotonic() - t0
        rank = group_rank(group)
        msg = " ".join(str(e).split())
        # gloo reports its own transport timeout ("Timed out waiting ...") when the group's
        # timeout is the shorter one; either way the cause is a rank that did not join.
        if elapsed >= 0.9 * limit or "timed out" in msg.lower():
            raise CollectiveTimeout(
                f"rank {rank}: timed out after {elapsed:.0f}s (limit {limit:g}s) waiting for "
                f"{what}; another rank stalled or ran a different collective (rank-dependent "
                "control flow, e.g. a module run on some ranks only). Raise the limit with "
                "the process group's timeout (fusedzero train --timeout) if it is just slow"
            ) from None
        raise RuntimeError(f"rank {rank}: {what} failed: {msg}") from e


def broadcast(t: torch.Tensor, group: Group, world_size: int) -> Handle:
    """Overwrite `t` with the value group rank 0 holds (async). Used once, at construction, to
    start replicas from one copy (as DDP); not per-step traffic, so not counted."""
    if world_size == 1:
        return None
    src = 0 if group is None else dist.get_global_rank(group, 0)
    return dist.broadcast(t, src=src, group=group, async_op=True)
