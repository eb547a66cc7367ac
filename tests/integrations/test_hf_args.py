"""ZeroTrainer's checks of TrainingArguments, fast (one process, no Trainer built): every `optim`
but torch's AdamW, and the half-precision full-eval casts, are refused in one line; the
Trainer's model placement skips only the model a live ZeroAdamW holds.

About internals: fusedzero.integrations.hf._check_args (the constructor calls it first) and
ZeroTrainer._move_model_to_device (the Trainer's hook)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="needs the 'hf' extra: pip install 'fusedzero[hf]'"
)
pytest.importorskip(
    "accelerate", reason="the Trainer needs accelerate: pip install 'fusedzero[hf]'"
)

from fusedzero.integrations import hf  # noqa: E402
from fusedzero.optim import ZeroAdamW  # noqa: E402


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


class Placed(torch.nn.Linear):
    """Records each `.to(...)` the Trainer's placement makes (on CPU a real move is a no-op)."""

    def __init__(self) -> None:
        super().__init__(4, 4)
        self.moves: list[Any] = []

    def to(self, *args: Any, **kwargs: Any) -> Any:
        self.moves.append(args)
        return super().to(*args, **kwargs)


def test_only_the_model_a_live_zero_adamw_holds_stays_in_place(tmp_path: Path) -> None:
    """The Trainer's `_move_model_to_device` is skipped for the model a live ZeroAdamW holds
    (`.to` would copy the params off its buffers), and only for it: `model_init`'s new model
    for a second `train()` is moved (it was skipped whenever any ZeroAdamW was set), and so
    is a model whose ZeroAdamW was closed."""
    trainer = object.__new__(hf.ZeroTrainer)  # no Trainer setup: only what the method reads
    trainer.args = args(tmp_path)
    held, fresh = Placed(), Placed()
    trainer.zero_optimizer = ZeroAdamW(held.parameters(), stage=1, module=held)
    for model in (held, fresh):
        trainer._move_model_to_device(model, torch.device("cpu"))
    assert (len(held.moves), len(fresh.moves)) == (0, 1)
    trainer.zero_optimizer.close()
    trainer._move_model_to_device(held, torch.device("cpu"))
    assert len(held.moves) == 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"param_dtype": torch.bfloat16},
            r"^ZeroTrainer got param_dtype=: it moved, use precision=Precision\(param_dtype=...\)$",
        ),
        ({"stage": True}, r"^ZeroTrainer\(stage=True\): expected an int 0, 1, 2 or 3"),
    ],
)
def test_the_constructor_names_moved_keywords_and_bad_stages(kwargs: dict, match: str) -> None:
    """Refused before the Trainer is built: a moved keyword names its record (it printed
    "unexpected keyword"), a bool stage is not taken as stage 1."""
    with pytest.raises(TypeError, match=match):
        hf.ZeroTrainer(**kwargs)
