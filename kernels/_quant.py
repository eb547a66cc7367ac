"""Wire formats for collectives: quantize a bucket into a packed send buffer, and dequantize-sum
the chunks an all-to-all delivered, in fp32 (docs/wire.md).

A packed buffer is a flat uint8 tensor of `chunks` equal chunks, chunk r holding `chunk_numel`
elements (r's slice of the bucket) in the wire format:

- fp32 / bf16: the elements, 4 / 2 bytes each;
- int8: `chunk_numel` int8 codes, then one fp32 scale per `WBLOCK` elements (block-wise absmax:
  scale d = absmax / 127, code = round(x / d) in [-127, 127], value = code * d). A chunk is
  `chunk_numel + 4 * chunk_numel / WBLOCK` bytes; `chunk_numel` is a multiple of WBLOCK, so a
  block never straddles two chunks and every chunk's scales are 4-byte aligned.

One launch per bucket each way. `quantize_into` pads the tail past `x.numel()` with zeros;
`dequant_sum_into` fuses the sum over chunks (fp32, in chunk order), the scale (the average's
1/W) and the accumulation into an existing grad shard, and casts once at the store. CPU tensors
take a torch path with the same fp32 operations in the same order (bitwise equal to the
interpreted kernels); `_launch.use_triton` decides.

[Note: a NaN on the wire] tl.max drops NaNs (maxnum): a block holding one would get a finite scale
and arrive finite. The sum of its NaNs (0.0 where it has none, so `+` leaves the scale's bits as
they are) makes the scale NaN, as torch's amax does: every value of the block dequantizes to NaN
and the step's non-finite check sees it.

[Note: wire vector widths] The runtime specialises int arguments that are multiples of 16 (n_out,
chunk_v: the optimizer's shards are multiples of 128) as such, which makes the masks uniform over a
vector: 128-bit accesses (_compile_quant.py).
"""

from __future__ import annotations

import enum

import torch
import triton
import triton.language as tl

from fusedzero.kernels._launch import ENABLE_FP_FUSION, count_launch, device_guard, use_triton
from fusedzero.kernels._memory_modes import round_to_bf16

# int8 elements per fp32 scale. 128 = the flat layout's alignment (fusedzero/_layout.py ALIGN), so
# every shard chunk is whole blocks; the scales cost 4/128 = 3.1% on top of the codes.
WBLOCK = 128
QMAX = 127.0  # symmetric int8: -128 is never used, so -x quantizes to -code(x)
# A program handles ROWS blocks (1024 elements): int8 codes then move in 128-bit vectors per
# thread and each program still has several loads in flight per chunk.
ROWS = 8
NUM_WARPS = 4
_WBLOCK = tl.constexpr(WBLOCK)
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class WireFormat(str, enum.Enum):
    """What crosses the network per element."""

    FP32 = "fp32"
    BF16 = "bf16"
    INT8 = "int8"

    @property
    def code(self) -> int:
        return {"fp32": 0, "bf16": 1, "int8": 2}[self.value]


