"""Collectives as free functions, each counted in bytes on the wire.

Every call is `async_op=True` and returns a handle (or None when the group has one rank: world
size 1 is the degenerate case of the same code, with nothing to send). On NCCL (GPU) they are
torch.distributed's collectives and the work handle orders the streams; on gloo (CPU) the wait
blocks the host. torch.distributed is the only transport, as in every peer we compare with.

Bytes are counted per rank by the ring formulas, with n the full (unsharded) element count of the
collective and b its element size: all-reduce 2(W-1)/W*n*b, reduce-scatter and all-gather
(W-1)/W*n*b. These are exact integers because n is a multiple of W for every sharded buffer.

[Note: premul_sum dtypes] fp32 only, and fp16 where `factor` is exact in fp16 (a power of two).
NCCL multiplies by the factor rounded to the data's dtype: in bf16, 1/W for W = 24 is 0.19% too
large, a bias on every grad of every step where DDP's `div_` rounds each quotient on its own. And
torch builds before pytorch/pytorch#190747 (2026-07) passed NCCL a 4-byte float where it reads 2
bytes for bf16: every power-of-two factor became 0, all-zero grads (pytorch/pytorch#190745). fp32's
rounding of 1/W is the last bit, as close as `div_`.

[Note: a hung NCCL collective] A wait on NCCL does not block the host, so no timeout of ours can
see a stalled collective. NCCL's watchdog does: after the group's timeout (the `timeout=` of
init_process_group; `fusedzero train --timeout`) it aborts the communicator and ends the process
with an error naming the rank, the collective (e.g. `OpType=_ALLGATHER_BASE`) and its sequence
number, when asynchronous error handling is on (torch's default, 3, since 2.2; an inherited 0 would
hang silently instead). The flight recorder keeps the last collectives of every rank for that
report (`TORCH_NCCL_TRACE_BUFFER_SIZE`), dumped on a timeout.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import math
import time
from typing import Any

import torch
import torch.distributed as dist

from fusedzero._eager import eager

# A process group, or None for the default (world) group.
Group = dist.ProcessGroup | None
# What an async collective returns: a work handle, or None where nothing was sent (1 rank).
Handle = dist.Work | None


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
    def of(
        cls,
        group: Group,
        counter: CommCounter,
        trace: list[tuple[str, Any]] | None = None,
        device: torch.device | None = None,
    ) -> CommContext:
        """`device`: where the tensors this context's collectives carry live; its type picks
        the backend of a mixed group (`cpu:gloo,cuda:nccl`) and so what a wait means."""
        return cls(
            group=group,
            world_size=group_size(group),
            rank=group_rank(group),
            counter=counter,
            trace=trace,
            timeout=group_timeout(group),
            host_blocking=_host_blocking(group, device),
        )

    def record(self, event: str, detail: Any) -> None:
        if self.trace is not None:
            self.trace.append((event, detail))

    def wait(self, handle: Handle, what: str) -> None:
        wait(
            handle,
            what=what,
            group=self.group,
            timeout=self.timeout,
            host_blocking=self.host_blocking,
        )


def check_same_ranks(group: Group, like: Group, what: str) -> None:
    """`group` spans the ranks of `like` in the same order (rank r of one is rank r of the
    other): a second communicator over them. Raises ValueError naming `what` otherwise."""

    def ranks(g: Group) -> list[int]:
        if g is None and not dist.is_initialized():
            return [0]
        return dist.get_process_group_ranks(g if g is not None else dist.group.WORLD)

    if ranks(group) != ranks(like):
        raise ValueError(
            f"{what} must span the ranks of Groups(shard=...) in the same order "
            f"(a second group over them, e.g. dist.new_group(ranks)); it spans "
            f"{ranks(group)}, the shard group {ranks(like)}"
        )


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


def reduce_scatter(
    out: torch.Tensor, inp: torch.Tensor, group: Group, world_size: int, counter: CommCounter
) -> Handle:
    """Sum `inp` over ranks; this rank's 1/W slice lands in `out` (may alias that slice)."""
    if world_size == 1:
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return None
    counter.add(CollectiveKind.REDUCE_SCATTER, inp.numel(), inp.element_size(), world_size)
    return _reduce_scatter(out, inp, group=group, async_op=True)


def all_gather(
    out: torch.Tensor, inp: torch.Tensor, group: Group, world_size: int, counter: CommCounter
) -> Handle:
    """Concatenate every rank's `inp` into `out` (`inp` may be this rank's slice of `out`)."""
    if world_size == 1:
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return None
    counter.add(CollectiveKind.ALL_GATHER, out.numel(), out.element_size(), world_size)
    return _all_gather(out, inp, group=group, async_op=True)


def all_to_all(
    out: torch.Tensor, inp: torch.Tensor, group: Group, world_size: int, counter: CommCounter
) -> Handle:
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


def all_reduce_mean(t: torch.Tensor, ctx: CommContext) -> Handle:
    """Average `t` over the ranks of `ctx`'s group in place (as DDP: each rank's value is
    multiplied by 1/W before the sum). Where NCCL serves the device and the factor is safe
    there (`premul_sum_op`) the multiplication is the collective's own (no pass over `t`
    before the send); elsewhere a `mul_` first."""
    if ctx.world_size == 1:
        return None
    inv = 1.0 / ctx.world_size
    op = premul_sum_op(ctx, t, inv)
    if op is None:
        t.mul_(inv)
        op = dist.ReduceOp.SUM
    ctx.counter.add(CollectiveKind.ALL_REDUCE, t.numel(), t.element_size(), ctx.world_size)
    return dist.all_reduce(t, op=op, group=ctx.group, async_op=True)


