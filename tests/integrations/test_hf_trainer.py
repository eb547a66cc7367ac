"""fusedzero.integrations.hf.ZeroTrainer against the plain transformers Trainer (DDP + torch
AdamW, the same TrainingArguments) on 2 gloo ranks, stages 0-3, in one launch of the ranks:
every logged loss and grad_norm, the saved weights (`save_model` -> `from_pretrained`), the
sharded checkpoint in each checkpoint-N/ with save_total_limit, and a resumed run (at 2 ranks
and at 1) that ends where the uninterrupted run ends; and docs/integrations.md's Trainer
example, as written, on the same ranks. Skipped without the 'hf' extra."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fusedzero.testing import run_ranks

pytestmark = pytest.mark.slow  # spawns ranks

transformers = pytest.importorskip(
    "transformers", reason="needs the 'hf' extra: pip install 'fusedzero[hf]'"
)
pytest.importorskip(
    "accelerate", reason="the Trainer needs accelerate: pip install 'fusedzero[hf]'"
)

from _tiny import ATOL, LR, RTOL, STAGES, W, run_doc_block, tiny_llama, tokens  # noqa: E402

N_SEQS, STEPS = 64, 6


class Tokens(torch.utils.data.Dataset):
    """N_SEQS random sequences, the same on every rank (the Trainer shards them per rank)."""

    def __init__(self) -> None:
        self.x = tokens(N_SEQS)

    def __len__(self) -> int:
        return N_SEQS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def make_model() -> torch.nn.Module:
    return tiny_llama()


def training_args(out: str, **over: Any) -> Any:
    """2 ranks x 2 sequences x 2 micro-batches a step, clipping active (the norms are ~0.8),
    warmup then cosine, a checkpoint every 2 steps of which the last 2 are kept, an evaluation
    every 3 (a forward under no_grad: stage 3 gathers and frees its units without a backward)."""
    kw = dict(
        output_dir=out,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        learning_rate=LR,
        weight_decay=0.1,
        adam_beta2=0.95,
        max_grad_norm=0.5,
        lr_scheduler_type="cosine",
        warmup_steps=1,
        logging_steps=1,
        save_steps=2,
        save_total_limit=2,
        eval_strategy="steps",
        eval_steps=3,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        optim="adamw_torch",
    )
    kw.update(over)
    return transformers.TrainingArguments(**kw)


def logged(trainer: Any) -> list[tuple[int, float, float]]:
    """(step, loss, grad_norm) of every logged step, then (step, eval_loss, 0) of every
    evaluation."""
    history = trainer.state.log_history
    return [(h["step"], h["loss"], h["grad_norm"]) for h in history if "loss" in h] + [
        (h["step"], h["eval_loss"], 0.0) for h in history if "eval_loss" in h
    ]


def weights(path: str) -> dict[str, torch.Tensor]:
    model = transformers.LlamaForCausalLM.from_pretrained(path)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def two_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    """Every 2-rank run of the test, one after another on the same ranks: the plain Trainer,
    ZeroTrainer at each stage, and stage 2's checkpoint-4 resumed at stage 3."""
    from fusedzero.integrations.hf import ZERO_DIR, ZeroTrainer
    from fusedzero.optim import ZeroAdamW

    out: dict[str, Any] = {}
    ref = transformers.Trainer(
        model=make_model(),
        args=training_args(f"{root}/ddp"),
        train_dataset=Tokens(),
        eval_dataset=Tokens(),
    )
    ref.train()
    out["ddp"] = logged(ref)
    out["ddp_flos"] = ref.state.total_flos
    ref.save_model(f"{root}/ddp/final")
    for stage in STAGES:
        d = f"{root}/s{stage}"
        # (stage 3 with the Trainer's activation checkpointing: the same losses, recomputed)
        t = ZeroTrainer(
            model=make_model(),
            train_dataset=Tokens(),
            eval_dataset=Tokens(),
            args=training_args(d, gradient_checkpointing=stage == 3),
            stage=stage,
        )
        t.train()
        assert t.model_wrapped is t.model, type(t.model_wrapped)  # no DDP around it
        out[f"s{stage}"] = logged(t)
        out[f"s{stage}_flos"] = t.state.total_flos
        opt = t.zero_optimizer
        buckets = sum(b.layout.num_buckets for b in opt.flat_groups)
        out[f"s{stage}_reductions"] = (opt.comm.calls["all_reduce"], buckets)
        out[f"s{stage}_ckpts"] = sorted(p.name for p in Path(d).glob("checkpoint-*"))
        out[f"s{stage}_zero"] = sorted(
            p.parent.name for p in Path(d).glob(f"checkpoint-*/{ZERO_DIR}")
        )
        t.save_model(f"{d}/final")
    # The user's own ZeroAdamW (the Trainer's groups and arguments), passed in optimizers=
    model = make_model()
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    groups = [
        {"params": [p for n, p in model.named_parameters() if n in decay]},
        {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0},
    ]
    own = ZeroAdamW(
        groups, lr=LR, betas=(0.9, 0.95), weight_decay=0.1, stage=1, module=model, max_grad_norm=0.5
    )
    t = ZeroTrainer(
        model=model,
        args=training_args(f"{root}/own"),
        train_dataset=Tokens(),
        eval_dataset=Tokens(),
        optimizers=(own, None),
    )
    t.train()
    out["own"] = logged(t)
    t = ZeroTrainer(
        model=make_model(),
        args=training_args(f"{root}/resumed"),
        train_dataset=Tokens(),
        eval_dataset=Tokens(),
        stage=3,
    )
    t.train(resume_from_checkpoint=f"{root}/s2/checkpoint-4")
    out["resumed"] = logged(t)
    t.save_model(f"{root}/resumed/final")
    # docs/integrations.md's example, as written (torchrun's 2 ranks are these)
    out["doc"] = logged(
        run_doc_block("tests/integrations/test_hf_trainer.py", f"{root}/doc")["trainer"]
    )
    return out


