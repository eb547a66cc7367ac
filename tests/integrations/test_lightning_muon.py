"""ZeroStrategy with configure_optimizers returning [torch.optim.Muon, torch.optim.AdamW], each
with its lr scheduler, at one rank and at stage 3 on 2 gloo ranks (the owner layout): one
ZeroMuon in their place matches the same module stepping both torch optimizers itself under
strategy "ddp" at one rank (manual optimization: Lightning refuses two optimizers under
automatic optimization), loss by loss and param by param. Any other pair is
refused in one line naming what is supported, and so is a fit that would save checkpoints.
Skipped without the 'lightning' extra."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip(
    "lightning", reason="needs the 'lightning' extra: pip install 'fusedzero[lightning]'"
)
pytest.importorskip("transformers", reason="the tiny Llama: pip install 'fusedzero[hf]'")

import lightning.pytorch as L  # noqa: E402
from _tiny import LR, tiny_llama, tokens  # noqa: E402

from fusedzero import ZeroMuon, muon_param_groups  # noqa: E402
from fusedzero.integrations.lightning import ZeroStrategy  # noqa: E402
from fusedzero.testing import run_ranks  # noqa: E402

BATCH, STEPS, CLIP = 8, 3, 0.5


@pytest.fixture(autouse=True)
def _no_process_group_left() -> Any:
    """Lightning's DDP strategies start a one-rank gloo process group in this process and leave
    it after fit; later tests in the process start their own."""
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


class MuonLlama(L.LightningModule):
    """Muon on the hidden matrices, AdamW on the rest, two optimizers, a scheduler each."""

    def __init__(
        self, base: torch.nn.Module, optimizers: str = "muon+adamw", batch: int = BATCH
    ) -> None:
        super().__init__()
        self.net = copy.deepcopy(base)
        self.which = optimizers
        self.batch = batch  # per rank
        self.losses: list[float] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.net(input_ids=batch, labels=batch).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        muon, adamw = muon_param_groups(self.net)
        first: torch.optim.Optimizer
        if self.which == "zero_muon":
            return ZeroMuon(muon_param_groups(self.net), stage=1, module=self)
        if self.which == "muon+adamw":
            first = torch.optim.Muon(muon["params"], lr=0.02, weight_decay=0.1)
        else:
            first = torch.optim.AdamW(muon["params"], lr=LR)
        second = torch.optim.AdamW(adamw["params"], lr=LR, weight_decay=0.1)
        return [
            {
                "optimizer": o,
                "lr_scheduler": {
                    "scheduler": torch.optim.lr_scheduler.LinearLR(o, 1.0, f, total_iters=STEPS),
                    "interval": "step",
                },
            }
            for o, f in ((first, 0.25), (second, 0.5))
        ]

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(tokens(BATCH * STEPS), batch_size=self.batch)


class Manual(MuonLlama):
    """The reference: the same optimizers and schedulers stepped by hand, clipping the global
    norm over both; `halves`: each loss as the mean of two half-batch losses (the noise
    control: the same math in another summation order)."""

    def __init__(self, base: torch.nn.Module, halves: bool) -> None:
        super().__init__(base)
        self.automatic_optimization = False
        self.halves = halves

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        if self.halves:
            h = BATCH // 2
            a, b = batch[:h], batch[h:]
            loss = (self.net(input_ids=a, labels=a).loss + self.net(input_ids=b, labels=b).loss) / 2
        else:
            loss = self.net(input_ids=batch, labels=batch).loss
        self.losses.append(loss.item())
        self.manual_backward(loss)
        torch.nn.utils.clip_grad_norm_(self.parameters(), CLIP)
        for o in self.optimizers():
            o.step()
            o.zero_grad()
        for s in self.lr_schedulers():
            s.step()


def fit(
    module: L.LightningModule, root: Path, strategy: Any = "auto", devices: int = 1, **kw: Any
) -> None:
    L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_epochs=1,
        limit_train_batches=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        **kw,
    ).fit(module)


def params(module: L.LightningModule) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def manual_reference(
    base: torch.nn.Module, root: Path
) -> tuple[Manual, dict[str, torch.Tensor], float]:
    """The manual reference at one rank, its params, and its noise control: the largest param
    difference to the same loop with each loss over two half batches (Newton-Schulz rounds its
    input to bf16, so an fp32 ulp of summation order can move an update by a bf16 ulp: bitwise
    is out of reach, as in tests/zero/test_zero_muon.py)."""
    ref, noisy = Manual(base, halves=False), Manual(base, halves=True)
    fit(ref, root / "ref", "ddp")  # its sampler: the DistributedSampler's order, as ours
    fit(noisy, root / "noisy", "ddp")
    want = params(ref)
    noise = max((p - want[n]).abs().max().item() for n, p in params(noisy).items())
    assert 0.0 < noise < 2e-3, noise  # well below an lr-sized step, or it would hide a bug
    return ref, want, noise


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_muon_and_adamw_become_one_zero_muon(tmp_path: Path, stage: int) -> None:
    """Three steps with clipping and a scheduler per optimizer (different end factors, so a
    scheduler driving the wrong groups shows): the params match the manual reference within 2x
    its noise control, the losses within 1e-4 relative, and each group ends at its own
    scheduler's lr."""
    base = tiny_llama()
    ref, want, noise = manual_reference(base, tmp_path)
    got = MuonLlama(base)
    strategy = ZeroStrategy(stage=stage)
    fit(got, tmp_path / "zero", strategy, gradient_clip_val=CLIP)
    opt = strategy.zero_optimizer
    assert [g["use_muon"] for g in opt.param_groups] == [True, False]
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.02 * 0.25, LR * 0.5])
    for n, p in params(got).items():
        d = (p - want[n]).abs().max().item()
        assert d <= 2 * noise, f"{n}: max diff {d} > 2x the noise control {noise}"
    torch.testing.assert_close(got.losses, ref.losses, rtol=1e-4, atol=0)


