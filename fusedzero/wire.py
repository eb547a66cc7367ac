"""Compressed wire: what crosses the network is separate from how it is summed (docs/wire.md).

A grad reduce-scatter over a wire format (`WireFormat`: fp32, bf16, int8 with block scales)
quantizes the bucket once (one launch), sends every rank its chunk with one all-to-all, and each
rank dequantizes the W chunks of its shard and sums them in fp32 (one launch, fused with the 1/W
scale and the accumulation into the grad shard). The bytes are those of a reduce-scatter in the
wire dtype, (W-1)/W of the packed bucket; the sum has one rounding per element per rank (the
quantization) plus fp32 rounding, where a reduce-scatter in bf16 rounds to bf16 at every hop.

All-reduce (stage 0, the HSDP replica reduction) is the same reduce-scatter on a copy padded to
W * WBLOCK, then an all-gather of each rank's summed chunk in the wire format: every replica
dequantizes the same bytes, so replicas stay equal. Param all-gathers can use a wire format too
(`all_gather`): each rank's own piece keeps its exact value.

There is no error feedback: the int8 rounding of a step is not carried into the next (as in
ZeRO++'s qgZ), so no residual is resident. With W = 1 nothing crosses a network and nothing is
quantized.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable

import torch

from fusedzero import _comm as comm
from fusedzero._comm import CommContext, Handle
from fusedzero.kernels._quant import (
    WBLOCK,
    WireFormat,
    chunk_bytes,
    dequant_sum_into,
    dequantize_into,
    new_packed,
    quantize_into,
)

__all__ = [
    "WBLOCK",
    "WireFormat",
    "all_gather",
    "all_reduce_start",
    "chunk_bytes",
    "gathers_over_wire",
    "parse_wire",
    "reduce_scatter_start",
    "uses_wire",
]

WIRES = tuple(w.value for w in WireFormat)


def parse_wire(value: str | WireFormat | None, name: str = "wire") -> WireFormat | None:
    """None (the collective's own dtype, summed in it) or a WireFormat; strings parsed here."""
    if value is None or isinstance(value, WireFormat):
        return value
    try:
        return WireFormat(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected None or one of {list(WIRES)}") from None


def uses_wire(fmt: WireFormat | None, dtype: torch.dtype, world_size: int) -> bool:
    """Whether a collective over `dtype` data goes through the quantized path: a format other
    than the data's own fp32 (an fp32 reduce-scatter already sums in fp32), over > 1 rank."""
    if fmt is None or world_size == 1:
        return False
    return not (fmt is WireFormat.FP32 and dtype == torch.float32)


def gathers_over_wire(fmt: WireFormat | None, dtype: torch.dtype, world_size: int) -> bool:
    """Whether a param all-gather of `dtype` goes through the packed path: a format other than
    the params' own dtype (bf16 params with Wire(params="bf16") are a plain all-gather)."""
    if fmt is None or world_size == 1:
        return False
    own = {WireFormat.FP32: torch.float32, WireFormat.BF16: torch.bfloat16}.get(fmt)
    return own != dtype


@dataclasses.dataclass(eq=False)
class WireReduce:
    """An in-flight reduce-scatter over the wire: this rank's W chunks land in `recv`."""

    handle: Handle
    fmt: WireFormat
    world_size: int
    chunk_numel: int
    send: torch.Tensor | None
    recv: torch.Tensor | None

    def finish(self, out: torch.Tensor, scale: float = 1.0, accumulate: bool = False) -> None:
        """out = [out +] scale * fp32 sum of the chunks (after the handle was waited on); frees
        the packed buffers."""
        assert self.recv is not None, "finish() called twice"
        dequant_sum_into(
            out,
            self.recv,
            self.fmt,
            self.world_size,
            self.chunk_numel,
            scale=scale,
            accumulate=accumulate,
        )
        self.send = self.recv = None


def reduce_scatter_start(inp: torch.Tensor, fmt: WireFormat, ctx: CommContext) -> WireReduce:
    """Quantize `inp` (a multiple of W * WBLOCK elements) and all-to-all its chunks (async).
    The send buffer lives until `finish`: a collective may read it until it is waited on."""
    W = ctx.world_size
    if inp.numel() % (W * WBLOCK):
        raise ValueError(
            f"a wire reduce-scatter needs a multiple of W*{WBLOCK} = {W * WBLOCK} "
            f"elements, got {inp.numel()}"
        )
    return reduce_scatter_start_padded(inp, fmt, ctx, inp.numel() // W)


def all_reduce_start(
    t: torch.Tensor, fmt: WireFormat, ctx: CommContext, scale: float
) -> Callable[[], None]:
    """Start `t = scale * sum over ranks of t` over the wire; returns what completes it (waits on
    the all-to-all, sums this rank's chunk in fp32, all-gathers the chunks quantized, and every
    rank dequantizes the same bytes into `t`). A copy padded to W * WBLOCK is what is sent."""
    W = ctx.world_size
    S = -(-t.numel() // (W * WBLOCK)) * WBLOCK
    red = reduce_scatter_start_padded(t, fmt, ctx, S)

    def finish() -> None:
        ctx.wait(red.handle, what="wire all-to-all of an all-reduce")
        mine = torch.empty(S, dtype=torch.float32, device=t.device)
        red.finish(mine, scale=scale)
        piece = new_packed(fmt, 1, S, t.device)
        quantize_into(mine, piece, fmt, 1, S)
        gathered = new_packed(fmt, W, S, t.device)
        ctx.wait(
            comm.all_gather(gathered, piece, ctx.group, W, ctx.counter),
            what="wire all-gather of an all-reduce",
        )
        dequantize_into(t, gathered, fmt, W, S)

    return finish


def reduce_scatter_start_padded(
    t: torch.Tensor, fmt: WireFormat, ctx: CommContext, chunk_numel: int
) -> WireReduce:
    """As reduce_scatter_start, `t` taken as zero-padded to W * chunk_numel elements."""
    W = ctx.world_size
    send = new_packed(fmt, W, chunk_numel, t.device)
    quantize_into(t, send, fmt, W, chunk_numel)
    recv = torch.empty_like(send)
    h = comm.all_to_all(recv, send, ctx.group, W, ctx.counter)
    return WireReduce(h, fmt, W, chunk_numel, send, recv)


class WireGather:
    """A param all-gather in flight over the wire, usable where a work handle is waited on
    (`comm.wait`): `wait` waits for the bytes, then dequantizes every other rank's chunk."""

    def __init__(
        self,
        handle: Handle,
        out: torch.Tensor,
        gathered: torch.Tensor,
        piece: torch.Tensor,
        fmt: WireFormat,
        world_size: int,
        rank: int,
    ) -> None:
        self.handle, self.out, self.gathered, self.piece = handle, out, gathered, piece
        self.fmt, self.world_size, self.rank = fmt, world_size, rank
        self.done = False

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if not self.done:
            if self.handle is not None:
                if timeout is None:
                    self.handle.wait()
                else:
                    self.handle.wait(timeout)
            with torch.no_grad():
                dequantize_into(
                    self.out,
                    self.gathered,
                    self.fmt,
                    self.world_size,
                    self.out.numel() // self.world_size,
                    keep=self.rank,
                )
            self.done = True
            self.gathered = self.piece = torch.empty(0)
        return True


def all_gather(
    out: torch.Tensor, own: torch.Tensor, fmt: WireFormat | None, ctx: CommContext, rank: int
) -> Handle:
    """Params: every rank's `own` piece into `out` (`own` may be this rank's slice of `out`),
    in the wire format where `uses_wire`; this rank's piece keeps its exact value (it is, or is
    cast from, the master). Returns a handle for `comm.wait`."""
    W = ctx.world_size
    if not gathers_over_wire(fmt, out.dtype, W) or own.numel() % WBLOCK:
        return comm.all_gather(out, own, ctx.group, W, ctx.counter)
    assert fmt is not None
    S = own.numel()
    mine = out[rank * S : (rank + 1) * S]
    if mine.data_ptr() != own.data_ptr():
        with torch.no_grad():
            mine.copy_(own)
    piece = new_packed(fmt, 1, S, own.device)
    quantize_into(own, piece, fmt, 1, S)
    gathered = new_packed(fmt, W, S, own.device)
    h = comm.all_gather(gathered, piece, ctx.group, W, ctx.counter)
    return WireGather(h, out, gathered, piece, fmt, W, rank)  # type: ignore[return-value]