def one_rank(rank: int, world: int, root: str) -> list[tuple[int, float, float]]:
    """Stage 3's checkpoint-4 (2 ranks) resumed at 1 rank and stage 1: 4 sequences a
    micro-batch, so every step sees the samples the 2 ranks saw together."""
    from fusedzero.integrations.hf import ZeroTrainer

    t = ZeroTrainer(
        model=make_model(),
        stage=1,
        train_dataset=Tokens(),
        eval_dataset=Tokens(),
        args=training_args(f"{root}/w1", per_device_train_batch_size=4),
    )
    t.train(resume_from_checkpoint=f"{root}/s3/checkpoint-4")
    t.save_model(f"{root}/w1/final")
    return logged(t)


def ref_keys(tmp_path: Path) -> set[str]:
    return set(weights(str(tmp_path / "ddp" / "final")))


def test_zero_trainer_matches_ddp_trainer(tmp_path: Path) -> None:
    got = run_ranks(two_ranks, W, str(tmp_path), timeout=600)[0]
    w1 = run_ranks(one_rank, 1, str(tmp_path), timeout=300)[0]
    ref = got["ddp"]
    assert [s for s, _, _ in ref] == list(range(1, STEPS + 1)) + [3, 6]  # steps, then evals

    def close(
        have: list[tuple[int, float, float]], want: list[tuple[int, float, float]], what: str
    ) -> None:
        assert [s for s, _, _ in have] == [s for s, _, _ in want], what
        torch.testing.assert_close(
            torch.tensor(have),
            torch.tensor(want),
            rtol=RTOL,
            atol=0,
            msg=lambda m: f"{what}: (step, loss, grad_norm) and (step, eval_loss, 0) vs DDP: {m}",
        )

    # Stage 0 reduces each bucket once a step, not once a micro-batch: the first micro-batch
    # runs under ZeroAdamW's no_sync (Accelerate's looked for DDP's and found none).
    calls, buckets = got["s0_reductions"]
    assert calls == STEPS * buckets, (calls, buckets)
    for stage in STAGES:
        close(got[f"s{stage}"], ref, f"stage {stage}")
        assert got[f"s{stage}_flos"] == got["ddp_flos"] > 0, stage  # stage 3's params empty
        # save_total_limit=2 removed checkpoint-2; each checkpoint holds our sharded one
        assert got[f"s{stage}_ckpts"] == ["checkpoint-4", "checkpoint-6"], stage
        assert got[f"s{stage}_zero"] == ["checkpoint-4", "checkpoint-6"], stage
    close(got["own"], ref, "the user's ZeroAdamW in optimizers=")
    # (a resumed run's history holds the checkpoint's, then its own steps 5-6 and eval at 6)
    close(got["resumed"], ref, "stage 2 resumed at stage 3")
    close(w1, ref, "stage 3 at 2 ranks resumed at stage 1 on 1 rank")
    assert [s for s, _, _ in got["doc"]] == [1, 2, 3, 4]
    assert weights(str(tmp_path / "doc" / "hf_out" / "final")).keys() == ref_keys(tmp_path)
    want = weights(str(tmp_path / "ddp" / "final"))
    for run in [f"s{stage}" for stage in STAGES] + ["resumed", "w1"]:
        have = weights(str(tmp_path / run / "final"))
        assert have.keys() == want.keys(), run
        for k in want:
            torch.testing.assert_close(
                have[k],
                want[k],
                rtol=RTOL,
                atol=ATOL,
                msg=lambda m, run=run, k=k: f"{run} {k}: {m}",
            )


