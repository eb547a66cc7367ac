"""fusedzero.integrations.lightning.ZeroStrategy against strategy="ddp" on 2 gloo ranks, stages
0-3, in one launch of the ranks: a LightningModule (a tiny Llama) whose configure_optimizers
returns torch.optim.AdamW with two param groups and a per-step lr schedule, trained with
gradient clipping and accumulate_grad_batches=2, validated each epoch. Every training and
validation loss, the full params from `full_state_dict()` (during fit) and the
module after fit equal DDP's within fp32 noise; a fit resumed from a ModelCheckpoint folder (at
another stage) ends where DDP's resumed fit ends, and so does a new Trainer's fit from "last"
after a stage-3 fit that raised; docs/integrations.md's Lightning example runs
as written on the same ranks; bad combinations are refused in one line. Skipped without the
'lightning' extra."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fusedzero.testing import run_ranks

pytestmark = pytest.mark.slow  # spawns ranks

L = pytest.importorskip(
    "lightning.pytorch", reason="needs the 'lightning' extra: pip install 'fusedzero[lightning]'"
)
transformers = pytest.importorskip(
    "transformers", reason="the module is a transformers Llama: pip install 'fusedzero[hf]'"
)

from _tiny import ATOL, LR, RTOL, STAGES, W, run_doc_block, tiny_llama, tokens  # noqa: E402

N_SEQS, EPOCHS = 16, 2  # an epoch: 16 / (2 ranks x 2 seqs x 2 micro-batches) = 2 steps


class Llama(L.LightningModule):
    """A user's module as written for DDP: nothing in it knows of fusedzero."""

    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_llama()
        self.losses: list[float] = []
        self.val_losses: list[float] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.net(input_ids=batch, labels=batch).loss
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        # (no grad: stage 3 gathers and frees its units without a backward)
        self.val_losses.append(self.net(input_ids=batch, labels=batch).loss.item())

    def configure_optimizers(self) -> Any:
        decay = [p for n, p in self.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.named_parameters() if p.dim() < 2]
        opt = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": 0.1},
                {"params": no_decay, "weight_decay": 0.0, "lr": LR / 2},
            ],
            lr=LR,
            betas=(0.9, 0.95),
            eps=1e-8,
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(tokens(N_SEQS), batch_size=2, shuffle=True)

    def val_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(tokens(4), batch_size=2)


class FullParams(L.Callback):
    """The full params at the end of the last epoch, while the optimizer is live (ZeroStrategy's
    `full_state_dict()`, DDP's `lightning_module_state_dict()`); under ZeroStrategy also the
    param all-gathers that `trainer.save_checkpoint` runs then (the sharded checkpoint holds the
    params: before, stage 3 gathered every unit for a state dict it dropped)."""

    def __init__(self) -> None:
        self.sd: dict[str, torch.Tensor] = {}
        self.save_gathers: int | None = None

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.current_epoch != EPOCHS - 1:
            return
        strategy = trainer.strategy
        opt = getattr(strategy, "zero_optimizer", None)
        sd = strategy.lightning_module_state_dict() if opt is None else strategy.full_state_dict()
        self.sd = {k: v.detach().clone() for k, v in sd.items()}
        if opt is not None:
            before = opt.comm.calls["all_gather"]
            trainer.save_checkpoint(f"{trainer.default_root_dir}/probe.ckpt")
            self.save_gathers = opt.comm.calls["all_gather"] - before


def short_trainer(root: str, strategy: Any, **kw: Any) -> Any:
    """A Trainer on the W ranks that logs, shows and checkpoints nothing unless `kw` says."""
    quiet = dict(
        accelerator="cpu",
        devices=W,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=root,
    )
    return L.Trainer(strategy=strategy, **{**quiet, **kw})