def chunk_bytes(fmt: WireFormat, chunk_numel: int) -> int:
    """Bytes of one chunk of `chunk_numel` elements in `fmt` (int8: scales included)."""
    if fmt is WireFormat.INT8:
        if chunk_numel % WBLOCK:
            raise ValueError(
                f"int8 chunks must be a multiple of {WBLOCK} elements, got {chunk_numel}"
            )
        return chunk_numel + 4 * (chunk_numel // WBLOCK)
    return chunk_numel * (4 if fmt is WireFormat.FP32 else 2)


def new_packed(
    fmt: WireFormat, chunks: int, chunk_numel: int, device: torch.device
) -> torch.Tensor:
    """An uninitialised packed buffer of `chunks` chunks."""
    return torch.empty(chunks * chunk_bytes(fmt, chunk_numel), dtype=torch.uint8, device=device)


def unpack(
    packed: torch.Tensor, fmt: WireFormat, chunk_numel: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(values or codes as (chunks, chunk_numel), int8 scales as (chunks, blocks) or None):
    views of a packed buffer in its own dtypes."""
    c = chunk_bytes(fmt, chunk_numel)
    rows = packed.view(-1, c)
    if fmt is WireFormat.INT8:
        return rows[:, :chunk_numel].view(torch.int8), rows[:, chunk_numel:].view(torch.float32)
    return rows.view(torch.float32 if fmt is WireFormat.FP32 else torch.bfloat16), None


def _views(packed: torch.Tensor, fmt: WireFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed buffer as the kernel's value pointer and fp32 scale pointer (int8 only; the
    value view again otherwise, never read)."""
    if fmt is WireFormat.INT8:
        return packed.view(torch.int8), packed.view(torch.float32)
    v = packed.view(torch.float32 if fmt is WireFormat.FP32 else torch.bfloat16)
    return v, v


def _check(
    packed: torch.Tensor,
    fmt: WireFormat,
    chunks: int,
    chunk_numel: int,
    t: torch.Tensor,
    name: str,
    most: int,
) -> None:
    need = chunks * chunk_bytes(fmt, chunk_numel)
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != need:
        raise ValueError(
            f"packed must be a flat uint8 buffer of {need} bytes ({chunks} chunks "
            f"of {chunk_numel} {fmt.value}), got {packed.dtype} of shape "
            f"{tuple(packed.shape)}"
        )
    if t.dim() != 1 or not t.is_contiguous() or t.numel() > most or t.device != packed.device:
        raise ValueError(
            f"{name} must be flat, contiguous, on {packed.device} and at most {most} "
            f"elements, got shape {tuple(t.shape)} strides {t.stride()} on "
            f"{t.device}"
        )
    if chunk_numel % WBLOCK:
        raise ValueError(f"chunk_numel must be a multiple of {WBLOCK}, got {chunk_numel}")


# ----------------------------------------------------------------------------------- kernels
@triton.jit
def _quantize_kernel(
    x_ptr,
    v_ptr,
    s_ptr,
    numel,
    total_blocks,
    chunk_numel,
    chunk_v,
    chunk_s,
    FMT: tl.constexpr,
    ROWS: tl.constexpr,
):
    # Program pid quantizes blocks [pid*ROWS, (pid+1)*ROWS) of the padded bucket; int64 offsets.
    pid = tl.program_id(0).to(tl.int64)
    blk = pid * ROWS + tl.arange(0, ROWS)
    idx = blk[:, None] * _WBLOCK + tl.arange(0, _WBLOCK)[None, :]
    live = blk[:, None] < total_blocks
    x = tl.load(x_ptr + idx, mask=idx < numel, other=0.0).to(tl.float32)
    if FMT == 2:
        r = idx // chunk_numel
        a = tl.max(tl.abs(x), axis=1)
        # + the sum of the block's NaNs: see [Note: a NaN on the wire].
        d = tl.div_rn(a, 127.0) + tl.sum(tl.where(x != x, x, 0.0), axis=1)
        inv = tl.where(d > 0, tl.div_rn(1.0, tl.where(d > 0, d, 1.0)), 0.0)
        c = tl.minimum(tl.abs(x) * inv[:, None] + 0.5, 127.0)  # floor: c >= 0
        c = tl.where(x == x, c, 0.0).to(tl.int32)  # a NaN's code: 0 (no NaN-to-int cast)
        q = tl.where(x < 0, -c, c).to(tl.int8)
        tl.store(v_ptr + r * chunk_v + (idx - r * chunk_numel), q, mask=live)
        rb = blk // (chunk_numel // _WBLOCK)
        sb = rb * chunk_s + chunk_numel // 4 + (blk - rb * (chunk_numel // _WBLOCK))
        tl.store(s_ptr + sb, d, mask=blk < total_blocks)
    elif FMT == 1:
        tl.store(v_ptr + idx, round_to_bf16(x), mask=live)
    else:
        tl.store(v_ptr + idx, x, mask=live)


@triton.jit
def _dequant_sum_kernel(
    v_ptr,
    s_ptr,
    out_ptr,
    n_out,
    chunks,
    chunk_numel,
    chunk_v,
    chunk_s,
    scale,
    FMT: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    OUT_BF16: tl.constexpr,
    ROWS: tl.constexpr,
):
    # out[i] = (out[i] if ACCUMULATE) + scale * sum_r value(chunk r, i), summed in fp32 in chunk
    # order, cast once at the store. 1-D offsets, the int8 rows reshaped to (ROWS, WBLOCK) to
    # meet their scales. See [Note: wire vector widths].
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * (ROWS * _WBLOCK) + tl.arange(0, ROWS * _WBLOCK)
    blk = pid * ROWS + tl.arange(0, ROWS)
    mask = idx < n_out
    acc = tl.zeros((ROWS * _WBLOCK,), dtype=tl.float32)
    # Chunk r's offsets advance by chunk_v / chunk_s per chunk, in int64 (r * chunk_v would be
    # an int32 product, past 2^31 in a bucket of 2^31 elements or more).
    at_v = idx
    at_s = blk + chunk_numel // 4
    for _ in range(chunks):
        v = tl.load(v_ptr + at_v, mask=mask, other=0).to(tl.float32)
        if FMT == 2:
            d = tl.load(s_ptr + at_s, mask=blk * _WBLOCK < n_out, other=0.0)
            v = tl.reshape(tl.reshape(v, (ROWS, _WBLOCK)) * d[:, None], (ROWS * _WBLOCK,))
        acc = acc + v
        at_v += chunk_v
        at_s += chunk_s
    acc = acc * scale
    if ACCUMULATE:
        acc = tl.load(out_ptr + idx, mask=mask, other=0.0).to(tl.float32) + acc
    if OUT_BF16:
        tl.store(out_ptr + idx, round_to_bf16(acc), mask=mask)
    else:
        tl.store(out_ptr + idx, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequantize_kernel(
    v_ptr,
    s_ptr,
    out_ptr,
    n_out,
    keep,
    chunk_numel,
    chunk_v,
    chunk_s,
    FMT: tl.constexpr,
    OUT_BF16: tl.constexpr,
    ROWS: tl.constexpr,
):
    # out[i] = value of element i of the concatenated chunks; chunk `keep` is left as it is.
    pid = tl.program_id(0).to(tl.int64)
    blk = pid * ROWS + tl.arange(0, ROWS)
    idx = blk[:, None] * _WBLOCK + tl.arange(0, _WBLOCK)[None, :]
    r = idx // chunk_numel
    mask = (idx < n_out) & (r != keep)
    v = tl.load(v_ptr + r * chunk_v + (idx - r * chunk_numel), mask=mask, other=0).to(tl.float32)
    if FMT == 2:
        rb = blk // (chunk_numel // _WBLOCK)
        d = tl.load(
            s_ptr + rb * chunk_s + chunk_numel // 4 + (blk - rb * (chunk_numel // _WBLOCK)),
            mask=blk * _WBLOCK < n_out,
            other=0.0,
        )
        v = v * d[:, None]
    if OUT_BF16:
        tl.store(out_ptr + idx, round_to_bf16(v), mask=mask)
    else:
        tl.store(out_ptr + idx, v.to(out_ptr.dtype.element_ty), mask=mask)


def _strides(fmt: WireFormat, chunk_numel: int) -> tuple[int, int]:
    """A chunk's stride in value-view elements and in fp32 (scale-view) elements."""
    c = chunk_bytes(fmt, chunk_numel)
    item = 1 if fmt is WireFormat.INT8 else (4 if fmt is WireFormat.FP32 else 2)
    return c // item, c // 4 if fmt is WireFormat.INT8 else 0


# --------------------------------------------------------------------------------- launchers
def quantize_into(
    x: torch.Tensor, packed: torch.Tensor, fmt: WireFormat, chunks: int, chunk_numel: int
) -> None:
    """Write `x` (flat, any float dtype, at most chunks * chunk_numel elements, the rest taken
    as zeros) into `packed` in `fmt`: one launch."""
    _check(packed, fmt, chunks, chunk_numel, x, "x", chunks * chunk_numel)
    count_launch("wire_quantize")
    total_blocks = chunks * chunk_numel // WBLOCK
    if not use_triton(x.device):
        _quantize_torch(x, packed, fmt, chunks, chunk_numel)
        return
    v, s = _views(packed, fmt)
    cv, cs = _strides(fmt, chunk_numel)
    with device_guard(x.device):
        _quantize_kernel[(triton.cdiv(total_blocks, ROWS),)](
            x,
            v,
            s,
            x.numel(),
            total_blocks,
            chunk_numel,
            cv,
            cs,
            FMT=fmt.code,
            ROWS=ROWS,
            num_warps=NUM_WARPS,
            enable_fp_fusion=ENABLE_FP_FUSION,
        )


def _unpacking(
    out: torch.Tensor,
    packed: torch.Tensor,
    fmt: WireFormat,
    chunks: int,
    chunk_numel: int,
    max_out: int,
    launch: str,
) -> bool:
    """Check a dequantizing launch's arguments and count it: True where Triton runs it."""
    _check(packed, fmt, chunks, chunk_numel, out, "out", max_out)
    if out.dtype not in OUT_DTYPES:
        raise TypeError(f"out has dtype {out.dtype}, expected one of {OUT_DTYPES}")
    count_launch(launch)
    return use_triton(out.device)


def dequant_sum_into(
    out: torch.Tensor,
    packed: torch.Tensor,
    fmt: WireFormat,
    chunks: int,
    chunk_numel: int,
    *,
    scale: float = 1.0,
    accumulate: bool = False,
) -> None:
    """out (flat, fp32/bf16/fp16, at most chunk_numel elements) = [out +] scale * the fp32 sum of
    every chunk's dequantized values (its first out.numel() elements): one launch."""
    if not _unpacking(out, packed, fmt, chunks, chunk_numel, chunk_numel, "wire_dequant_sum"):
        _dequant_sum_torch(out, packed, fmt, chunks, chunk_numel, scale, accumulate)
        return
    v, s = _views(packed, fmt)
    cv, cs = _strides(fmt, chunk_numel)
    grid = (triton.cdiv(triton.cdiv(out.numel(), WBLOCK), ROWS),)
    with device_guard(out.device):
        _dequant_sum_kernel[grid](
            v,
            s,
            out,
            out.numel(),
            chunks,
            chunk_numel,
            cv,
            cs,
            float(scale),
            FMT=fmt.code,
            ACCUMULATE=accumulate,
            OUT_BF16=out.dtype == torch.bfloat16,
            ROWS=ROWS,
            num_warps=NUM_WARPS,
            enable_fp_fusion=ENABLE_FP_FUSION,
        )


def dequantize_into(
    out: torch.Tensor,
    packed: torch.Tensor,
    fmt: WireFormat,
    chunks: int,
    chunk_numel: int,
    *,
    keep: int = -1,
) -> None:
    """out (at most chunks * chunk_numel elements) = the chunks' values back to back, chunk
    `keep` (e.g. this rank's exact piece) left untouched: one launch."""
    if not _unpacking(
        out, packed, fmt, chunks, chunk_numel, chunks * chunk_numel, "wire_dequantize"
    ):
        _dequantize_torch(out, packed, fmt, chunks, chunk_numel, keep)
        return
    v, s = _views(packed, fmt)
    cv, cs = _strides(fmt, chunk_numel)
    grid = (triton.cdiv(triton.cdiv(out.numel(), WBLOCK), ROWS),)
    with device_guard(out.device):
        _dequantize_kernel[grid](
            v,
            s,
            out,
            out.numel(),
            keep,
            chunk_numel,
            cv,
            cs,
            FMT=fmt.code,
            OUT_BF16=out.dtype == torch.bfloat16,
            ROWS=ROWS,
            num_warps=NUM_WARPS,
            enable_fp_fusion=ENABLE_FP_FUSION,
        )


# ------------------------------------------------------------------ torch path (same fp32 ops)
def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes and fp32 scales of fp32 `x` (a multiple of WBLOCK): the kernel's ops."""
    xb = x.view(-1, WBLOCK)
    d = xb.abs().amax(dim=1) / QMAX  # NaN where the block holds one (see [Note: a NaN on the wire])
    inv = torch.where(d > 0, 1.0 / torch.where(d > 0, d, 1.0), 0.0)
    c = torch.clamp(xb.abs() * inv[:, None] + 0.5, max=QMAX)
    c = torch.where(xb == xb, c, 0.0).to(torch.int32)
    return torch.where(xb < 0, -c, c).to(torch.int8).view(-1), d


def _quantize_torch(
    x: torch.Tensor, packed: torch.Tensor, fmt: WireFormat, chunks: int, chunk_numel: int
) -> None:
    vals, scales = unpack(packed, fmt, chunk_numel)
    n = x.numel()
    if fmt is not WireFormat.INT8:
        flat = vals.view(-1)
        flat[:n].copy_(x)  # torch's casts round to nearest even, as round_to_bf16
        flat[n:].zero_()
        return
    assert scales is not None
    xf = torch.zeros(chunks * chunk_numel, dtype=torch.float32, device=x.device)
    xf[:n].copy_(x)
    q, d = quantize_blocks(xf)
    vals.copy_(q.view(chunks, chunk_numel))
    scales.copy_(d.view(chunks, -1))


def _chunk_values(packed: torch.Tensor, fmt: WireFormat, chunk_numel: int, n: int) -> torch.Tensor:
    """fp32 values of every chunk's first `n` elements, (chunks, n)."""
    vals, scales = unpack(packed, fmt, chunk_numel)
    m = -(-n // WBLOCK) * WBLOCK  # whole blocks (chunk_numel is whole blocks)
    v = vals[:, :m].float()
    if scales is not None:
        rows, nb = v.shape[0], m // WBLOCK
        v = (v.view(rows, nb, WBLOCK) * scales[:, :nb, None]).view(rows, m)
    return v[:, :n]


def _dequant_sum_torch(
    out: torch.Tensor,
    packed: torch.Tensor,
    fmt: WireFormat,
    chunks: int,
    chunk_numel: int,
    scale: float,
    accumulate: bool,
) -> None:
    v = _chunk_values(packed, fmt, chunk_numel, out.numel())
    acc = torch.zeros(out.numel(), dtype=torch.float32, device=out.device)
    for r in range(chunks):  # in chunk order, as the kernel
        acc += v[r]
    acc *= torch.tensor(scale, dtype=torch.float32)
    if accumulate:
        acc = out.float() + acc
    out.copy_(acc)


def _dequantize_torch(
    out: torch.Tensor,
    packed: torch.Tensor,
    fmt: WireFormat,
    chunks: int,
    chunk_numel: int,
    keep: int,
) -> None:
    v = _chunk_values(packed, fmt, chunk_numel, chunk_numel).reshape(-1)
    n = out.numel()
    if 0 <= keep < chunks:
        lo, hi = keep * chunk_numel, min((keep + 1) * chunk_numel, n)
        if lo < n:
            out[:lo].copy_(v[:lo])
            out[hi:].copy_(v[hi:n])
            return
    out.copy_(v[:n])