def reduce_scatter_mean(out: torch.Tensor, inp: torch.Tensor, ctx: CommContext) -> Handle:
    """`reduce_scatter` of the ranks' `inp` multiplied by 1/W (the average), as `all_reduce_mean`:
    inside the collective where `premul_sum_op` allows, a `mul_` of `inp` first elsewhere."""
    if ctx.world_size == 1:
        return reduce_scatter(out, inp, ctx.group, 1, ctx.counter)
    op = premul_sum_op(ctx, inp, 1.0 / ctx.world_size)
    if op is None:
        inp.mul_(1.0 / ctx.world_size)
        return reduce_scatter(out, inp, ctx.group, ctx.world_size, ctx.counter)
    ctx.counter.add(CollectiveKind.REDUCE_SCATTER, inp.numel(), inp.element_size(), ctx.world_size)
    return _reduce_scatter(out, inp, op=op, group=ctx.group, async_op=True)


def premul_sum_op(ctx: CommContext, t: torch.Tensor, factor: float) -> Any:
    """A reduce op that multiplies each rank's input by `factor` inside the collective, where
    the backend serving `t`'s device has one (NCCL) and it gives what a `mul_` before the
    collective would; else None. The factor is a Python float: NCCL bakes it into the op (no
    device read, no extra kernel), as a scalar of `t`'s dtype.
    fp32 only, and fp16 where `factor` is exact in fp16: see [Note: premul_sum dtypes]."""
    make = getattr(dist, "_make_nccl_premul_sum", None)
    if (
        make is None
        or t.device.type == "cpu"
        or serving_backend(ctx.group, t.device.type) != "nccl"
    ):
        return None
    if t.dtype == torch.float32 or (
        t.dtype == torch.float16 and math.frexp(factor)[0] == 0.5 and factor >= 2.0**-14
    ):
        return make(factor)
    return None


def all_reduce_uncounted(t: torch.Tensor, group: Group, world_size: int) -> Handle:
    """Sum `t` over ranks in place: a one-time agreement (e.g. at the first backward), not per-step
    traffic, so not counted."""
    if world_size == 1:
        return None
    return dist.all_reduce(t, group=group, async_op=True)


# See [Note: a hung NCCL collective].
NCCL_WATCHDOG_ENV = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
}


def nccl_watchdog_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Set NCCL_WATCHDOG_ENV's values where the environment does not set them already (before
    the NCCL group is created); returns what was set."""
    import os

    env = os.environ if environ is None else environ
    added = {k: v for k, v in NCCL_WATCHDOG_ENV.items() if k not in env}
    env.update(added)
    return added


# gloo's words for a collective past the group's timeout: "Timed out waiting ..." from the op
# that ran out of time, "Application timeout caused pair closure" from one whose connection that
# timeout closed (which of the two a stalled peer gives depends on which wait fires first).
_TIMEOUT_WORDS = ("timed out", "timeout caused pair closure")


def is_timeout(error: BaseException | str) -> bool:
    """A collective's error (or its message) that says it ran out of time."""
    msg = str(error).lower()
    return any(w in msg for w in _TIMEOUT_WORDS)


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


# Backends whose `Work.wait()` makes the current device stream wait for the collective instead of
# blocking the host (NCCL and its counterparts on other accelerators).
STREAM_ORDERED = frozenset({"nccl", "xccl", "hccl"})


def serving_backend(group: Group, device_type: str) -> str:
    """The backend that serves `device_type` tensors in `group`: `dist.get_backend` names one
    for every device type ("nccl") or one per type ("cpu:gloo,cuda:nccl", the usual mixed
    group); "" where none serves that type. No process group: "" (nothing is sent)."""
    if group is None and not dist.is_initialized():
        return ""
    name = str(dist.get_backend(group))
    if ":" not in name:
        return name
    table = dict(part.split(":", 1) for part in name.split(","))
    return table.get(device_type, "")


def _host_blocking(group: Group, device: torch.device | None = None) -> bool:
    """True where `Work.wait` blocks the host anyway (gloo, and CPU tensors whatever the group).
    On a stream-ordered backend a wait only orders streams; passing it a timeout would turn it
    into a host sync in `step()`, so NCCL is left to its watchdog, which aborts the communicator
    after the group's timeout. Decided per device type: without `device`, only a group whose
    every backend is stream-ordered counts as such."""
    try:
        if device is not None:
            return device.type == "cpu" or serving_backend(group, device.type) not in STREAM_ORDERED
        name = str(dist.get_backend(group))
        return not all(part.rsplit(":", 1)[-1] in STREAM_ORDERED for part in name.split(","))
    except (RuntimeError, ValueError):
        return True


# Dynamo cannot trace a wait on other ranks (nor the process-group internals it reads): when a
# compiled model's hook waits, the graph breaks here, once.
@eager
def wait(
    handle: Handle,
    what: str = "a collective",
    group: Group = None,
    timeout: float | None = None,
    host_blocking: bool | None = None,
) -> None:
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
        if elapsed >= 0.9 * limit or is_timeout(msg):
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
