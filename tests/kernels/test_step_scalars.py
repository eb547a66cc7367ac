"""The per-step scalar kernels (kernels/_step_scalars.py, kernels/_rows.py): one launch each, the
same bits as their torch paths (see [Note: one launch for the step's scalars]), and compiled for
sm_80/sm_90 with IEEE fp32 division and square root.

The `_interpreter` tests run the kernel code through Triton's interpreter (CPU tensors).

About internals: fusedzero.kernels._launch, fusedzero.kernels._rows,
fusedzero.kernels._step_scalars."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from fusedzero.kernels import LAUNCHES
from fusedzero.kernels._launch import Hyper
from fusedzero.kernels._rows import NCOLS, RowCol, Rows
from fusedzero.kernels._step_scalars import step_scalars

from _helpers import compile_offline

INF, NAN = math.inf, math.nan
# Sums of squares: ordinary, tiny and huge (the clip coefficient saturates at 1 or goes to ~0),
# zero, and the non-finite ones a step must skip.
TOTALS = (3.7, 1e-12, 2.5e9, 0.0, INF, NAN)


def _run(
    backend: str,
    monkeypatch: pytest.MonkeyPatch,
    total: float | None,
    loss_scale: float | None,
    clip: float | None,
    skip_nonfinite: bool,
) -> tuple[torch.Tensor, ...]:
    monkeypatch.setenv("FUSEDZERO_BACKEND", backend)
    t = lambda v: torch.tensor([v], dtype=torch.float32)  # noqa: E731
    out = (t(-1.0), t(-1.0), t(-1.0), t(41.0))  # norm, grad_scale, skip, step
    step_scalars(
        None if total is None else t(total),
        None if loss_scale is None else t(loss_scale),
        *out,
        max_grad_norm=None if clip is None else t(clip),
        skip_nonfinite=skip_nonfinite,
    )
    return out


@pytest.mark.interpreter
@pytest.mark.parametrize("loss_scale", [None, 65536.0, 3.0])
@pytest.mark.parametrize("clip", [None, 1.0, 0.37])
@pytest.mark.parametrize("skip_nonfinite", [False, True])
def test_step_scalars_kernel_equals_torch_path_bitwise_interpreter(
    monkeypatch, loss_scale, clip, skip_nonfinite
) -> None:
    for total in (None, *TOTALS) if clip is None else TOTALS:
        want = _run("torch", monkeypatch, total, loss_scale, clip, skip_nonfinite)
        got = _run("triton", monkeypatch, total, loss_scale, clip, skip_nonfinite)
        for name, g, w in zip(("norm", "grad_scale", "skip", "step"), got, want):
            assert torch.equal(g.view(torch.int32), w.view(torch.int32)), (name, total, g, w)
        if total is not None and not math.isfinite(total) and skip_nonfinite:
            assert got[2].item() == 1.0 and got[3].item() == 41.0, "skipped, not counted"
        else:
            assert got[3].item() == 42.0


def _rows(
    backend: str, monkeypatch: pytest.MonkeyPatch, hyper: Hyper, step: float, grad_scale: float
) -> torch.Tensor:
    monkeypatch.setenv("FUSEDZERO_BACKEND", backend)
    rows = Rows(len(hyper.consts), torch.device("cpu"))
    return rows.update(hyper, torch.tensor([step]), torch.tensor([grad_scale])).clone()


@pytest.mark.interpreter
@pytest.mark.filterwarnings("error::RuntimeWarning")  # no 0/0 or log(0), even in a dead lane
def test_rows_kernel_equals_torch_rows_bitwise_interpreter(monkeypatch) -> None:
    """The rows of 20 groups (betas from 0 to 0.99999, decay, maximize) at steps from 1 to 1e7:
    the kernel's fp64 expm1 (from exp and log) is within a few fp64 ulps of torch.expm1, so
    every rounded fp32 value is the same."""
    gen = torch.Generator().manual_seed(0)
    betas = (0.0, 0.5, 0.9, 0.95, 0.99, 0.999, 0.9999, 0.99999)
    consts = tuple(
        (b1, b2, 1e-8, wd, mx)
        for (b1, b2), wd, mx in zip(
            itertools.product(betas[:4], betas[3:]),
            itertools.cycle((0.0, 0.1, 0.01)),
            itertools.cycle((False, False, True)),
        )
    )
    lr = torch.rand(len(consts), generator=gen) * 1e-2
    hyper = Hyper(lr, consts)
    before = LAUNCHES["rows"]
    for step in (1.0, 2.0, 3.0, 10.0, 999.0, 1e4, 123457.0, 1e7):
        for grad_scale in (1.0, 0.3125, 1.7e-5):
            want = _rows("torch", monkeypatch, hyper, step, grad_scale)
            got = _rows("triton", monkeypatch, hyper, step, grad_scale)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (
                step,
                grad_scale,
                (got - want).abs().max(),
            )
    assert LAUNCHES["rows"] - before == 8 * 3, "one launch per update"
    assert not torch.isnan(got[:, RowCol.STEP_SIZE]).any() and got.shape[1] == NCOLS


def _fused(
    backend: str,
    monkeypatch: pytest.MonkeyPatch,
    hyper: Hyper,
    total: float,
    clip: float | None,
    loss_scale: float | None,
) -> tuple[torch.Tensor, ...]:
    monkeypatch.setenv("FUSEDZERO_BACKEND", backend)
    t = lambda v: torch.tensor([v], dtype=torch.float32)  # noqa: E731
    rows = Rows(len(hyper.consts), torch.device("cpu"))
    out = (t(-1.0), t(-1.0), t(-1.0), t(41.0))  # norm, grad_scale, skip, step
    step_scalars(
        t(total),
        None if loss_scale is None else t(loss_scale),
        *out,
        max_grad_norm=None if clip is None else t(clip),
        skip_nonfinite=True,
        rows=rows,
        hyper=hyper,
    )
    return (*out, rows.rows.clone())


@pytest.mark.interpreter
def test_step_scalars_write_the_rows_in_the_same_launch_bitwise_interpreter(monkeypatch) -> None:
    """The step's scalars and the update's rows are one launch, whose rows
    are those of the torch path (the scalars', then `adamw_rows`) to the bit, from the step
    count and grad scale the same launch computed (a skipped step keeps its count)."""
    consts = ((0.9, 0.999, 1e-8, 0.1, False), (0.8, 0.95, 1e-6, 0.0, True))
    hyper = Hyper(torch.tensor([1e-3, 3e-4]), consts)
    for total, clip, loss_scale in (
        (3.7, 1.0, None),
        (2.5e9, 0.37, 65536.0),
        (NAN, 1.0, None),
        (0.0, None, 3.0),
    ):
        before = dict(LAUNCHES)
        got = _fused("triton", monkeypatch, hyper, total, clip, loss_scale)
        assert LAUNCHES["step_scalars"] - before.get("step_scalars", 0) == 1
        assert LAUNCHES["rows"] == before.get("rows", 0), "no launch of its own for the rows"
        want = _fused("torch", monkeypatch, hyper, total, clip, loss_scale)
        for name, g, w in zip(("norm", "grad_scale", "skip", "step", "rows"), got, want):
            assert torch.equal(g.view(torch.int32), w.view(torch.int32)), (name, total, g, w)


@pytest.mark.slow
def test_scalar_kernels_compile_with_ieee_fp32_for_sm80_and_sm90(tmp_path) -> None:
    """Offline (no GPU): each variant compiles; the scalar kernel's fp32 division and square
    root are the round-to-nearest forms (as torch computes them: the same bits), with no
    approximate form and no FMA contraction; the rows' fp64 divisions and square root too."""
    rows = compile_offline("_compile_scalars", tmp_path / "scalars.json")
    assert {(r["kernel"], r["capability"]) for r in rows} == {
        (k, c) for k in ("step_scalars", "rows") for c in (80, 90)
    }
    for r in rows:
        a = r["arithmetic"]
        assert r["usage"]["LOCAL"] == 0, r
        if r["kernel"] == "step_scalars":
            # (fp64 fma and rcp: libdevice's exp and log in the rows, as in their own kernel)
            assert not any(
                k.endswith(".f32") and ("approx" in k or k.startswith("fma")) for k in a
            ), r
            if r["flags"][2]:  # the clip: 1 / (norm + 1e-6), sqrt(total)
                assert a.get("div.rn.f32", 0) >= 1 and a.get("sqrt.rn.f32") == 1, r
            if r["flags"][4]:  # the update's rows, in the same launch
                assert a.get("div.rn.f64") == 3 and a.get("sqrt.rn.f64") == 1, r
            else:
                assert not any(k.endswith(".f64") for k in a), r
        else:
            assert a.get("div.rn.f64") == 3 and a.get("sqrt.rn.f64") == 1, r
            assert not any(k.endswith(".f32") and "approx" in k for k in a), r
