"""Memory modes of the fused AdamW update: bf16 masters and 16/8-bit optimizer states.

Every mode is a constexpr variant of the grouped kernel (`adamw._grouped_adamw_kernel`): the
loads and stores of master and states are the `@triton.jit` helpers below, so the update math
stays one piece of code and each variant is still one pass over the shard.

Masters (`MASTER_MODES`). "fp32": today's fp32 master (+ optional low-precision copy). The bf16
modes keep no fp32 master; `master` is the bf16 param itself and the update is computed in fp32:
- "bf16": the fp32 result rounded to nearest-even onto the param (the baseline: updates smaller
  than half a bf16 ulp are lost).
- "bf16-kahan" (Zamirai et al. 2020): a bf16 compensation buffer `comp` carries what rounding
  lost. The update reads p + comp as the effective master, writes p' = rne(x) and
  comp' = rne(x - p') (x - p' is exact in fp32: p' is x rounded to 8 bits).
- "bf16-sr": stochastic rounding of the fp32 result onto bf16, x rounded away from zero with
  probability equal to its distance from the truncated value in bf16 ulps, so E[p'] = x. The 16
  random bits are counter-based: murmur3's 32-bit finaliser (`fmix32`) over (seed, step, element
  index within the buffer's local shard + a per-buffer `sr_offset`), written identically as
  Triton uint32 ops and as torch int64 ops masked to 32 bits, so runs, resumes, the GPU, the
  interpreter and the torch path draw the same bits.

States (`STATE_MODES`). "fp32", "bf16" (stored rounded to nearest-even), or "int8": blockwise
quantized in blocks of `QBLOCK` = 128 elements, the layout's ALIGN, so a shard or bucket-piece
boundary never splits a block; one fp32 scale (the block's absmax) per block and state. The
update itself always uses this step's fresh fp32 exp_avg/exp_avg_sq; only what is stored is
quantized, and the next step starts from the dequantized values.

[Note: the int8 map] bitsandbytes' 8-bit Adam (Dettmers et al. 2021) and torchao's AdamW8bit
(`subclass_8bit.py`, block 256) scale each block by its absmax and map x/absmax to the nearest
entry of a 256-entry "dynamic tree" codebook (a float-like code: exponent bits down to ~1e-7,
fewer fraction bits the smaller the value), found by a search over the codebook. What matters is
the small values: exp_avg_sq spans the squared dynamic range of the grads inside a block, and a
value that dequantizes to 0 under a nonzero exp_avg makes the next update m / (sqrt(v) + eps)
explode. We keep that property with a power (companding) map instead of a table, which a Triton
program computes in a few fp32 ops with no table loads or search:
- exp_avg, signed int8: q = sign(x) * round(127 * sqrt(|x| / a)), x^ = a * (q/127) * |q/127|.
  Relative step 2/|q|: 1.6% at the top, values down to 1.5e-5 a stay nonzero.
- exp_avg_sq, unsigned uint8: q = round(255 * (x / a) ** (1/4)), x^ = a * (q/255) ** 4.
  Relative step 4/q (0.8% near a; at x = 1e-4 a, q = 25.5, ~8%, similar to the dynamic tree's
  3 fraction bits there); values down to a * (0.5/255)**4 = 1.5e-11 a stay nonzero, four orders
  of magnitude below the dynamic tree's smallest code (~1e-7 a), i.e. sqrt(v) down to 4e-6 of
  the block's largest.
In both maps x = a is exact (code 127/255 dequantizes to a) and 0 is exact. Rounding is
deterministic round-half-up, spelled as the fp32 ops `int(t + 0.5)` (truncating cast of a
non-negative value) so the kernel, the interpreter and the torch path agree bitwise; the float64
reference rounds the exact value, and the two can differ by one code where fp32 and float64 sit
on either side of a rounding boundary (tests count them). A block of zeros has scale 0 and codes 0.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fusedzero.kernels._launch import Strided, check_scalar, check_stream

MASTER_MODES = ("fp32", "bf16-kahan", "bf16-sr", "bf16")
STATE_MODES = ("fp32", "bf16", "int8")
# The quantization block is the layout's ALIGN (fusedzero/_layout.py): every bucket piece of a
# shard is a multiple of it, so no block straddles two pieces or two ranks.
QBLOCK = 128
# The constexpr codes the kernel is specialised on (MASTER_MODE, STATE_MODE).
MASTER_CODE = {m: i for i, m in enumerate(MASTER_MODES)}
STATE_CODE = {s: i for i, s in enumerate(STATE_MODES)}
# Largest code magnitude of each int8 map (module docstring, see [Note: the int8 map]).
SIGNED_QMAX = 127.0
UNSIGNED_QMAX = 255.0
STATE_DTYPES = {
    "fp32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "int8": (torch.int8, torch.uint8),
}  # (exp_avg, exp_avg_sq)

_QBLOCK = tl.constexpr(QBLOCK)
# murmur3 fmix32 multipliers and a golden-ratio constant to separate the hash inputs.
_C1 = 0x85EBCA6B
_C2 = 0xC2B2AE35
_GOLDEN = 0x9E3779B9
_M32 = 0xFFFFFFFF


# ------------------------------------------------------------------------------ Triton helpers


@triton.jit
def round_to_bf16(x):
    # Round-to-nearest-even fp32 -> bf16 in integer ops. The GPU's cvt.rn does the same, but the
    # Triton interpreter truncates; spelling it out gives the same rounding on both (integer ops
    # are exact, so the bf16 copy is bitwise the rounded master on both).
    bits = x.to(tl.uint32, bitcast=True)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    # A NaN stays a (quiet) NaN: the carry could otherwise wrap its payload to +-0 or inf.
    bits = tl.where(x != x, bits | 0x400000, rounded)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _fmix32(h):
    # murmur3's finaliser: a bijection on uint32 with full avalanche (uint32 ops wrap mod 2**32).
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit
def sr_key(seed_ptr, step_ptr):
    """One uint32 per program from (seed, step): every step draws fresh bits."""
    seed = tl.load(seed_ptr).to(tl.int64)
    step = tl.load(step_ptr).to(tl.int64).to(tl.uint32)
    k = _fmix32((seed >> 32).to(tl.uint32) + 0x9E3779B9)
    k = _fmix32(k ^ seed.to(tl.uint32))
    return _fmix32(k ^ _fmix32(step + 0x9E3779B9))


@triton.jit
def stochastic_round_bf16(x, key, idx):
    """x (fp32) onto bf16, rounded away from zero with probability (distance from the truncated
    value) / ulp: adding 16 random bits below the kept mantissa carries into it exactly then."""
    r = _fmix32(_fmix32(idx.to(tl.uint32) ^ key) ^ (idx >> 32).to(tl.uint32)) >> 16
    bits = x.to(tl.uint32, bitcast=True)
    bits = tl.where(x != x, bits | 0x400000, bits + r)  # a NaN stays a quiet NaN
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def load_master(master_ptr, m_offs, comp_ptr, local, mask, MASTER_MODE: tl.constexpr):
    """The effective fp32 master: the fp32 master, the bf16 param, or (Kahan) param + comp."""
    p = tl.load(master_ptr + m_offs, mask=mask).to(tl.float32)
    if MASTER_MODE == 1:  # bf16-kahan
        p = p + tl.load(comp_ptr + local, mask=mask).to(tl.float32)
    return p


@triton.jit
def store_master(
    master_ptr,
    m_offs,
    comp_ptr,
    local,
    mask,
    p,
    seed_ptr,
    step_ptr,
    sr_offset,
    MASTER_MODE: tl.constexpr,
):
    if MASTER_MODE == 0:  # fp32
        tl.store(master_ptr + m_offs, p, mask=mask)
    elif MASTER_MODE == 1:  # bf16-kahan: comp carries x - rne(x), exact in fp32
        pb = round_to_bf16(p)
        tl.store(master_ptr + m_offs, pb, mask=mask)
        tl.store(comp_ptr + local, round_to_bf16(p - pb.to(tl.float32)), mask=mask)
    elif MASTER_MODE == 2:  # bf16-sr
        key = sr_key(seed_ptr, step_ptr)
        tl.store(master_ptr + m_offs, stochastic_round_bf16(p, key, local + sr_offset), mask=mask)
    else:  # bf16
        tl.store(master_ptr + m_offs, round_to_bf16(p), mask=mask)


@triton.jit
def qblocks(bucket, pid, shard_numel, limit, BLOCK: tl.constexpr):
    """Scale indices (local shard) of a program's BLOCK // QBLOCK quantization blocks and their
    mask; shard_numel is a multiple of QBLOCK, so a block is wholly in or out."""
    j = tl.arange(0, BLOCK // _QBLOCK)
    idx = (bucket * shard_numel + pid * BLOCK) // _QBLOCK + j
    return idx, pid * BLOCK + j * _QBLOCK < limit


@triton.jit
def _dequantize(q, s, SIGNED: tl.constexpr, BLOCK: tl.constexpr):
    u = tl.reshape(q.to(tl.float32), (BLOCK // _QBLOCK, _QBLOCK))
    if SIGNED:
        u = tl.div_rn(u, 127.0)
        w = u * tl.abs(u)
    else:
        u = tl.div_rn(u, 255.0)
        w = u * u
        w = w * w
    return tl.reshape(w * s[:, None], (BLOCK,))


@triton.jit
def _quantize(x, SIGNED: tl.constexpr, BLOCK: tl.constexpr):
    xb = tl.reshape(x, (BLOCK // _QBLOCK, _QBLOCK))
    ax = tl.abs(xb)
    a = tl.max(ax, axis=1)
    y = tl.div_rn(ax, tl.where(a > 0, a, 1.0)[:, None])
    r = tl.sqrt_rn(y)
    if SIGNED:
        c = (r * 127.0 + 0.5).to(tl.int32)
        q = tl.where(xb < 0, -c, c).to(tl.int8)
    else:
        c = (tl.sqrt_rn(r) * 255.0 + 0.5).to(tl.int32)
        q = c.to(tl.uint8)
    return tl.reshape(q, (BLOCK,)), a


@triton.jit
def load_state(
    ptr,
    scale_ptr,
    local,
    mask,
    qidx,
    qmask,
    STATE_MODE: tl.constexpr,
    SIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """exp_avg (SIGNED) or exp_avg_sq as fp32, whatever it is stored as."""
    if STATE_MODE == 0:  # fp32
        x = tl.load(ptr + local, mask=mask)
    elif STATE_MODE == 1:  # bf16
        x = tl.load(ptr + local, mask=mask).to(tl.float32)
    else:  # int8 + one fp32 scale per block
        q = tl.load(ptr + local, mask=mask, other=0)
        s = tl.load(scale_ptr + qidx, mask=qmask, other=0.0)
        x = _dequantize(q, s, SIGNED, BLOCK)
    return x


@triton.jit
def store_state(
    ptr,
    scale_ptr,
    local,
    mask,
    qidx,
    qmask,
    x,
    STATE_MODE: tl.constexpr,
    SIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    if STATE_MODE == 0:
        tl.store(ptr + local, x, mask=mask)
    elif STATE_MODE == 1:
        tl.store(ptr + local, round_to_bf16(x), mask=mask)
    else:
        q, a = _quantize(x, SIGNED, BLOCK)
        tl.store(ptr + local, q, mask=mask)
        tl.store(scale_ptr + qidx, a, mask=qmask)


# ------------------------------------------------------------------- the same maps in torch ops


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 sqrt, as the kernel's tl.sqrt_rn and numpy. torch's own fp32 sqrt
    on CPU is not (measured here: 13k of 2M random values 1 ulp off, a vectorised approximation).
    The fp64 sqrt rounded to fp32 is then fixed up exactly: r is right iff x lies between the
    squares of the midpoints to its fp32 neighbours (25-bit midpoints, squares exact in fp64)."""
    r = x.double().sqrt().float()
    up, dn = torch.nextafter(r, r.new_tensor(math.inf)), torch.nextafter(r, r.new_tensor(0.0))
    xd, rd = x.double(), r.double()
    hi, lo = (rd + up.double()) / 2, (rd + dn.double()) / 2
    return torch.where(xd > hi * hi, up, torch.where(xd < lo * lo, dn, r))