def stage_3_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    """The Muon + AdamW module under ZeroStrategy(stage=3) on these ranks, BATCH // world
    sequences each (the DistributedSampler interleaves them: together one reference batch):
    its params after fit (gathered whole), its losses, and how many Muon matrices it owned."""
    got = MuonLlama(tiny_llama(), batch=BATCH // world)
    strategy = ZeroStrategy(stage=3)
    owned = []

    class Owned(L.Callback):
        def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            opt = strategy.zero_optimizer
            owned.append(
                sum(
                    len(buf.local_shard().whole_tensors())
                    for buf in opt.flat_groups
                    if opt.group_rules[buf.group_index].name == "muon"
                )
            )

    fit(got, Path(root), strategy, devices=world, gradient_clip_val=CLIP, callbacks=[Owned()])
    return {"params": params(got), "losses": got.losses, "owned": owned[0]}


@pytest.mark.slow  # spawns ranks
def test_muon_and_adamw_at_stage_3_on_two_ranks(tmp_path: Path) -> None:
    """Stage 3 on 2 gloo ranks, each matrix whole on its owner rank: after fit the params on
    every rank match the one-rank manual reference within 2x its noise control, the ranks'
    mean loss each step matches its loss within 1e-4 relative, and both ranks owned Muon
    matrices."""
    ref, want, noise = manual_reference(tiny_llama(), tmp_path)
    ranks = run_ranks(stage_3_ranks, 2, str(tmp_path / "zero"), timeout=600)
    for r, got in enumerate(ranks):
        assert got["owned"] > 0, f"rank {r} owned no Muon matrix"
        for n, p in got["params"].items():
            d = (p - want[n]).abs().max().item()
            assert d <= 2 * noise, f"rank {r}, {n}: max diff {d} > 2x the noise control {noise}"
    mean = [sum(ls) / len(ls) for ls in zip(*(g["losses"] for g in ranks), strict=True)]
    torch.testing.assert_close(mean, ref.losses, rtol=1e-4, atol=0)


def test_other_pairs_are_refused_and_a_muon_fit_checkpoints(tmp_path: Path) -> None:
    """Two AdamWs (Lightning's own refusal is about manual optimization) name what is
    supported; a Muon + AdamW fit with Lightning's ModelCheckpoint saves its checkpoint."""
    base = tiny_llama()
    with pytest.raises(
        TypeError,
        match=r"^ZeroStrategy got 2 optimizers from configure_optimizers \(AdamW, AdamW\): "
        r"return a torch.optim.AdamW, a torch.optim.Muon with a torch.optim.AdamW",
    ):
        fit(MuonLlama(base, "adamw+adamw"), tmp_path, ZeroStrategy(stage=1))
    trainer = L.Trainer(
        strategy=ZeroStrategy(stage=1),
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(MuonLlama(base))  # with Lightning's ModelCheckpoint: ZeroMuon's state saves
    assert list(tmp_path.rglob("*.ckpt")), "no checkpoint written"
