"""ZeroTrainer's checks of TrainingArguments, fast (one process, no Trainer built): every `optim`
but torch's AdamW, and the half-precision full-eval casts, are refused in one line.

About an internal: fusedzero.integrations.hf._check_args (the constructor calls it first)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip(
    "transformers", reason="needs the 'hf' extra: pip install 'fusedzero[hf]'"
)
pytest.importorskip(
    "accelerate", reason="the Trainer needs accelerate: pip install 'fusedzero[hf]'"
)

from fusedzero.integrations import hf  # noqa: E402


def args(tmp_path: Path, **kw: Any) -> Any:
    return transformers.TrainingArguments(str(tmp_path), report_to=[], use_cpu=True, **kw)


def test_the_default_optim_and_torch_adamw_pass(tmp_path: Path) -> None:
    hf._check_args(args(tmp_path))  # the default: adamw_torch_fused from torch 2.8 on
    hf._check_args(args(tmp_path, optim="adamw_torch"))


@pytest.mark.parametrize(
    "optim",
    [
        "adamw_8bit",
        "adamw_bnb_8bit",
        "paged_adamw_8bit",
        "adamw_torch_4bit",
        "schedule_free_adamw",
        "galore_adamw",
        "apollo_adamw",
        "adamw_anyprecision",
        "sgd",
    ],
)
def test_other_optims_are_refused(tmp_path: Path, optim: str) -> None:
    """Each is another update (8-bit, paged, low-rank, schedule-free): ZeroAdamW's fp32 AdamW
    in its place would train something else without a word (the check was `"adamw" in optim`)."""
    with pytest.raises(ValueError, match=rf"^ZeroTrainer got TrainingArguments\(optim='{optim}'\)"):
        hf._check_args(args(tmp_path, optim=optim))


@pytest.mark.parametrize("flag", ["bf16_full_eval", "fp16_full_eval"])
def test_full_eval_casts_are_refused(tmp_path: Path, flag: str) -> None:
    """evaluate() after train() would run model.to(dtype=...), replacing the params' storage
    that ZeroAdamW owns."""
    with pytest.raises(
        ValueError, match=rf"^ZeroTrainer got TrainingArguments\({flag}=True\)[^\n]*$"
    ):
        hf._check_args(args(tmp_path, **{flag: True}))