def fit(
    root: str, strategy: Any, epochs: int = EPOCHS, ckpt_path: str | None = None, save: bool = False
) -> tuple[Llama, FullParams]:
    module, full = Llama(), FullParams()
    callbacks: list[Any] = [full]
    if save:
        callbacks.append(
            L.callbacks.ModelCheckpoint(dirpath=f"{root}/ckpts", save_top_k=-1, every_n_epochs=1)
        )
    trainer = short_trainer(
        root,
        strategy,
        max_epochs=epochs,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
        enable_checkpointing=save,
        callbacks=callbacks,
        num_sanity_val_steps=1,
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return module, full


def validate(root: str, strategy: Any, ckpt: Path) -> list[float]:
    """`trainer.validate(ckpt_path=...)`: no optimizer, the weights from the checkpoint."""
    module = Llama()
    short_trainer(root, strategy).validate(module, ckpt_path=str(ckpt), verbose=False)
    return module.val_losses


def params(module: Llama) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def two_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    from fusedzero.integrations.lightning import ZeroStrategy

    out: dict[str, Any] = {}
    ddp, full = fit(
        f"{root}/ddp", L.strategies.DDPStrategy(process_group_backend="gloo"), save=True
    )
    out["ddp"] = (ddp.losses + ddp.val_losses, params(ddp), full.sd)
    ckpt = next(Path(f"{root}/ddp/ckpts").glob("epoch=0-*.ckpt"))
    resumed, _ = fit(
        f"{root}/ddp_r", L.strategies.DDPStrategy(process_group_backend="gloo"), ckpt_path=str(ckpt)
    )
    out["ddp_resumed"] = (resumed.losses + resumed.val_losses, params(resumed))
    out["ddp_validate"] = validate(f"{root}/ddp_v", L.strategies.DDPStrategy(), ckpt)
    for stage in STAGES:
        strategy = ZeroStrategy(stage=stage)
        module, full = fit(f"{root}/s{stage}", strategy, save=stage == 2)
        out[f"s{stage}"] = (module.losses + module.val_losses, params(module), full.sd)
        out[f"s{stage}_save_gathers"] = full.save_gathers
        opt = strategy.zero_optimizer
        out[f"s{stage}_reductions"] = (
            opt.comm.calls["all_reduce"],
            sum(b.layout.num_buckets for b in opt.flat_groups),
        )
    ckpt = next(Path(f"{root}/s2/ckpts").glob("epoch=0-*.ckpt"))
    assert ckpt.is_dir(), ckpt
    resumed, _ = fit(f"{root}/s3_r", ZeroStrategy(stage=3), ckpt_path=str(ckpt))
    out["resumed"] = (resumed.losses + resumed.val_losses, params(resumed))
    out["validate"] = validate(f"{root}/s1_v", ZeroStrategy(stage=1), ckpt)
    # docs/integrations.md's example, as written (Lightning's launcher finds these 2 ranks)
    ns = run_doc_block("tests/integrations/test_lightning_strategy.py", f"{root}/doc")
    out["doc"] = ns["trainer"].global_step
    out["doc_ckpts"] = sorted(p.name for p in Path(f"{root}/doc/pl_out").glob("**/lightning.pt"))
    return out


def test_zero_strategy_matches_ddp(tmp_path: Path) -> None:
    got = run_ranks(two_ranks, W, str(tmp_path), timeout=600)[0]
    ref_losses, ref_params, ref_full = got["ddp"]
    # micro-batches, then validation: the sanity check (1 batch) and 1 batch per rank an epoch
    assert len(ref_losses) == 2 * 2 * EPOCHS + 1 + EPOCHS

    def close(have: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
        assert have.keys() == want.keys(), what
        for k in want:
            torch.testing.assert_close(
                have[k], want[k], rtol=RTOL, atol=ATOL, msg=lambda m, k=k: f"{what} {k}: {m}"
            )

    # Stage 0 reduces each bucket once a step (2 an epoch), not once a micro-batch: the first
    # micro-batch runs under ZeroAdamW's no_sync (block_backward_sync).
    calls, buckets = got["s0_reductions"]
    assert calls == 2 * EPOCHS * buckets, (calls, buckets)
    for stage in STAGES:
        losses, p, full = got[f"s{stage}"]
        torch.testing.assert_close(
            torch.tensor(losses),
            torch.tensor(ref_losses),
            rtol=RTOL,
            atol=0,
            msg=lambda m, stage=stage: f"stage {stage} losses vs DDP: {m}",
        )
        close(full, ref_full, f"stage {stage} full_state_dict() during fit")
        if stage == 3:  # before: one all-gather per unit
            assert got["s3_save_gathers"] == 0, got["s3_save_gathers"]
        close(p, ref_params, f"stage {stage} after fit")
    r_losses, r_params = got["resumed"]
    d_losses, d_params = got["ddp_resumed"]
    torch.testing.assert_close(
        torch.tensor(r_losses),
        torch.tensor(d_losses),
        rtol=RTOL,
        atol=0,
        msg=lambda m: f"resumed losses vs DDP's resumed: {m}",
    )
    close(r_params, d_params, "resumed fit vs DDP's resumed fit")
    assert len(got["ddp_validate"]) == 1
    torch.testing.assert_close(
        got["validate"],
        got["ddp_validate"],
        rtol=RTOL,
        atol=0,
        msg=lambda m: f"validate(ckpt_path=...) vs DDP's: {m}",
    )
    assert got["doc"] == 4 and got["doc_ckpts"] == ["lightning.pt"], (got["doc"], got["doc_ckpts"])


class FailsOnce(Llama):
    """Raises in its training step `fail_at`, on every rank, in its first fit only (a second
    fit on the same module in the same process goes through)."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at: int | None = fail_at

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if batch_idx == self.fail_at:
            self.fail_at = None
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


def fail_then_refit(root: str, strategy: Any) -> dict[str, Any]:
    """A fit that saves a checkpoint a step (`last` included) and raises in its third step,
    then a new Trainer on the same module, in the same process: `fit(ckpt_path="last")`."""
    module = FailsOnce(fail_at=2)

    def trainer() -> Any:
        last = L.callbacks.ModelCheckpoint(
            dirpath=f"{root}/ckpts", save_last=True, save_top_k=0, every_n_train_steps=1
        )
        return short_trainer(
            root, strategy(), max_steps=4, enable_checkpointing=True, callbacks=[last]
        )

    try:
        trainer().fit(module)
    except RuntimeError as e:
        assert str(e) == "boom", e
    before = len(module.losses)
    refit = trainer()
    refit.fit(module, ckpt_path="last")
    return {
        "losses": module.losses[before:],
        "params": params(module),
        "step": refit.global_step,
    }


def refit_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    from fusedzero.integrations.lightning import ZeroStrategy

    return {
        "ddp": fail_then_refit(
            f"{root}/ddp", lambda: L.strategies.DDPStrategy(process_group_backend="gloo")
        ),
        "s3": fail_then_refit(f"{root}/s3", lambda: ZeroStrategy(stage=3)),
    }


def test_fit_after_a_failed_stage_3_fit_resumes_from_last_as_ddp(tmp_path: Path) -> None:
    """After a stage-3 fit that raised (its optimizer abandoned: every param full-shaped again,
    without a collective), a new Trainer's `fit(ckpt_path="last")` on the same module in the
    same process resumes from the last checkpoint, as under strategy="ddp": the same losses
    after the resume and the same params at the end."""
    for rank, got in enumerate(run_ranks(refit_ranks, W, str(tmp_path), timeout=600)):
        ddp, s3 = got["ddp"], got["s3"]
        assert s3["step"] == ddp["step"] == 4, (s3["step"], ddp["step"])
        assert len(s3["losses"]) == len(ddp["losses"]) == 2, (s3["losses"], ddp["losses"])
        torch.testing.assert_close(
            torch.tensor(s3["losses"]),
            torch.tensor(ddp["losses"]),
            rtol=RTOL,
            atol=0,
            msg=lambda m, rank=rank: f"rank {rank} losses after the refit vs DDP's: {m}",
        )
        assert s3["params"].keys() == ddp["params"].keys()
        for k, want in ddp["params"].items():
            torch.testing.assert_close(
                s3["params"][k],
                want,
                rtol=RTOL,
                atol=ATOL,
                msg=lambda m, k=k, rank=rank: f"rank {rank} {k} after the refit vs DDP's: {m}",
            )


class Refused(Llama):
    """The module with one change, chosen by `what`: mostly something ZeroStrategy refuses."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what
        self.automatic_optimization = what != "manual"

    def configure_optimizers(self) -> Any:
        if self.what == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1)
        if self.what == "amsgrad":
            return torch.optim.AdamW(self.parameters(), amsgrad=True)
        if self.what.startswith("own"):  # the user's ZeroAdamW, clipping at 1.0 or not at all
            from fusedzero.optim import ZeroAdamW

            return ZeroAdamW(
                self.parameters(),
                stage=2,
                module=self,
                max_grad_norm=1.0 if self.what == "own" else None,
            )
        return torch.optim.AdamW(self.parameters())


class Fails(Llama):
    """Raises in its second training step, on every rank, before that step's forward."""

    calls_at_raise: dict[str, int] = {}

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if batch_idx == 1:
            self.calls_at_raise = dict(self.trainer.strategy.zero_optimizer.comm.calls)
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


def failed_fit(root: str) -> str:
    """A stage 3 fit that raised: what this rank's optimizer did after the error (nothing but
    abandon itself: see [Note: teardown after a failure]; close() gathered every unit)."""
    from fusedzero.integrations.lightning import ZeroStrategy

    strategy, module = ZeroStrategy(stage=3), Fails()
    try:
        short_trainer(root, strategy, max_steps=3).fit(module)
    except RuntimeError as e:
        assert str(e) == "boom", e
    opt = strategy.zero_optimizer
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in module.modules())
    at_raise = module.calls_at_raise
    after = {k: n - at_raise[k] for k, n in opt.comm.calls.items() if n != at_raise[k]}
    return f"collectives after the error {after}, closed {opt.closed}, hooks {hooks}"


