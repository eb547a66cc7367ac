"""`fusedzero train --optimizer muon`: ZeroMuon in the main job, and what it refuses up front."""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from fusedzero import ZeroMuon, muon_param_groups
from fusedzero.app.launch import run
from fusedzero.app.model import GPT, GPTConfig, gpt_muon_param_groups, gpt_param_groups

from _helpers import cli_error

TINY = [
    *("--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "32"),
    *("--batch-size", "8", "--steps", "4", "--warmup", "1", "--eval-seqs", "8"),
    *("--device", "cpu", "--no-progress", "--sample-tokens", "0"),
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "argparse.py"
    shutil.copy(Path(sysconfig.get_paths()["stdlib"]) / "argparse.py", path)
    return path


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--optimizer", "sgd"], "invalid choice: 'sgd'"),
        (["--optimizer", "muon", "--muon-lr", "0"], "--muon-lr must be in"),
        (["--optimizer", "muon", "--states", "int8"], "use --states fp32 or --states bf16"),
        (
            ["--optimizer", "muon", "--param-dtype", "bf16", "--master", "bf16-sr"],
            "use --master fp32",
        ),
        (["--optimizer", "muon", "--tp", "2"], "use --tp 1"),
    ],
)
def test_muon_refusals_are_one_line_naming_the_fix(
    capsys: pytest.CaptureFixture[str], argv: list[str], words: str
) -> None:
    """What ZeroMuon cannot run is refused before any rank starts, in one
    line that names the fix."""
    assert words in cli_error(capsys, ["train", "--device", "cpu", *argv])


def test_muon_groups_cover_every_param_once_and_keep_the_decay_split() -> None:
    """The hidden matrices go to Muon at --muon-lr; the rest to AdamW at --lr, the embedding
    decayed and 1-D params not, as `gpt_param_groups` splits them."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    groups = gpt_muon_param_groups(model, 0.1, muon_lr=0.02, lr=3e-3, betas=(0.9, 0.95))
    ids = [id(p) for g in groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters()) and len(set(ids)) == len(ids)
    muon = [g for g in groups if g["use_muon"]]
    assert len(muon) == 1 and muon[0]["lr"] == 0.02 and muon[0]["weight_decay"] == 0.1
    assert all(p.dim() == 2 for p in muon[0]["params"])
    assert id(model.wte.weight) not in {id(p) for p in muon[0]["params"]}
    adamw = [g for g in groups if not g["use_muon"]]
    assert [(g["lr"], g["betas"], g["weight_decay"]) for g in adamw] == [
        (3e-3, (0.9, 0.95), 0.1),
        (3e-3, (0.9, 0.95), 0.0),
    ]
    assert all(p.dim() >= 2 for p in adamw[0]["params"])
    assert all(p.dim() == 1 for p in adamw[1]["params"])
    decayed = {id(p) for p in gpt_param_groups(model, 0.1)[0]["params"]}
    assert decayed == {id(p) for p in muon[0]["params"] + adamw[0]["params"]}
    opt = ZeroMuon(groups, stage=0, module=model)
    assert [r.name for r in opt.group_rules] == ["muon", "adamw", "adamw"]
    opt.close()


@pytest.mark.slow
def test_muon_trains_at_one_rank_every_stage_and_two_ranks_stages_0_and_2(corpus: Path) -> None:
    """--optimizer muon trains (the loss falls) on one rank at stages 0-3, the same losses at
    every stage to fp32 rounding, and on two gloo ranks at stage 0 and at stage 2 (each matrix
    whole on its owner rank) to bf16 rounding; it differs from AdamW."""
    base = TINY + ["--data", str(corpus), "--optimizer", "muon"]
    one = {s: run(base + ["--nproc", "1", "--stage", str(s)]) for s in (0, 1, 2, 3)}
    loss = [x["loss"] for x in one[0]["steps"]]
    assert loss[-1] < loss[0]
    assert one[0]["val_loss"] < one[0]["val"][0]["val_loss"]
    for s in (1, 2, 3):
        assert [x["loss"] for x in one[s]["steps"]] == pytest.approx(loss, rel=1e-5), s
    for s in (0, 2):
        two = run(base + ["--nproc", "2", "--stage", str(s)])
        assert two["world_size"] == 2
        # bf16 Newton-Schulz turns the batch mean's other grouping into bf16-sized differences
        assert [x["loss"] for x in two["steps"]] == pytest.approx(loss, rel=1e-3), s
    adamw = run(TINY + ["--data", str(corpus), "--nproc", "1", "--stage", "0"])
    assert [x["loss"] for x in adamw["steps"]][1:] != loss[1:]
    # Plain DDP beside it holds torch's state: one fp32 momentum per Muon param, not two moments.
    model = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=1, n_head=2, n_embd=32))
    muon = sum(p.numel() for g in muon_param_groups(model) if g["use_muon"] for p in g["params"])
    psi = one[0]["params"]
    assert adamw["ddp_resident_bytes"]["optimizer"] == 8 * psi
    assert one[0]["ddp_resident_bytes"]["optimizer"] == 8 * psi - 4 * muon


@pytest.mark.slow
def test_muon_resume_after_stop_is_bitwise(corpus: Path, tmp_path: Path) -> None:
    """--optimizer muon with --ckpt-dir on 2 gloo ranks at stage 3 (the Muon params, grads
    and momentum in the owner layout, each matrix whole on one rank): the run finishes, and
    --stop-at 2 then --resume gives the uninterrupted run's steps (loss, grad norm, lr) and val
    loss bit for bit, Muon's momentum and AdamW's moments restored from the checkpoint."""
    base = TINY + ["--data", str(corpus), "--optimizer", "muon", "--nproc", "2", "--stage", "3"]
    whole = run(base)
    assert [x["step"] for x in whole["steps"]] == [1, 2, 3, 4]
    ckpt = tmp_path / "ckpt"
    stopped = run(base + ["--ckpt-dir", str(ckpt), "--stop-at", "2"])
    assert [x["step"] for x in stopped["steps"]] == [1, 2]
    resumed = run(base + ["--ckpt-dir", str(ckpt), "--resume"])
    assert resumed["steps"] == whole["steps"]
    assert resumed["val_loss"] == whole["val_loss"]
