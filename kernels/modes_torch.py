"""The torch path (CPU tensors) of the memory-mode variants: the kernel's fp32 ops, vectorised.

Every operation is the one the Triton kernel does, in the same order and precision (fp32 math,
the bias corrections in fp64 from the fp32 `log(beta)` the kernel receives, the same integer
rounding and hash), so this path and the interpreter agree bit for bit. fp32 master with fp32
states never comes here: it stays torch's own fused AdamW (`adamw._adamw_torch`).
"""
from __future__ import annotations

import math

import torch

from fusedzero.kernels._launch import Strided, pieces
from fusedzero.kernels.modes import (QBLOCK, dequantize_blockwise, quantize_blockwise, sqrt_rn,
                                     sr_bits, stochastic_round_bf16_torch)


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def _log_beta(beta: float) -> torch.Tensor:
    # The kernel receives log(beta) as an fp32 argument and multiplies it by the step in fp64.
    return _f32(math.log(beta) if beta > 0 else -math.inf).double()


def adamw_torch_mode(ms: Strided, gs: Strided, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                     os_: Strided | None, *, lr: torch.Tensor, step: torch.Tensor,
                     grad_scale: torch.Tensor, skip: torch.Tensor, beta1: float, beta2: float,
                     eps: float, weight_decay: float, maximize: bool, num_buckets: int,
                     shard_numel: int, master_mode: str, states: str,
                     exp_avg_scale: torch.Tensor | None, exp_avg_sq_scale: torch.Tensor | None,
                     kahan: torch.Tensor | None, seed: torch.Tensor | None,
                     sr_offset: int) -> None:
    """One update of every piece, in place; one vectorised pass per piece (one piece when every
    stream is the local layout). On CPU, reading `skip` is a memory read, not a device sync."""
    if skip.item() != 0:
        return
    streams = [ms, gs] + ([os_] if os_ is not None else [])
    split = num_buckets if any(s.stride != shard_numel or s.base != 0 for s in streams) else 1
    per = num_buckets * shard_numel // split
    lr32, scale32 = lr.reshape(()).float(), grad_scale.reshape(()).float()
    stepd = step.reshape(()).double()
    bc1 = (1.0 - torch.exp(stepd * _log_beta(beta1))).float()
    bc2 = (1.0 - torch.exp(stepd * _log_beta(beta2))).float()
    hp = dict(step_size=lr32 / bc1, bc2_sqrt=sqrt_rn(bc2), decay=1.0 - lr32 * _f32(weight_decay),
              scale=scale32, omb1=_f32(1.0 - beta1), beta2=_f32(beta2), omb2=_f32(1.0 - beta2),
              eps=_f32(eps))
    outs = pieces(os_, num_buckets, shard_numel, split) if os_ is not None else [None] * split
    for k, (p_t, g_t, o_t) in enumerate(zip(pieces(ms, num_buckets, shard_numel, split),
                                           pieces(gs, num_buckets, shard_numel, split), outs)):
        lo = k * per
        sl, ql = slice(lo, lo + per), slice(lo // QBLOCK, (lo + per) // QBLOCK)
        comp = kahan[sl] if master_mode == "bf16-kahan" else None
        p = p_t.float() + comp.float() if comp is not None else p_t.float()
        m = _load_state(exp_avg[sl], exp_avg_scale, ql, states, signed=True)
        v = _load_state(exp_avg_sq[sl], exp_avg_sq_scale, ql, states, signed=False)
        p, m, v = _update(p, g_t.float(), m, v, maximize=maximize, **hp)
        if master_mode == "fp32":
            p_t.copy_(p)
            if o_t is not None:
                o_t.copy_(p)
        elif master_mode == "bf16-kahan":
            pb = p.to(torch.bfloat16)
            p_t.copy_(pb)
            comp.copy_((p - pb.float()).to(torch.bfloat16))
        elif master_mode == "bf16-sr":
            idx = torch.arange(lo, lo + per, dtype=torch.int64) + sr_offset
            p_t.copy_(stochastic_round_bf16_torch(p, sr_bits(seed, step, idx)))
        else:
            p_t.copy_(p.to(torch.bfloat16))
        _store_state(exp_avg[sl], exp_avg_scale, ql, m, states, signed=True)
        _store_state(exp_avg_sq[sl], exp_avg_sq_scale, ql, v, states, signed=False)


def _update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *,
            maximize: bool, step_size: torch.Tensor, bc2_sqrt: torch.Tensor, decay: torch.Tensor,
            scale: torch.Tensor, omb1: torch.Tensor, beta2: torch.Tensor, omb2: torch.Tensor,
            eps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # The kernel's order of operations (torch.optim.AdamW's single-tensor path), all fp32.
    g = g * scale
    if maximize:
        g = -g
    p = p * decay
    m = m + omb1 * (g - m)
    v = v * beta2 + omb2 * g * g
    denom = sqrt_rn(v) / bc2_sqrt + eps
    return p - step_size * (m / denom), m, v


def _load_state(t: torch.Tensor, scales: torch.Tensor | None, ql: slice, states: str, *,
                signed: bool) -> torch.Tensor:
    if states == "int8":
        return dequantize_blockwise(t, scales[ql], signed=signed)
    return t.float()


def _store_state(t: torch.Tensor, scales: torch.Tensor | None, ql: slice, x: torch.Tensor,
                 states: str, *, signed: bool) -> None:
    if states == "int8":
        q, a = quantize_blockwise(x, signed=signed)
        t.copy_(q)
        scales[ql].copy_(a)
    else:
        t.copy_(x)  # fp32, or bf16 rounded to nearest-even by the cast
