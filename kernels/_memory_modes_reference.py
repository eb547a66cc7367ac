"""Float64 reference of the memory-mode update, for tests.

The same algorithm as the kernel (kernels/_memory_modes.py), computed exactly where the kernel
rounds to fp32: the update in float64 from the stored state, then the roundings the algorithm
itself makes (to bf16, stochastic rounding with the kernel's random bits, the int8 maps on the
exact values with round-half-up) done exactly in float64. It shares with the kernel only the
definition of the random bits (`modes.sr_bits`), which are an input of the algorithm, not math to
check.
"""

from __future__ import annotations

import torch

from fusedzero.kernels._memory_modes import QBLOCK, SIGNED_QMAX, UNSIGNED_QMAX, check_modes, sr_bits


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    # x = mant * 2**e with mant in [0.5, 1): bf16 keeps 8 significant bits, so ulp = 2**(e - 8).
    _, e = torch.frexp(x)
    return torch.ldexp(torch.ones_like(x), e - 8)


def bf16_round_nearest_even(x: torch.Tensor) -> torch.Tensor:
    """float64 -> the nearest bf16 value (ties to even), as float64; no double rounding."""
    ulp = _bf16_ulp(x)
    return torch.round(x / ulp) * ulp  # x / ulp is exact (a power of two); round is half-even


def bf16_round_stochastic(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """float64 -> bf16 value: away from zero iff frac + bits / 2**16 >= 1, where frac is |x|'s
    distance above its truncation in ulps (what adding `bits` below the mantissa does)."""
    ulp = _bf16_ulp(x)
    t = x / ulp
    lo = torch.trunc(t)
    up = ((t - lo).abs() + bits.double() / 2**16) >= 1
    return (lo + torch.where(up, torch.sign(t), 0.0)) * ulp


def quantize_exact(x: torch.Tensor, *, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 maps (see [Note: the int8 map]) on exact values: (codes as int64, absmax scales)."""
    xb = x.double().view(-1, QBLOCK)
    a = xb.abs().amax(dim=1)
    y = xb.abs() / torch.where(a > 0, a, 1.0)[:, None]
    if signed:
        c = torch.floor(y.sqrt() * SIGNED_QMAX + 0.5) * torch.where(xb < 0, -1.0, 1.0)
    else:
        c = torch.floor(y.sqrt().sqrt() * UNSIGNED_QMAX + 0.5)
    return c.to(torch.int64).view(-1), a


def dequantize_exact(q: torch.Tensor, scales: torch.Tensor, *, signed: bool) -> torch.Tensor:
    u = q.double().view(-1, QBLOCK) / (SIGNED_QMAX if signed else UNSIGNED_QMAX)
    w = u * u.abs() if signed else (u * u) ** 2
    return (w * scales.double()[:, None]).view(-1)


def adamw_reference_mode(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    step: int,
    grad_scale: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool = False,
    master_mode: str = "fp32",
    states: str = "fp32",
    exp_avg_scale: torch.Tensor | None = None,
    exp_avg_sq_scale: torch.Tensor | None = None,
    kahan: torch.Tensor | None = None,
    seed: torch.Tensor | None = None,
    sr_offset: int = 0,
) -> dict[str, torch.Tensor]:
    """One update of local (contiguous) tensors stored as the modes store them. Returns float64
    tensors: "master" (as stored: bf16 values in the bf16 modes), "kahan" (bf16-kahan),
    "exp_avg"/"exp_avg_sq" (as stored; int64 codes for int8) with "exp_avg_scale"/
    "exp_avg_sq_scale" (int8), and the exact values before any storage rounding: "p_exact"
    (the effective master), "m_exact", "v_exact"."""
    check_modes(master_mode, states)
    p = master.double() + (kahan.double() if master_mode == "bf16-kahan" else 0.0)
    if states == "int8":
        m = dequantize_exact(exp_avg, exp_avg_scale, signed=True)
        v = dequantize_exact(exp_avg_sq, exp_avg_sq_scale, signed=False)
    else:
        m, v = exp_avg.double(), exp_avg_sq.double()
    g = grad.double() * grad_scale
    if maximize:
        g = -g
    p = p * (1 - lr * weight_decay)
    m = m + (1 - beta1) * (g - m)
    v = v * beta2 + (1 - beta2) * g * g
    denom = v.sqrt() / (1 - beta2**step) ** 0.5 + eps
    p = p - lr / (1 - beta1**step) * m / denom
    out = {"p_exact": p, "m_exact": m, "v_exact": v}
    if master_mode == "fp32":
        out["master"] = p
    elif master_mode == "bf16-kahan":
        out["master"] = bf16_round_nearest_even(p)
        out["kahan"] = bf16_round_nearest_even(p - out["master"])
    elif master_mode == "bf16-sr":
        idx = torch.arange(p.numel(), dtype=torch.int64) + sr_offset
        out["master"] = bf16_round_stochastic(p, sr_bits(seed, torch.tensor(step), idx))
    else:
        out["master"] = bf16_round_nearest_even(p)
    if states == "int8":
        out["exp_avg"], out["exp_avg_scale"] = quantize_exact(m, signed=True)
        out["exp_avg_sq"], out["exp_avg_sq_scale"] = quantize_exact(v, signed=False)
    elif states == "bf16":
        out["exp_avg"], out["exp_avg_sq"] = bf16_round_nearest_even(m), bf16_round_nearest_even(v)
    else:
        out["exp_avg"], out["exp_avg_sq"] = m, v
    return out