def quantize_blockwise(x: torch.Tensor, *, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of fp32 `x` (numel a multiple of QBLOCK): exactly the kernel's fp32 ops.
    Codes are int8 (signed, exp_avg) or uint8 (exp_avg_sq); one fp32 scale (absmax) per block."""
    if x.dtype != torch.float32 or x.dim() != 1 or x.numel() % QBLOCK:
        raise ValueError(
            f"quantize_blockwise wants a 1-D fp32 tensor of a multiple of {QBLOCK} "
            f"elements, got {x.dtype} of shape {tuple(x.shape)}"
        )
    ax = x.view(-1, QBLOCK).abs()
    a = ax.amax(dim=1)
    r = sqrt_rn(ax / torch.where(a > 0, a, 1.0)[:, None])
    if signed:
        c = (r * SIGNED_QMAX + 0.5).to(torch.int32)
        q = torch.where(x.view(-1, QBLOCK) < 0, -c, c).to(torch.int8)
    else:
        q = (sqrt_rn(r) * UNSIGNED_QMAX + 0.5).to(torch.int32).to(torch.uint8)
    return q.view(-1), a


def dequantize_blockwise(q: torch.Tensor, scales: torch.Tensor, *, signed: bool) -> torch.Tensor:
    """fp32 values of `q` (int8/uint8) under `scales` (one per QBLOCK): the kernel's fp32 ops."""
    want = torch.int8 if signed else torch.uint8
    if q.dtype != want or q.numel() % QBLOCK or scales.numel() != q.numel() // QBLOCK:
        raise ValueError(
            f"dequantize_blockwise wants {want} codes of a multiple of {QBLOCK} and "
            f"one scale per block, got {q.dtype} x {q.numel()} and {scales.numel()}"
        )
    u = q.view(-1, QBLOCK).float() / (SIGNED_QMAX if signed else UNSIGNED_QMAX)
    w = u * u.abs() if signed else (u * u) * (u * u)
    return (w * scales.float()[:, None]).view(-1)


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    # h * c mod 2**32 on int64 holding uint32 values, split so no product passes 2**48.
    return (h * (c & 0xFFFF) + (((h * (c >> 16)) & 0xFFFF) << 16)) & _M32


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's finaliser on int64 tensors holding uint32 values (the Triton `_fmix32`)."""
    h = h ^ (h >> 16)
    h = _mul32(h, _C1)
    h = h ^ (h >> 13)
    h = _mul32(h, _C2)
    return h ^ (h >> 16)


def sr_bits(seed: torch.Tensor, step: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The 16 random bits (int64 in [0, 2**16)) the kernel adds below the bf16 mantissa of the
    element with local index `idx` (int64, sr_offset included)."""
    s = seed.reshape(()).to(torch.int64)
    st = step.reshape(()).to(torch.int64) & _M32
    k = fmix32(((s >> 32) + _GOLDEN) & _M32)
    k = fmix32(k ^ (s & _M32))
    k = fmix32(k ^ fmix32((st + _GOLDEN) & _M32))
    return fmix32(fmix32((idx & _M32) ^ k) ^ ((idx >> 32) & _M32)) >> 16


def stochastic_round_bf16_torch(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """fp32 `x` onto bf16 with the random `bits` of `sr_bits`: the kernel's integer ops."""
    u = x.view(torch.int32).to(torch.int64) & _M32
    u = torch.where(x != x, u | 0x400000, u + bits)
    return ((u >> 16) & 0xFFFF).to(torch.int32).to(torch.int16).view(torch.bfloat16)


# ------------------------------------------------------------------------------ bytes per param


def stream_bytes(
    master_mode: str, states: str, grad_dtype: torch.dtype, out_dtype: torch.dtype | None = None
) -> dict[str, float]:
    """Bytes per parameter each stream of the update moves (reads + writes), from the kernel's
    loads and stores: master r+w, comp r+w (Kahan), grad r, each state r+w, each int8 state's
    scales r+w (4 bytes per QBLOCK elements), out w (fp32 master only)."""
    check_modes(master_mode, states)
    if out_dtype is not None and master_mode != "fp32":
        raise ValueError(f"master={master_mode!r} writes the bf16 param itself; out must be None")
    master = 4 if master_mode == "fp32" else 2
    m_dt, v_dt = STATE_DTYPES[states]
    out = {
        "master": 2.0 * master,
        "grad": float(grad_dtype.itemsize),
        "exp_avg": 2.0 * m_dt.itemsize,
        "exp_avg_sq": 2.0 * v_dt.itemsize,
    }
    if master_mode == "bf16-kahan":
        out["comp"] = 2.0 * 2
    if states == "int8":
        out["scales"] = 2 * 2 * 4 / QBLOCK
    if out_dtype is not None:
        out["out"] = float(out_dtype.itemsize)
    return out


def bytes_per_param(
    master_mode: str, states: str, grad_dtype: torch.dtype, out_dtype: torch.dtype | None = None
) -> float:
    """Bytes moved per parameter by one update (28 for fp32/fp32 with bf16 grads and out;
    14.125 for bf16-kahan + int8 with bf16 grads)."""
    return sum(stream_bytes(master_mode, states, grad_dtype, out_dtype).values())


def check_modes(master_mode: str, states: str) -> None:
    if master_mode not in MASTER_MODES:
        raise ValueError(f"master_mode={master_mode!r}, expected one of {MASTER_MODES}")
    if states not in STATE_MODES:
        raise ValueError(f"states={states!r}, expected one of {STATE_MODES}")


def check_mode_buffers(
    master_mode: str,
    states: str,
    *,
    out: object,
    exp_avg_scale: torch.Tensor | None,
    exp_avg_sq_scale: torch.Tensor | None,
    kahan: torch.Tensor | None,
    seed: torch.Tensor | None,
    num_buckets: int,
    shard_numel: int,
    device: torch.device,
) -> None:
    """The buffers each mode needs, present, and those it does not, absent (with the fix)."""
    if master_mode != "fp32" and out is not None:
        raise ValueError(
            f"master_mode={master_mode!r} updates the bf16 param in place; pass "
            "out=None (there is no separate low-precision copy)"
        )
    if (kahan is not None) != (master_mode == "bf16-kahan"):
        raise ValueError(
            f"kahan (the bf16 compensation buffer) is needed by, and only by, "
            f"master_mode='bf16-kahan'; got master_mode={master_mode!r} with "
            f"kahan={'a tensor' if kahan is not None else None}"
        )
    if kahan is not None:
        check_stream(
            "kahan",
            Strided(kahan, shard_numel, 0),
            (torch.bfloat16,),
            num_buckets,
            shard_numel,
            device,
        )
    if (seed is not None) != (master_mode == "bf16-sr"):
        raise ValueError(
            f"seed is needed by, and only by, master_mode='bf16-sr'; got "
            f"master_mode={master_mode!r} with seed={seed}"
        )
    if seed is not None:
        check_scalar("seed", seed, device)
        if seed.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"seed has dtype {seed.dtype}, expected torch.int32 or torch.int64")
    scales = {"exp_avg_scale": exp_avg_scale, "exp_avg_sq_scale": exp_avg_sq_scale}
    for name, t in scales.items():
        if (t is not None) != (states == "int8"):
            given = "a tensor" if t is not None else None
            raise ValueError(
                f"{name} is needed by, and only by, states='int8'; got "
                f"states={states!r} with {name}={given}"
            )
    if states == "int8":
        if shard_numel % QBLOCK:
            raise ValueError(
                f"states='int8' quantizes blocks of {QBLOCK} elements: shard_numel "
                f"{shard_numel} must be a multiple of {QBLOCK} (the layout's ALIGN)"
            )
        for name, t in scales.items():
            check_stream(
                name,
                Strided(t, shard_numel // QBLOCK, 0),
                (torch.float32,),
                num_buckets,
                shard_numel // QBLOCK,
                device,
            )
