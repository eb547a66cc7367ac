"""`fusedzero doctor`: green on this machine, and non-zero as soon as one check fails.

About an internal: fusedzero.kernels._step_scalars."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fusedzero import kernels
from fusedzero.app import doctor, kernel_checks
from fusedzero.app.cli import main
from fusedzero.app.doctor import Row, Status, format_table


def _doctor(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:
    rc = main(["doctor", "--json", *args])
    return rc, json.loads(capsys.readouterr().out)


def _check_green(report: dict, rc: int, gpu: bool) -> None:
    """The whole report: every check ran and passed (or was skipped with why), on the GPU with
    the compiled kernels, or on the CPU with the kernel code in the interpreter child."""
    by_check = {r["check"]: r for r in report["rows"]}
    bad = {c: r["detail"] for c, r in by_check.items() if r["status"] == "FAIL"}
    assert rc == 0 and report["ok"] and not bad, bad
    here = (
        f"kernels on cuda:{torch.cuda.current_device()} (compiled)"
        if gpu
        else "kernels on cpu (torch path)"
    )
    want = [
        "versions",
        "device",
        here,
        "kernels, Triton interpreter",
        "offline compile sm_90",
        "update bandwidth",
        "process group",
        "ZeroAdamW step",
        "checkpoint",
    ]
    assert list(by_check) == want
    if gpu:  # the compiled kernels ran on the GPU: no interpreter or offline-compile child
        assert by_check["kernels, Triton interpreter"]["status"] == "skipped"
        assert by_check["offline compile sm_90"]["status"] == "skipped"
    for check in [here] if gpu else [here, "kernels, Triton interpreter"]:
        variants = by_check[check]["data"]["variants"]
        # grad fp32/bf16/fp16 x out none/bf16/fp16 x maximize, sumsq per dtype, and the step's
        # scalars and rows against their torch path (bitwise)
        assert len(variants) == 3 * 3 * 2 + 3 + 1 and all(v["ok"] for v in variants), check
        assert variants[-1]["kernel"] == "scalars" and variants[-1]["worst_ulps"] == 0.0
    if by_check["offline compile sm_90"]["status"] == "ok":  # skipped (with why) without ptxas
        assert all(
            v["spill_bytes"] == 0 for v in by_check["offline compile sm_90"]["data"]["variants"]
        )
    assert by_check["update bandwidth"]["status"] == ("ok" if gpu else "info")
    bw = by_check["update bandwidth"]["data"]
    assert bw["bytes_per_param"] == 28 and bw["update_gbps"] > 0 and bw["copy_gbps"] > 0


@pytest.mark.slow  # starts the interpreter and compiler children
# Bounded: the children are ended after CHILD_TIMEOUT_S; the rest is seconds on CPU or GPU.
@pytest.mark.timeout(int(doctor.CHILD_TIMEOUT_S) + 120)
def test_doctor_is_green_on_the_cpu(capsys, monkeypatch):
    """The whole command on the CPU, whatever GPUs are visible: this process (torch already
    initialised) is told there is none, its children (interpreter, offline compile) get
    CUDA_VISIBLE_DEVICES="". On a machine without a GPU that changes nothing: the same one
    run as before, in process (a child doctor would pay seconds of imports)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc, report = _doctor(capsys)
    _check_green(report, rc, gpu=False)


@pytest.mark.cuda
@pytest.mark.slow  # the offline compile is skipped on a GPU; the rest is seconds
@pytest.mark.timeout(int(doctor.CHILD_TIMEOUT_S) + 120)
def test_doctor_is_green_on_the_gpu(capsys):
    """The whole command on cuda:N with the compiled kernels (conftest.py leaves
    TRITON_INTERPRET unset where a GPU is visible; the cuda marker skips this test otherwise)."""
    rc, report = _doctor(capsys)
    _check_green(report, rc, gpu=True)


def test_doctor_fails_when_a_kernel_disagrees_with_the_reference(capsys, monkeypatch):
    real = kernels.adamw_reference

    def off_by_a_bit(*args, **kwargs):  # 1e-5 relative: ~170 fp32 ulps, past the 8-ulp bound
        p, m, v = real(*args, **kwargs)
        return p * (1 + 1e-5), m, v

    monkeypatch.setattr(kernels, "adamw_reference", off_by_a_bit)
    rc, report = _doctor(capsys, "--checks", "kernels")
    (row,) = report["rows"]
    assert rc == 1 and not report["ok"]
    assert row["status"] == "FAIL" and "18/22 variants wrong" in row["detail"], row["detail"]


def test_doctor_fails_on_a_bad_backend_knob(capsys, monkeypatch):
    monkeypatch.setenv("FUSEDZERO_BACKEND", "cuda-please")
    rc, report = _doctor(capsys, "--checks", "device", "versions")
    status = {r["check"]: r["status"] for r in report["rows"]}
    assert rc == 1 and status == {"device": "FAIL", "versions": "ok"}
    assert "FUSEDZERO_BACKEND='cuda-please'" in report["rows"][1]["detail"]


def test_sumsq_check_catches_a_lost_block(monkeypatch):
    # The tolerance is tight enough to see the smallest block (the ragged last one) missing.
    real = kernels.sumsq
    monkeypatch.setattr(kernels, "sumsq", lambda x: real(x[: 2 * 4096]))
    r = kernel_checks.check_sumsq(torch.device("cpu"), torch.float32)
    assert not r.ok and r.worst_ulps > r.bound_ulps and "inf" in r.error


def test_table_says_fail():
    rows = [
        Row("a", Status.OK, "fine"),
        Row("b", Status.FAIL, "broken"),
        Row("c", Status.SKIPPED, "no ptxas"),
    ]
    text = format_table(rows)
    assert text.splitlines()[-1].startswith("FAIL: 2/3") and "broken" in text


def test_sumsq_bound_is_ulps_of_a_tree_sum():
    assert kernel_checks.sumsq_ulps(kernel_checks.NUMEL) == 2 * (math.ceil(math.log2(8315)) + 1)


def test_scalar_check_takes_any_nan_for_any_nan(monkeypatch) -> None:
    """A GPU returns the canonical NaN (0x7fffffff) where the CPU keeps the input's payload: the
    scalar check compares NaNs as NaNs (it failed the first H200 doctor run on the 8 cases with
    a NaN sum of squares). Stand-in for the GPU: the CPU path with its NaNs rewritten."""
    from fusedzero.kernels import _step_scalars as sc

    def gpu_like(*args, **kwargs) -> None:
        sc._step_scalars_torch(*args, **kwargs)
        for t in args[2:6]:  # norm, grad_scale, skip, step
            t.view(torch.int32)[torch.isnan(t)] = 0x7FFFFFFF

    monkeypatch.setattr(sc, "step_scalars", gpu_like)
    result = kernel_checks.check_scalars(torch.device("cpu"))
    assert result.ok, result.error
    nan_a = torch.tensor([0x7FFFFFFF], dtype=torch.int32).view(torch.float32)
    nan_b = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32)
    assert kernel_checks.differing_bits(nan_a, nan_b) == 0
    assert kernel_checks.differing_bits(torch.tensor([-0.0]), torch.tensor([0.0])) == 1
    assert kernel_checks.differing_bits(nan_a, torch.tensor([1.0])) == 1
