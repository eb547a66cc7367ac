"""Every kernel variant on one device against the float64 reference, for `fusedzero doctor`.

In the doctor's process the variants run where a user's step would run them: the torch path on
CPU tensors, the compiled Triton kernels on a GPU. On CPU the doctor also runs this module in a
child process with the Triton interpreter, which must be switched on before triton is imported
(`triton.jit` reads it at decoration time), so it cannot be done in-process:

    TRITON_INTERPRET=1 FUSEDZERO_BACKEND=triton python -m fusedzero.app.kernel_checks

prints one JSON list of `VariantResult`s. `compile_sm90` compiles every variant offline for
sm_90 in another child (no GPU needed, only Triton's bundled ptxas) and checks for spills.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fusedzero import kernels

# Several blocks of both kernels (AdamW: 512-1024 elements a block, sum of squares: 4096) and a
# ragged last block, so the masks are exercised; small enough for the interpreter in seconds.
NUMEL = 2 * 4096 + 123
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUT_DTYPES = (None, torch.bfloat16, torch.float16)
# No term vanishes: weight decay on, step > 1, a non-power-of-two grad scale. lr and scale as the
# fp32 values the kernels read, so the reference sees the same numbers.
HP = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
LR, STEP, SCALE = float(torch.tensor(3e-3)), 7, float(torch.tensor(0.37))
U32 = 2.0**-24  # unit roundoff of fp32
# AdamW: ~10 fp32 operations per element, each within 1/2 ulp of its result; the paths measure at
# most ~4 ulps of the magnitudes involved (see `_magnitudes`): 8 is 2x that
# (tests/kernels/test_kernels.py uses the same bound), while a wrong bias correction, eps inside the
# sqrt or a lost weight decay or grad scale is off by orders of magnitude more.
ADAMW_ULPS = 8.0


def sumsq_ulps(n: int) -> float:
    """Bound on the relative error of the sum of squares, in fp32 ulps: n positive terms summed
    as a tree (in-block tree, then a tree over the partials; torch's CPU sum is a cascade) stay
    within ceil(log2 n) + 1 rounding errors (+1: the squaring). 2x that (3.8e-6 relative at
    NUMEL); a lost or doubled block, even the ragged last one, is off by over 1% of the sum."""
    return 2.0 * (math.ceil(math.log2(max(n, 2))) + 1)


@dataclasses.dataclass
class VariantResult:
    kernel: str  # "adamw", "sumsq" or "scalars" (the step's scalars and rows, bitwise)
    grad_dtype: str
    out_dtype: str  # "none" where there is no output
    maximize: bool
    ok: bool
    worst_ulps: float  # worst error in units of the bound's ulps
    bound_ulps: float
    error: str = ""

    @property
    def name(self) -> str:
        out = f" out={self.out_dtype}" if self.kernel == "adamw" else ""
        return f"{self.kernel} grad={self.grad_dtype}{out}{' maximize' if self.maximize else ''}"


def _short(dtype: torch.dtype | None) -> str:
    return "none" if dtype is None else str(dtype).removeprefix("torch.")


def _ulps(actual: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor) -> float:
    err = (actual.double().cpu() - expected).abs() / (U32 * magnitude)
    return math.inf if err.isnan().any() else float(err.max())


def check_adamw(
    device: torch.device,
    grad_dtype: torch.dtype,
    out_dtype: torch.dtype | None,
    maximize: bool,
    seed: int = 0,
) -> VariantResult:
    """One update of NUMEL random elements on `device` vs `adamw_reference` in float64."""
    gen = torch.Generator().manual_seed(seed)
    s0 = dict(
        master=torch.randn(NUMEL, generator=gen),
        grad=(torch.randn(NUMEL, generator=gen) * 2).to(grad_dtype),
        exp_avg=torch.randn(NUMEL, generator=gen) * 0.1,
        exp_avg_sq=torch.rand(NUMEL, generator=gen) * 0.02 + 1e-4,
    )
    s = {k: v.to(device, copy=True) for k, v in s0.items()}
    out = (
        None
        if out_dtype is None
        else torch.full((NUMEL,), math.nan, dtype=out_dtype, device=device)
    )
    f32 = dict(dtype=torch.float32, device=device)
    kernels.adamw_step(
        s["master"],
        s["grad"],
        s["exp_avg"],
        s["exp_avg_sq"],
        out,
        lr=torch.tensor([LR], **f32),
        step=torch.tensor([float(STEP)], **f32),
        grad_scale=torch.tensor([SCALE], **f32),
        skip=torch.zeros(1, dtype=torch.int32, device=device),
        maximize=maximize,
        **HP,
    )
    p_ref, m_ref, v_ref = kernels.adamw_reference(
        s0["master"],
        s0["grad"],
        s0["exp_avg"],
        s0["exp_avg_sq"],
        lr=LR,
        step=STEP,
        grad_scale=SCALE,
        maximize=maximize,
        **HP,
    )
    # exp_avg = lerp(m, g) can cancel: its error is relative to |m| + |g|, and the update,
    # proportional to exp_avg, inherits that.
    m_mag = s0["exp_avg"].double().abs() + s0["grad"].double().abs() * SCALE
    denom = v_ref.sqrt() / math.sqrt(1 - HP["beta2"] ** STEP) + HP["eps"]
    p_mag = (
        s0["master"].double().abs() * (1 - LR * HP["weight_decay"])
        + LR / (1 - HP["beta1"] ** STEP) * m_mag / denom
    )
    worst = max(
        _ulps(s["master"], p_ref, p_mag),
        _ulps(s["exp_avg"], m_ref, m_mag),
        _ulps(s["exp_avg_sq"], v_ref, v_ref.abs()),
    )
    error = "" if worst <= ADAMW_ULPS else f"off by {worst:.3g} ulps > {ADAMW_ULPS:g}"
    if out is not None:
        # The low-precision copy is this step's fp32 master rounded to nearest-even: bitwise.
        bits = torch.int16
        bad = int((out.view(bits) != s["master"].to(out_dtype).view(bits)).sum())
        if bad:
            error += f"{'; ' if error else ''}{bad} out elements != master.to({_short(out_dtype)})"
    return VariantResult(
        "adamw",
        _short(grad_dtype),
        _short(out_dtype),
        maximize,
        not error,
        worst,
        ADAMW_ULPS,
        error,
    )


def check_sumsq(device: torch.device, dtype: torch.dtype, seed: int = 0) -> VariantResult:
    """Sum of squares of NUMEL random elements vs float64; one inf must make it non-finite."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(NUMEL, generator=gen) * 3).to(dtype)
    got = float(kernels.sumsq(x.to(device)).item())
    ref = float(x.double().square().sum())
    worst = abs(got - ref) / (U32 * ref)
    bound = sumsq_ulps(NUMEL)
    error = "" if worst <= bound else f"off by {worst:.3g} ulps > {bound:g}"
    x[NUMEL - 1] = math.inf  # in the ragged last block
    if math.isfinite(float(kernels.sumsq(x.to(device)).item())):
        error += f"{'; ' if error else ''}an inf element gave a finite sum"
    return VariantResult("sumsq", _short(dtype), "none", False, not error, worst, bound, error)


def differing_bits(got: torch.Tensor, want: torch.Tensor) -> int:
    """How many fp32 values of `got` and `want` differ in their bits, any NaN equal to any NaN.

    A NaN's bits are not arithmetic: x86 CPUs keep the input NaN's payload through sqrt and
    multiply, NVIDIA GPUs return the canonical 0x7fffffff. The first H200 run of the doctor
    (bench/gpu/archive/2026-11-27-h200-6d8a599) failed the scalar check on exactly the 8 cases
    with a NaN sum of squares, whose norm is NaN on both paths. -0.0 and 0.0 still differ."""
    g, w = got.view(torch.int32), want.view(torch.int32)
    both_nan = torch.isnan(got) & torch.isnan(want)
    return int(((g != w) & ~both_nan).sum())


def check_scalars(device: torch.device) -> VariantResult:
    """The step's scalar kernels (kernels/_step_scalars.py, kernels/_rows.py) on `device` against
    their torch paths on CPU tensors, bitwise (see [Note: one launch for the step's scalars]): the
    scalars over finite, zero, huge, inf and nan sums of squares with and without clip, loss
    scale and skip; the rows of 8 groups at 4 step counts. `worst_ulps` counts the values that
    differ (the bound is 0; any two NaNs are equal: `differing_bits`)."""
    from fusedzero.kernels import _rows as rows_mod, _step_scalars as sc

    def one(v: float, dev: torch.device) -> torch.Tensor:
        return torch.tensor([v], dtype=torch.float32, device=dev)

    bad = 0
    for total, scale, clip, skip in [
        (t, s, c, k)
        for t in (3.7, 0.0, 2.5e9, math.inf, math.nan)
        for s in (None, 65536.0)
        for c in (None, 0.37)
        for k in (False, True)
    ]:
        got, want = [], []
        for dev, out, run in (
            (device, got, sc.step_scalars),
            (torch.device("cpu"), want, sc._step_scalars_torch),
        ):
            out += [one(-1.0, dev), one(-1.0, dev), one(-1.0, dev), one(41.0, dev)]
            run(
                one(total, dev),
                None if scale is None else one(scale, dev),
                *out,
                max_grad_norm=None if clip is None else one(clip, dev),
                skip_nonfinite=skip,
            )
        bad += sum(differing_bits(g.cpu(), w) for g, w in zip(got, want))
    gen = torch.Generator().manual_seed(1)
    consts = tuple(
        (b1, b2, 1e-8, wd, i % 3 == 2)
        for i, (b1, b2, wd) in enumerate(
            [(0.9, 0.95, 0.1), (0.9, 0.999, 0.0), (0.0, 0.9999, 0.01), (0.5, 0.99, 0.1)] * 2
        )
    )
    lr = torch.rand(len(consts), generator=gen) * 1e-2
    for step in (1.0, 2.0, 1000.0, 1e6):
        got = rows_mod.Rows(len(consts), device).update(
            kernels.Hyper(lr.to(device), consts), one(step, device), one(0.3125, device)
        )
        want = rows_mod.Rows(len(consts), torch.device("cpu"))
        want.write_consts(kernels.Hyper(lr, consts))
        rows_mod.adamw_rows(
            lr,
            want.c64,
            one(step, torch.device("cpu")),
            one(0.3125, torch.device("cpu")),
            want.rows,
        )  # the torch path
        bad += differing_bits(got.cpu(), want.rows)
    error = f"{bad} values differ from the torch path" if bad else ""
    return VariantResult("scalars", "fp32", "none", False, not bad, float(bad), 0.0, error)


def _guarded(
    variant: tuple[str, str, str, bool], fn: Callable[..., VariantResult], *args: Any
) -> VariantResult:
    """`fn(*args)`, or where it raises the failure of `variant` (kernel, grad dtype, out dtype,
    maximize): a crash is this variant's failure, the rest still run."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        return VariantResult(
            *variant, False, math.inf, 0.0, f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        )


def run_all(device: torch.device) -> list[VariantResult]:
    """adamw: grad dtype x out (none/bf16/fp16) x maximize; sumsq: per dtype; the scalars."""
    results = [
        _guarded(("adamw", _short(g), _short(o), mx), check_adamw, device, g, o, mx, i)
        for i, (g, o, mx) in enumerate(
            (g, o, mx) for g in GRAD_DTYPES for o in OUT_DTYPES for mx in (False, True)
        )
    ]
    results += [
        _guarded(("sumsq", _short(g), "none", False), check_sumsq, device, g, i)
        for i, g in enumerate(GRAD_DTYPES)
    ]
    results.append(_guarded(("scalars", "fp32", "none", False), check_scalars, device))
    return results


# -- children ------------------------------------------------------------------------------------


def _child(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, *args],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def start_interpreter() -> subprocess.Popen[str]:
    """The variants on CPU through the Triton interpreter, in a child (see the module doc)."""
    return _child(
        ["-m", "fusedzero.app.kernel_checks"],
        {"TRITON_INTERPRET": "1", "FUSEDZERO_BACKEND": "triton"},
    )


def interpreter_results(proc: subprocess.Popen[str], timeout: float) -> list[VariantResult]:
    out, err = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"interpreter child exited {proc.returncode}: {err.strip()[-800:]}")
    return [VariantResult(**r) for r in json.loads(out)]


def ptxas_missing() -> str:
    """Why an offline compile cannot run here ('' when it can)."""
    import triton

    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (bundled / "ptxas").exists() and not shutil.which("ptxas"):
        return "no ptxas (neither Triton's bundled one nor on PATH)"
    if not (bundled / "cuobjdump").exists():
        return "no cuobjdump in Triton's bundle (needed to read registers and spills)"
    return ""


@dataclasses.dataclass
class CompileJob:
    proc: subprocess.Popen[str]
    json_path: Path
    tmp: tempfile.TemporaryDirectory[str]


def start_compile(capability: int = 90) -> CompileJob:
    """`python -m fusedzero.kernels._compile` in a child: it needs triton imported without the
    interpreter, whatever this process has."""
    tmp = tempfile.TemporaryDirectory(prefix="fusedzero-doctor-")
    path = Path(tmp.name) / "variants.json"
    proc = _child(
        ["-m", "fusedzero.kernels._compile", "--capability", str(capability), "--json", str(path)],
        {"TRITON_INTERPRET": "0"},
    )
    return CompileJob(proc, path, tmp)


def compile_results(job: CompileJob, timeout: float) -> list[dict[str, object]]:
    """Per variant: kernel, dtypes, registers, spill bytes (STACK + LOCAL), shared bytes."""
    try:
        _, err = job.proc.communicate(timeout=timeout)
        if job.proc.returncode != 0:
            raise RuntimeError(
                f"offline compile exited {job.proc.returncode}: {err.strip()[-800:]}"
            )
        rows = json.loads(job.json_path.read_text())
    finally:
        job.tmp.cleanup()
    return [
        {
            "kernel": r["kernel"],
            "grad_dtype": r["grad_dtype"],
            "out_dtype": r["out_dtype"],
            "regs": r["usage"]["REG"],
            "spill_bytes": r["usage"]["STACK"] + r["usage"]["LOCAL"],
            "shared_bytes": r["shared_bytes"],
        }
        for r in rows
    ]


def main() -> None:
    results = run_all(torch.device("cpu"))
    print(json.dumps([dataclasses.asdict(r) for r in results]))


if __name__ == "__main__":
    main()
