"""Muon's element-wise launches over a rank's flat shards, and Newton-Schulz batched per shape.

A Muon step on a rank is three phases over the matrices it owns whole (at stages 1-3 the owner
layout, fusedzero/_owner_layout.py, puts every matrix whole in one rank's shard of a bucket):

1. `MuonPlan.momentum`: one launch over every matrix of the rank (all groups, all buckets)
       g   = grad * grad_mult                      (averaging, clip, loss scale folded in)
       buf = lerp(buf, g, 1 - momentum)            (torch.optim.Muon: buf.lerp_(grad, 1 - momentum))
       u   = lerp(g, buf, momentum) if nesterov else buf
       ns_in = bf16(u)                             (the input of Newton-Schulz, or fp32)
2. `newton_schulz` on the owner, batched per shape: the engine lays `ns_in` out so that the
   matrices of one shape are one [B, m, n] stack (each piece's `ns_in` view is placed by the
   engine), orthogonalises it and writes the result back into the same storage (`out=`).
3. `MuonPlan.update`: one launch over the same matrices
       master = master * (1 - lr * weight_decay)   (decoupled, the unadjusted lr)
       master = master - adjusted_lr * update      (adjust_lr_fn with the full matrix shape)
       out    = low-precision copy of master       (bf16/fp16/fp32, optional)

Bytes per element (what the launches move; fp32 master, bf16 NS input and update):
- momentum: grad 4 (fp32) or 2 (bf16/fp16) read, buf 4+4 (fp32) or 2+2 (bf16) read and written,
  ns_in 2 written: 14 B with fp32 grads and buffer, 12 B with bf16 grads, 8 B with both bf16.
- update: master 4+4, update 2 read, out 2 written: 12 B (10 B without an out copy).
Together 24-26 B per Muon param with fp32 state, against AdamW's 28 (kernels/_adamw.py). Newton-
Schulz itself is compute-bound: 5 * (4 * s*s*l + 2 * s*s*s) FLOPs for an s x l matrix (s <= l)
at ns_steps=5, run once per matrix, on its owner; writing its result back with `out=` adds a
copy of 2 + 2 B per element (bf16).

Rows. Each piece reads one fp32 row (`MuonRowCol`): a (param group, lr ratio) pair, since
adjust_lr depends on the matrix shape. The per-step columns (grad multiplier, decay, adjusted lr)
are computed on the device from the lr vector and the grad scale in fp64, each rounded once to
fp32, exactly as torch.optim.Muon turns its Python-float expressions into fp32 kernel scalars:
the kernels have no fp64 instruction and nothing is read back to the host (no host sync).

Skip. A non-zero `skip` (non-finite grads) masks the stores of buf, master and out; the
Newton-Schulz input is written either way (scratch, never state).

[Note: Muon numerics] torch.optim.Muon computes `lerp` as one fused multiply-add (its CPU vector
path calls fmadd; nvcc contracts the CUDA expression) and `param.add_(update, alpha=-lr)` the
same way; the kernels spell both with `tl.fma`, so with FMA contraction off otherwise
(_launch.ENABLE_FP_FUSION) every fp32 operation is the one torch performs, in its order. The
interpreter's `tl.fma` rounds once as the GPU does. The torch path (CPU tensors) calls the very
aten ops torch.optim.Muon calls. At W = 1 the composition momentum -> `newton_schulz` (2-D) ->
update is bit-identical to torch.optim.Muon (tests/kernels/test_muon.py: both CPU paths).
Not measured on a GPU here: that torch's CUDA lerp and add contract to the same fma is nvcc's
default (--fmad=true), and the PTX is checked for the fma forms (`_compile_muon.py`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fusedzero.kernels import _rows as hp_rows, _table as table
from fusedzero.kernels._launch import (
    ENABLE_FP_FUSION,
    GRAD_DTYPES,
    check_scalar,
    copy_from_host,
    count_launch,
    device_guard,
    use_triton,
)
from fusedzero.kernels._memory_modes import round_to_bf16 as _round_to_bf16
from fusedzero.kernels._rows import MuonRowCol
from fusedzero.kernels._table import (
    MUON_MOMENTUM_WIDTH,
    MUON_UPDATE_WIDTH,
    Piece,
    build_table,
)

# As the AdamW kernel (kernels/_adamw.py): 1024 elements per program over 8 warps, 4 per thread,
# one 128-bit access per fp32 stream and the same layout for the 16-bit ones (no conversion
# through shared memory).
BLOCK = 1024
NUM_WARPS = 8
BUF_DTYPES = (torch.float32, torch.bfloat16)
# Newton-Schulz runs in bf16 (torch.optim.Muon); an fp32 input is rounded by it.
NS_DTYPES = (torch.bfloat16, torch.float32)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ADJUST_LR_FNS = ("original", "match_rms_adamw")


NCOLS = len(MuonRowCol)
_NCOLS = tl.constexpr(NCOLS)
_MOM_WIDTH = tl.constexpr(MUON_MOMENTUM_WIDTH)
_UPD_WIDTH = tl.constexpr(MUON_UPDATE_WIDTH)


def lr_ratio(adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """adjusted_lr / lr for a rows x cols matrix: "original" (None too) sqrt(max(1, rows/cols)),
    "match_rms_adamw" 0.2 * sqrt(max(rows, cols)); torch.optim.Muon's, in the same float64
    expressions. For a 3-D expert stack [E, M, N] each matrix is M x N."""
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr_fn={adjust_lr_fn!r}, expected None or one of {ADJUST_LR_FNS}")


def adjust_lr(lr: float, adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """The lr a rows x cols matrix is updated with (see `lr_ratio`)."""
    return lr * lr_ratio(adjust_lr_fn, rows, cols)


class MuonRow(NamedTuple):
    """One row: the param group whose lr it reads (index into the lr vector), the matrix
    shape's `lr_ratio`, and the group's momentum, nesterov and weight decay."""

    group: int
    lr_ratio: float
    momentum: float
    nesterov: bool
    weight_decay: float


class MomentumPiece(NamedTuple):
    """A run of elements (views of equal numel, contiguous) updated by the momentum launch: the
    grad (fp32/bf16/fp16; a view into a reduce-scattered bucket works), the momentum buffer
    (fp32/bf16) and where the Newton-Schulz input goes (bf16/fp32)."""

    grad: torch.Tensor
    buf: torch.Tensor
    ns_in: torch.Tensor
    row: int


class UpdatePiece(NamedTuple):
    """A run of elements updated by the update launch: the fp32 master, the orthogonalised
    update (bf16/fp32, Newton-Schulz's output) and the low-precision param copy (or None)."""

    master: torch.Tensor
    update: torch.Tensor
    out: torch.Tensor | None
    row: int


@triton.jit
def _lerp(start, end, w):
    # torch.lerp as one fma: start + w*(end - start) for |w| < 0.5, else end - (1 - w)*(end -
    # start) (w - 1 = -(1 - w) exactly for w in [0.5, 1]); w is the row's scalar.
    d = end - start
    return tl.where(tl.abs(w) < 0.5, tl.fma(w, d, start), tl.fma(w - 1.0, d, end))


@triton.jit
def _store(ptr, idx, x, mask, BF16: tl.constexpr):
    # Round-to-nearest-even to bf16 in integer ops (the interpreter's cast truncates).
    if BF16:
        tl.store(ptr + idx, _round_to_bf16(x), mask=mask)
    else:
        tl.store(ptr + idx, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _offset(col_ptr, ALIGNED: tl.constexpr):
    off = tl.load(col_ptr)
    if ALIGNED:
        off = tl.multiple_of(off, 16)
    return off


@triton.jit
def _muon_momentum_kernel(
    # pointers: one base per stream, the piece table, the rows, the skip flag
    grad_ptr,
    buf_ptr,
    ns_ptr,
    piece_ptr,
    prog_piece_ptr,
    row_ptr,
    skip_ptr,
    # flags
    BUF_BF16: tl.constexpr,
    NS_BF16: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One grid axis over every program of every piece; int64 offsets (shards pass 2**31).
    prog = tl.program_id(0).to(tl.int64)
    piece = tl.load(prog_piece_ptr + prog).to(tl.int64)
    entry = piece_ptr + piece * _MOM_WIDTH
    numel = _offset(entry + table.MuonMomentumCol.NUMEL, ALIGNED)
    blk = prog - tl.load(entry + table.MuonMomentumCol.FIRST)
    idx = blk * BLOCK + tl.arange(0, BLOCK)
    mask = idx < numel
    g_base = grad_ptr + _offset(entry + table.MuonMomentumCol.GRAD, ALIGNED)
    b_base = buf_ptr + _offset(entry + table.MuonMomentumCol.BUF, ALIGNED)
    n_base = ns_ptr + _offset(entry + table.MuonMomentumCol.NS_IN, ALIGNED)
    hp = row_ptr + tl.load(entry + table.MuonMomentumCol.ROW) * _NCOLS
    w_buf = tl.load(hp + hp_rows.MuonRowCol.BUF_WEIGHT)
    w_nest = tl.load(hp + hp_rows.MuonRowCol.NESTEROV_WEIGHT)
    nesterov = tl.load(hp + hp_rows.MuonRowCol.NESTEROV)
    grad_mult = tl.load(hp + hp_rows.MuonRowCol.GRAD_MULT)

    g = tl.load(g_base + idx, mask=mask).to(tl.float32) * grad_mult
    b = tl.load(b_base + idx, mask=mask).to(tl.float32)
    b = _lerp(b, g, w_buf)
    if BUF_BF16:
        # The blend reads the buffer as stored, as torch does with a bf16 buffer.
        b_low = _round_to_bf16(b)
        b = b_low.to(tl.float32)
    u = tl.where(nesterov != 0.0, _lerp(g, b, w_nest), b)

    # A skipped step masks the state's store only; the NS input is scratch.
    keep = idx < tl.where(tl.load(skip_ptr) == 0, numel, 0)
    if BUF_BF16:
        tl.store(b_base + idx, b_low, mask=keep)
    else:
        tl.store(b_base + idx, b, mask=keep)
    _store(n_base, idx, u, mask, NS_BF16)


@triton.jit
def _muon_update_kernel(
    master_ptr,
    update_ptr,
    out_ptr,
    piece_ptr,
    prog_piece_ptr,
    row_ptr,
    skip_ptr,
    HAS_OUT: tl.constexpr,
    OUT_BF16: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    prog = tl.program_id(0).to(tl.int64)
    piece = tl.load(prog_piece_ptr + prog).to(tl.int64)
    entry = piece_ptr + piece * _UPD_WIDTH
    numel = _offset(entry + table.MuonUpdateCol.NUMEL, ALIGNED)
    blk = prog - tl.load(entry + table.MuonUpdateCol.FIRST)
    idx = blk * BLOCK + tl.arange(0, BLOCK)
    mask = idx < numel
    m_base = master_ptr + _offset(entry + table.MuonUpdateCol.MASTER, ALIGNED)
    u_base = update_ptr + _offset(entry + table.MuonUpdateCol.UPDATE, ALIGNED)
    hp = row_ptr + tl.load(entry + table.MuonUpdateCol.ROW) * _NCOLS
    decay = tl.load(hp + hp_rows.MuonRowCol.DECAY)
    neg_lr = tl.load(hp + hp_rows.MuonRowCol.NEG_LR)

    p = tl.load(m_base + idx, mask=mask)
    u = tl.load(u_base + idx, mask=mask).to(tl.float32)
    # torch.optim.Muon: param.mul_(1 - lr * wd); param.add_(update, alpha=-adjusted_lr).
    p = p * decay
    p = tl.fma(u, neg_lr, p)

    keep = idx < tl.where(tl.load(skip_ptr) == 0, numel, 0)
    tl.store(m_base + idx, p, mask=keep)
    if HAS_OUT:
        o_base = out_ptr + _offset(entry + table.MuonUpdateCol.OUT, ALIGNED)
        _store(o_base, idx, p, keep, OUT_BF16)


class MuonRows:
    """The device rows (`MuonRowCol`): the constant columns written once, the per-step ones
    computed on the device in fp64 and rounded once to fp32 (no host sync)."""

    def __init__(self, rows: list[MuonRow], num_groups: int, device: torch.device) -> None:
        for r in rows:
            if not 0 <= r.group < num_groups:
                raise ValueError(f"row group {r.group} out of range for {num_groups} lr entries")
            if not 0.0 <= r.momentum:
                raise ValueError(f"momentum should be >= 0, got {r.momentum}")
            if not 0.0 <= r.weight_decay:
                raise ValueError(f"weight_decay should be >= 0, got {r.weight_decay}")
        self.spec = tuple(rows)
        self.num_groups = num_groups
        n = len(rows)
        self.rows = torch.zeros(n, NCOLS, dtype=torch.float32, device=device)
        # fp32(1 - momentum) from the fp64 difference, as torch rounds its Python float.
        if n:  # none: a rank that owns no matrix
            copy_from_host(
                self.rows[:, : MuonRowCol.NESTEROV + 1],
                [[1.0 - r.momentum, r.momentum, float(r.nesterov)] for r in rows],
            )
        self.group = torch.tensor([r.group for r in rows], dtype=torch.int64).to(device)
        self.c64 = (
            torch.tensor([[r.lr_ratio, r.weight_decay] for r in rows], dtype=torch.float64)
            .reshape(n, 2)
            .to(device)
        )

    def update(self, lr: torch.Tensor, grad_scale: torch.Tensor) -> torch.Tensor:
        """This step's columns from `lr` ((num_groups,) device tensor, fp32) and `grad_scale`
        (one element). A few small torch ops (the engine can fold them into its scalar launch)."""
        if lr.numel() != self.num_groups:
            raise ValueError(f"lr has {lr.numel()} entries, expected {self.num_groups}")
        lr64 = lr.reshape(-1).double()[self.group]
        self.rows[:, MuonRowCol.GRAD_MULT].copy_(grad_scale.reshape(()).float())
        self.rows[:, MuonRowCol.DECAY].copy_(1.0 - lr64 * self.c64[:, 1])
        self.rows[:, MuonRowCol.NEG_LR].copy_((lr64 * self.c64[:, 0]).neg_())
        return self.rows


def _check_view(
    name: str, t: torch.Tensor, allowed: tuple, numel: int, device: torch.device
) -> None:
    if t.dtype not in allowed:
        raise TypeError(f"{name} has dtype {t.dtype}, expected one of {allowed}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if not t.is_contiguous() or t.numel() != numel:
        raise ValueError(
            f"{name} must be a contiguous view of {numel} elements, got shape "
            f"{tuple(t.shape)} with strides {t.stride()}"
        )


class MuonPlan:
    """Every Muon matrix of a rank: one momentum launch and one update launch per dtype
    combination (one, in an optimizer), piece tables built once.

    `rows` are the hyper-parameter rows the pieces name (`MuonRow`), `num_groups` the length of
    the lr vector. The engine builds one plan per rank from its layout: a piece per owned
    matrix (or per run of its shard, as long as momentum and update pieces cover the same
    elements), `ns_in`/`update` views placed so that each shape's matrices form one stack for
    `newton_schulz`. The views must not be replaced while the plan lives (the tables hold their
    addresses), only written in place. `LAUNCHES["muon_momentum"]`, `["muon_update"]` count.
    """

    def __init__(
        self,
        momentum: list[MomentumPiece],
        update: list[UpdatePiece],
        rows: list[MuonRow],
        num_groups: int,
        device: torch.device,
        *,
        require_aligned: bool = False,
    ) -> None:
        self.device = device
        self.triton = use_triton(device)
        self.rows = MuonRows(rows, num_groups, device)
        self.momentum_pieces = list(momentum)
        self.update_pieces = list(update)
        mom: dict[tuple, list[Piece]] = {}
        for p in momentum:
            n = p.grad.numel()
            _check_view("grad", p.grad, GRAD_DTYPES, n, device)
            _check_view("buf", p.buf, BUF_DTYPES, n, device)
            _check_view("ns_in", p.ns_in, NS_DTYPES, n, device)
            self._check_row(p.row)
            key = (p.grad.dtype, p.buf.dtype, p.ns_in.dtype)
            mom.setdefault(key, []).append(
                Piece((p.grad.view(-1), p.buf.view(-1), p.ns_in.view(-1)), (0, 0, 0), n, p.row)
            )
        upd: dict[tuple, list[Piece]] = {}
        for p in update:
            n = p.master.numel()
            _check_view("master", p.master, (torch.float32,), n, device)
            _check_view("update", p.update, NS_DTYPES, n, device)
            if p.out is not None:
                _check_view("out", p.out, OUT_DTYPES, n, device)
            self._check_row(p.row)
            key = (p.update.dtype, None if p.out is None else p.out.dtype)
            views = (p.master.view(-1), p.update.view(-1))
            views += (p.out.view(-1),) if p.out is not None else ()
            upd.setdefault(key, []).append(Piece(views, (0,) * len(views), n, p.row))
        self.momentum_launches = self._tables(mom, MUON_MOMENTUM_WIDTH, require_aligned)
        self.update_launches = self._tables(upd, MUON_UPDATE_WIDTH, require_aligned)

    def _check_row(self, row: int) -> None:
        if not 0 <= row < len(self.rows.spec):
            raise ValueError(f"row {row} out of range for {len(self.rows.spec)} rows")

    def _tables(self, by_key: dict, width: int, require_aligned: bool) -> list[tuple]:
        if not self.triton:
            return [(key, None) for key in by_key]
        out = []
        for key, pieces in by_key.items():
            pieces = [p for p in pieces if p.numel]
            if not pieces:
                continue
            t = build_table(pieces, BLOCK, self.device, streams=width - table.Col.STREAMS)
            if require_aligned and not t.aligned:
                raise ValueError(
                    "a piece offset or length is not a multiple of 16 elements: the layout "
                    "must keep every matrix and its views aligned"
                )
            out.append((key, t))
        return out

    def momentum(self, lr: torch.Tensor, grad_scale: torch.Tensor, skip: torch.Tensor) -> None:
        """Phase 1: this step's rows from `lr` ((num_groups,) fp32) and `grad_scale`, then the
        momentum buffers and the Newton-Schulz inputs. `grad_scale` and `skip` are one-element
        device tensors."""
        check_scalar("grad_scale", grad_scale, self.device)
        check_scalar("skip", skip, self.device)
        rows = self.rows.update(lr, grad_scale)
        if not self.triton:
            count_launch("muon_momentum")
            _momentum_torch(self.momentum_pieces, rows, self.rows.spec, skip)
            return
        with device_guard(self.device):
            for (_, buf_dtype, ns_dtype), t in self.momentum_launches:
                count_launch("muon_momentum")
                _muon_momentum_kernel[(t.programs,)](
                    *t.bases,
                    t.pieces,
                    t.prog_piece,
                    rows,
                    skip,
                    BUF_BF16=buf_dtype == torch.bfloat16,
                    NS_BF16=ns_dtype == torch.bfloat16,
                    ALIGNED=t.aligned,
                    BLOCK=BLOCK,
                    num_warps=NUM_WARPS,
                    enable_fp_fusion=ENABLE_FP_FUSION,
                )

    def update(self, skip: torch.Tensor) -> None:
        """Phase 3: weight decay, the adjusted-lr step and the cast-down, with the rows
        `momentum` computed this step."""
        check_scalar("skip", skip, self.device)
        rows = self.rows.rows
        if not self.triton:
            count_launch("muon_update")
            _update_torch(self.update_pieces, rows, skip)
            return
        with device_guard(self.device):
            for (_, out_dtype), t in self.update_launches:
                count_launch("muon_update")
                b: list[torch.Tensor | None] = list(t.bases)
                if out_dtype is None:
                    b.append(t.bases[0])  # never accessed (HAS_OUT off)
                _muon_update_kernel[(t.programs,)](
                    *b,
                    t.pieces,
                    t.prog_piece,
                    rows,
                    skip,
                    HAS_OUT=out_dtype is not None,
                    OUT_BF16=out_dtype == torch.bfloat16,
                    ALIGNED=t.aligned,
                    BLOCK=BLOCK,
                    num_warps=NUM_WARPS,
                    enable_fp_fusion=ENABLE_FP_FUSION,
                )


def _momentum_torch(
    pieces: list[MomentumPiece], rows: torch.Tensor, spec: tuple[MuonRow, ...], skip: torch.Tensor
) -> None:
    """The momentum launch on CPU tensors: the aten ops torch.optim.Muon calls (lerp with the
    row's fp32 weight), in its order; a piece at a time."""
    keep = skip.reshape(()) == 0
    for p in pieces:
        r = rows[p.row]
        g = p.grad.float() * r[MuonRowCol.GRAD_MULT]
        old = p.buf.float()
        b = torch.lerp(old, g, r[MuonRowCol.BUF_WEIGHT])
        b = b.to(p.buf.dtype).float()  # the buffer as stored (a no-op for fp32)
        u = torch.lerp(g, b, r[MuonRowCol.NESTEROV_WEIGHT]) if spec[p.row].nesterov else b
        p.buf.copy_(torch.where(keep, b, old))
        p.ns_in.copy_(u)


def _update_torch(pieces: list[UpdatePiece], rows: torch.Tensor, skip: torch.Tensor) -> None:
    """The update launch on CPU tensors: `param.mul_(decay)` and `param.add_(update,
    alpha=-adjusted_lr)`, the aten ops torch.optim.Muon calls."""
    keep = skip.reshape(()) == 0
    for p in pieces:
        r = rows[p.row]
        # add_ takes alpha as a number: on CPU tensors a read, no device sync; on CUDA (only
        # with FUSEDZERO_BACKEND=torch forced) this is one host sync per piece.
        alpha = float(r[MuonRowCol.NEG_LR])
        new = p.master.mul(r[MuonRowCol.DECAY]).add_(p.update.float(), alpha=alpha)
        if p.out is not None:
            p.out.copy_(torch.where(keep, new, p.out.float()))
        p.master.copy_(torch.where(keep, new, p.master))


def newton_schulz(
    x: torch.Tensor,
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315),
    ns_steps: int = 5,
    eps: float = 1e-7,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Orthogonalise `x` ([m, n], or a [B, m, n] stack of equal-shape matrices) in bf16, as
    torch.optim.Muon does per matrix: transpose when m > n, divide by the Frobenius norm clamped
    at `eps` (per matrix), `ns_steps` iterations of X <- a X + (b A + c A A) X with A = X X^T.

    A 2-D input runs torch's exact sequence of ops (bit-identical to its
    `_zeropower_via_newtonschulz`); a stack runs the same sequence batched (norm over the last
    two dims, bmm/baddbmm), which equals the per-matrix result where the batched matmul
    accumulates in the same order (tests/kernels/test_muon.py measures it). `out`: write the
    result there (e.g. back into the NS input's storage, which the update launch then reads);
    returns the result. A bf16 input is modified in place (as in torch)."""
    if ns_steps >= 100:
        raise ValueError(f"ns_steps={ns_steps}: must be < 100")
    if len(ns_coefficients) != 3:
        raise ValueError(f"ns_coefficients must be 3 values, got {ns_coefficients}")
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be [m, n] or [B, m, n], got shape {tuple(x.shape)}")
    a, b, c = ns_coefficients
    batched = x.dim() == 3
    tall = x.size(-2) > x.size(-1)
    X = x.bfloat16()
    if tall:
        X = X.mT
    if batched:
        X.div_(torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).clamp(min=eps))
        for _ in range(ns_steps):
            A = torch.bmm(X, X.mT)
            B = torch.baddbmm(A, A, A, beta=b, alpha=c)
            X = torch.baddbmm(X, B, X, beta=a)
    else:
        X.div_(X.norm().clamp(min=eps))
        for _ in range(ns_steps):
            A = X @ X.T
            B = torch.addmm(A, A, A, beta=b, alpha=c)
            X = torch.addmm(X, B, X, beta=a)
    if tall:
        X = X.mT
    if out is not None:
        out.copy_(X)
        return out
    return X


def ns_flops(rows: int, cols: int, ns_steps: int = 5) -> int:
    """Newton-Schulz FLOPs of one rows x cols matrix: per step A = X X^T (2 s*s*l), b A + c A A
    (2 s*s*s) and B X (2 s*s*l) for s = min, l = max: ns_steps * (4 s*s*l + 2 s*s*s)."""
    s, lg = min(rows, cols), max(rows, cols)
    return ns_steps * (4 * s * s * lg + 2 * s * s * s)
