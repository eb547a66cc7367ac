"""The memory modes' per-buffer AdamW launch (bf16 masters, bf16/int8 states; kernels/modes.py).

[Note: memory modes are not grouped yet] The default mode (fp32 master, fp32 states) runs
through the grouped one-launch-per-step kernel (adamw.py). The memory modes were built on the
per-buffer kernel, kept here: with a memory mode a step launches once per flat buffer. Porting
`modes.py`'s load/store helpers onto the grouped kernel's piece table (extra columns for the
Kahan comp, the two scale streams at local_offset / QBLOCK and the SR offset) is the open item.

The text below is the per-buffer kernel's own description.

Reads fp32 master, grad (fp32/bf16/fp16), exp_avg, exp_avg_sq; writes master, exp_avg, exp_avg_sq
and optionally a bf16/fp16 copy of the new params. lr, step, the combined grad scale and the skip
flag are read from device tensors, so a step has no host sync and can be captured in a CUDA graph.

Layout. A param group's flat buffer is cut into `num_buckets` equal buckets; a rank owns the same
`shard_numel`-element piece of every bucket. Each stream is described by `(tensor, stride, base)`:
piece k of the shard lives at `tensor[k * stride + base : k * stride + base + shard_numel]`. The
rank's contiguous local shard is `stride=shard_numel, base=0`; its piece inside a full bucketed
buffer (the model's param buffer, an in-place reduce-scattered grad buffer) is
`stride=bucket_numel, base=rank*shard_numel`. exp_avg and exp_avg_sq are always local.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fusedzero.kernels._launch import (ENABLE_FP_FUSION, GRAD_DTYPES, Strided, as_strided,
                                       check_scalar, check_stream, count_launch, device_guard,
                                       grid_1d, pieces, shard_numel_of, use_triton)
from fusedzero.kernels.modes import (MASTER_CODE, STATE_CODE, STATE_DTYPES, check_mode_buffers,
                                     check_modes, load_master, load_state, qblocks, store_master,
                                     store_state)
from fusedzero.kernels.modes import round_to_bf16 as _round_to_bf16
from fusedzero.kernels.modes_torch import adamw_torch_mode

# 1024 elements per program: with 4 warps each thread handles 8 fp32 values, i.e. two 128-bit
# vector accesses per stream, enough bytes in flight to saturate HBM on A100/H100.
BLOCK = 1024
NUM_WARPS = 4
# [Note: GPU vs interpreter numerics] Compiled with FMA contraction off (_launch.ENABLE_FP_FUSION,
# free in a memory-bound kernel) and sqrt_rn/div_rn, every fp32 operation of the update is one IEEE
# round-to-nearest op, as numpy does it in the interpreter: the two agree bitwise except through
# the fp64 exp of the bias corrections (libdevice on the GPU, within 1 ulp of fp64, vs numpy's),
# which changes bc1/bc2 only when it straddles an fp32 rounding boundary (~2**-29 of steps) and
# then by 1 fp32 ulp: at most 2 ulps of the update. Not measured on a GPU here; the PTX is checked
# for the exact forms (tests/test_compile.py). The torch path (torch._fused_adamw_) orders the
# math differently: within 2 * 8 ulps of the interpreter (tests/test_kernels.py).
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _adamw_kernel(
    # pointers
    master_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, out_ptr,
    lr_ptr, step_ptr, scale_ptr, skip_ptr,
    # memory modes (kernels/modes.py): Kahan compensation, SR seed, int8 scales of each state
    comp_ptr, seed_ptr, exp_avg_scale_ptr, exp_avg_sq_scale_ptr,
    # sizes and strides (elements)
    shard_numel, master_stride, master_base, grad_stride, grad_base, out_stride, out_base,
    sr_offset,
    # scalars
    beta1, beta2, one_minus_beta1, one_minus_beta2, log_beta1, log_beta2, eps, weight_decay,
    # flags
    HAS_OUT: tl.constexpr, OUT_BF16: tl.constexpr, MAXIMIZE: tl.constexpr, BLOCK: tl.constexpr,
    MASTER_MODE: tl.constexpr = 0, STATE_MODE: tl.constexpr = 0,
):
    # One grid axis over (bucket, block) pairs (`_launch.grid_1d`): CUDA caps axes 1-2 at
    # 65535. int64 offsets: a flat shard may pass 2**31 elements.
    nblocks = tl.cdiv(shard_numel, BLOCK)
    prog = tl.program_id(0).to(tl.int64)
    bucket = prog // nblocks
    pid = prog - bucket * nblocks
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    # A skipped step (non-finite grads) masks every access: nothing is read or written.
    limit = tl.where(tl.load(skip_ptr) == 0, shard_numel, 0)
    mask = offs < limit

    lr = tl.load(lr_ptr).to(tl.float32)
    scale = tl.load(scale_ptr).to(tl.float32)
    # Bias corrections 1 - beta**step = -expm1(step * log(beta)) in fp64: in fp32, 1 - 0.999**1
    # would lose 4-5 digits to cancellation. One scalar per program, so the fp64 math is free.
    step = tl.load(step_ptr).to(tl.float64)
    bc1 = (1.0 - tl.exp(step * log_beta1)).to(tl.float32)
    bc2 = (1.0 - tl.exp(step * log_beta2)).to(tl.float32)
    # sqrt_rn / div_rn: IEEE round-to-nearest, where tl.sqrt compiles to sqrt.approx.ftz and `/`
    # to div.full (2 ulp). The kernel is memory-bound, so the exact forms cost nothing.
    step_size = tl.div_rn(lr, bc1)
    bc2_sqrt = tl.sqrt_rn(bc2)

    local = bucket * shard_numel + offs
    m_offs = bucket * master_stride + master_base + offs
    g_offs = bucket * grad_stride + grad_base + offs
    # The int8 states' scales: one per QBLOCK elements (dead code in the other modes).
    qidx, qmask = qblocks(bucket, pid, shard_numel, limit, BLOCK)
    p = load_master(master_ptr, m_offs, comp_ptr, local, mask, MASTER_MODE)
    g = tl.load(grad_ptr + g_offs, mask=mask).to(tl.float32) * scale
    m = load_state(exp_avg_ptr, exp_avg_scale_ptr, local, mask, qidx, qmask, STATE_MODE, True,
                   BLOCK)
    v = load_state(exp_avg_sq_ptr, exp_avg_sq_scale_ptr, local, mask, qidx, qmask, STATE_MODE,
                   False, BLOCK)
    if MAXIMIZE:
        g = -g

    # The order of operations follows torch.optim.AdamW's single-tensor path.
    p = p * (1.0 - lr * weight_decay)
    m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + one_minus_beta2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p - step_size * tl.div_rn(m, denom)

    # The update used this step's fresh fp32 m and v; only what is stored is rounded/quantized.
    store_master(master_ptr, m_offs, comp_ptr, local, mask, p, seed_ptr, step_ptr, sr_offset,
                 MASTER_MODE)
    store_state(exp_avg_ptr, exp_avg_scale_ptr, local, mask, qidx, qmask, m, STATE_MODE, True,
                BLOCK)
    store_state(exp_avg_sq_ptr, exp_avg_sq_scale_ptr, local, mask, qidx, qmask, v, STATE_MODE,
                False, BLOCK)
    if HAS_OUT:  # fp32 master only
        o_offs = bucket * out_stride + out_base + offs
        if OUT_BF16:
            o = _round_to_bf16(p)
        else:
            o = p.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + o_offs, o, mask=mask)


def adamw_step_modes(
    master: torch.Tensor | Strided,
    grad: torch.Tensor | Strided,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    out: torch.Tensor | Strided | None = None,
    *,
    lr: torch.Tensor,
    step: torch.Tensor,
    grad_scale: torch.Tensor,
    skip: torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool = False,
    num_buckets: int = 1,
    shard_numel: int | None = None,
    master_mode: str = "fp32",
    states: str = "fp32",
    exp_avg_scale: torch.Tensor | None = None,
    exp_avg_sq_scale: torch.Tensor | None = None,
    kahan: torch.Tensor | None = None,
    seed: torch.Tensor | None = None,
    sr_offset: int = 0,
) -> None:
    """One AdamW update of a shard, in place.

    `lr`, `step` (the step number of this update, already counted), `grad_scale` (multiplies the
    grad: 1/(world*accum*loss_scale) * clip_coef) and `skip` (non-zero: leave everything untouched)
    are one-element tensors on the same device. Every stream covers `num_buckets` pieces of
    `shard_numel` elements (see the module docstring); plain tensors are the local layout.

    Memory modes (kernels/modes.py): with `master_mode` "bf16-kahan", "bf16-sr" or "bf16",
    `master` is the bf16 param (no fp32 master) and `out` must be None; `kahan` is the bf16
    compensation buffer (local layout, bf16-kahan only); `seed` a one-element int32/int64 tensor
    and `sr_offset` this buffer's offset in the random stream (bf16-sr). `states` "bf16" stores
    exp_avg/exp_avg_sq as bf16, "int8" as int8/uint8 codes with fp32 `exp_avg_scale` /
    `exp_avg_sq_scale` of one per QBLOCK elements (shard_numel a multiple of QBLOCK).
    """
    check_modes(master_mode, states)
    shard_numel = shard_numel_of(exp_avg, num_buckets, shard_numel)
    ms, gs = as_strided(master, shard_numel), as_strided(grad, shard_numel)
    os_ = None if out is None else as_strided(out, shard_numel)
    device = ms.tensor.device
    m_dtype = torch.float32 if master_mode == "fp32" else torch.bfloat16
    check_stream("master", ms, (m_dtype,), num_buckets, shard_numel, device)
    check_stream("grad", gs, GRAD_DTYPES, num_buckets, shard_numel, device)
    for name, t, dt in zip(("exp_avg", "exp_avg_sq"), (exp_avg, exp_avg_sq), STATE_DTYPES[states]):
        check_stream(name, Strided(t, shard_numel, 0), (dt,), num_buckets, shard_numel, device)
    check_mode_buffers(master_mode, states, out=out, exp_avg_scale=exp_avg_scale,
                       exp_avg_sq_scale=exp_avg_sq_scale, kahan=kahan, seed=seed,
                       num_buckets=num_buckets, shard_numel=shard_numel, device=device)
    if os_ is not None:
        check_stream("out", os_, OUT_DTYPES, num_buckets, shard_numel, device)
    for name, t in (("lr", lr), ("step", step), ("grad_scale", grad_scale), ("skip", skip)):
        check_scalar(name, t, device)
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"betas must be in [0, 1), got ({beta1}, {beta2})")
    if num_buckets == 0 or shard_numel == 0:
        return

    count_launch("adamw")
    if use_triton(device):
        grid = grid_1d(num_buckets, shard_numel, BLOCK)
        o = os_ if os_ is not None else ms  # never written when HAS_OUT is False
        # Buffers a mode does not use are never touched: any pointer stands in for them.
        with device_guard(device):
            _adamw_kernel[grid](
                ms.tensor, gs.tensor, exp_avg, exp_avg_sq, o.tensor,
                lr, step, grad_scale, skip,
                exp_avg if kahan is None else kahan, skip if seed is None else seed,
                exp_avg if exp_avg_scale is None else exp_avg_scale,
                exp_avg if exp_avg_sq_scale is None else exp_avg_sq_scale,
                shard_numel, ms.stride, ms.base, gs.stride, gs.base, o.stride, o.base, sr_offset,
                beta1, beta2, 1.0 - beta1, 1.0 - beta2,
                math.log(beta1) if beta1 > 0 else -math.inf,
                math.log(beta2) if beta2 > 0 else -math.inf,
                eps, weight_decay,
                HAS_OUT=os_ is not None,
                OUT_BF16=os_ is not None and os_.tensor.dtype == torch.bfloat16,
                MAXIMIZE=maximize, BLOCK=BLOCK, MASTER_MODE=MASTER_CODE[master_mode],
                STATE_MODE=STATE_CODE[states], num_warps=NUM_WARPS,
                enable_fp_fusion=ENABLE_FP_FUSION,
            )
        return
    if master_mode != "fp32" or states != "fp32":
        adamw_torch_mode(ms, gs, exp_avg, exp_avg_sq, os_, lr=lr, step=step,
                         grad_scale=grad_scale, skip=skip, beta1=beta1, beta2=beta2, eps=eps,
                         weight_decay=weight_decay, maximize=maximize, num_buckets=num_buckets,
                         shard_numel=shard_numel, master_mode=master_mode, states=states,
                         exp_avg_scale=exp_avg_scale, exp_avg_sq_scale=exp_avg_sq_scale,
                         kahan=kahan, seed=seed, sr_offset=sr_offset)
        return
    raise ValueError("adamw_step_modes is the memory modes' per-buffer launch; the default "
                     "(fp32 master, fp32 states) goes through the grouped launch (adamw.py)")