def refusals(rank: int, world: int, root: str) -> dict[str, str]:
    """What each bad combination raises: type and message."""
    from fusedzero.integrations.hf import ZeroTrainer
    from fusedzero.optim import ZeroAdamW

    def error(**kw: Any) -> str:
        kw.setdefault("model", make_model())
        try:
            ZeroTrainer(train_dataset=Tokens(), eval_dataset=Tokens(), stage=2, **kw)
        except (TypeError, ValueError) as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    deepspeed = training_args(root)
    deepspeed.deepspeed = {"zero_optimization": {"stage": 2}}  # (building it needs deepspeed)
    sgd = torch.optim.SGD(make_model().parameters(), lr=0.1)
    model = make_model()  # the user's ZeroAdamW without clipping, the arguments' default 1.0
    unclipped = ZeroAdamW(model.parameters(), stage=1, module=model)
    return {
        "fsdp": error(args=training_args(root, fsdp="full_shard")),
        "deepspeed": error(args=deepspeed),
        "fp16": error(args=training_args(root, fp16=True)),
        "optim": error(args=training_args(root, optim="sgd")),
        "optimizers": error(args=training_args(root), optimizers=(sgd, None)),
        "lr": error(args=training_args(root), lr=1e-3),
        "unknown": error(args=training_args(root), bucket_size=10),
        "clip": error(
            model=model, args=training_args(root, max_grad_norm=1.0), optimizers=(unclipped, None)
        ),
    }


def test_bad_combinations_are_one_line(tmp_path: Path) -> None:
    """Each refused in one line that names it and says what to do (one rank: the ranks of the
    test above are reused)."""
    got = run_ranks(refusals, 1, str(tmp_path))[0]
    want = {
        "fsdp": "ValueError: ZeroTrainer got TrainingArguments(fsdp=",
        "deepspeed": "ValueError: ZeroTrainer got TrainingArguments(deepspeed=",
        "fp16": "ValueError: ZeroTrainer got TrainingArguments(fp16=True)",
        "optim": "ValueError: ZeroTrainer got TrainingArguments(optim='sgd')",
        "optimizers": "TypeError: ZeroTrainer got optimizers=(SGD, ...)",
        "lr": "TypeError: ZeroTrainer got lr=: it comes from TrainingArguments(learning_rate",
        "unknown": "TypeError: ZeroTrainer got an unexpected keyword bucket_size=",
        "clip": "ValueError: ZeroTrainer got a ZeroAdamW with max_grad_norm=None and "
        "TrainingArguments(max_grad_norm=1.0)",
    }
    for k, start in want.items():
        assert got[k].startswith(start) and "\n" not in got[k], (k, got[k])