def refusals(rank: int, world: int, root: str) -> dict[str, str]:
    from fusedzero.integrations.lightning import ZeroStrategy

    def error(what: str = "", **trainer_kw: Any) -> str:
        try:
            short_trainer(root, ZeroStrategy(stage=2), max_steps=1, **trainer_kw).fit(Refused(what))
        except (TypeError, ValueError) as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    def constructor(**kw: Any) -> str:
        try:
            ZeroStrategy(**kw)
        except TypeError as e:
            return f"TypeError: {e}"
        return "no error"

    return {
        "sgd": error("sgd"),
        "amsgrad": error("amsgrad"),
        "manual": error("manual"),
        "value": error(gradient_clip_val=1.0, gradient_clip_algorithm="value"),
        "precision": error(precision="bf16-mixed"),
        "lr": constructor(lr=1e-3),
        "own": error("own", gradient_clip_val=1.0),
        "own_clip": error("own_clip", gradient_clip_val=1.0),
        "ddp_kwarg": constructor(find_unused_parameters=True),
        "failed": failed_fit(root),  # last: it leaves its module's params to a checkpoint load
    }


def test_bad_combinations_are_one_line(tmp_path: Path) -> None:
    """Each refused in one line that names it and says what to do (the ranks of the test above
    are reused); a fit that raised leaves its optimizer abandoned, without a collective."""
    got = run_ranks(refusals, W, str(tmp_path))[0]
    want = {
        "sgd": "TypeError: ZeroStrategy turns a torch.optim.AdamW from configure_optimizers "
        "into ZeroAdamW; got torch.optim.sgd.SGD",
        "amsgrad": "ValueError: ZeroStrategy: AdamW(amsgrad=True)",
        "manual": "ValueError: ZeroStrategy needs automatic optimization",
        "value": "ValueError: ZeroStrategy clips by norm only",
        "precision": "ValueError: ZeroStrategy runs precision='32-true'",
        "own": "no error",  # the user's ZeroAdamW clipping as the Trainer says
        "own_clip": "ValueError: configure_optimizers returned a ZeroAdamW with "
        "max_grad_norm=None but Trainer(gradient_clip_val=1.0)",
        "lr": "TypeError: ZeroStrategy got lr=: it comes from configure_optimizers",
        "ddp_kwarg": "TypeError: ZeroStrategy got an unexpected keyword find_unused_parameters=",
        # no collective after the error (one would meet another rank's forward gathers)
        "failed": "collectives after the error {}, closed True, hooks 0",
    }
    for k, start in want.items():
        assert got[k].startswith(start) and "\n" not in got[k], (k, got[k])
