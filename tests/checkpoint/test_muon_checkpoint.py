"""Checkpoints of a ZeroMuon: Muon groups keep `momentum_buffer`, AdamW groups `exp_avg` and
`exp_avg_sq`, each buffer its own group's rule's fields, saved per param through the segment
tables (as AdamW's moments are), so they load at another stage, bucket size or world size.

The manifest names each param group's rule (`group_rules`); a checkpoint of one rule loaded into
an optimizer that runs another on some param (another optimizer, or a group whose rule changed)
is refused in one line before anything is written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from fusedzero import Precision, Sharding, ZeroAdamW, ZeroMuon, checkpoint as ck, muon_param_groups
from fusedzero.app.ckpt_cli import main as cli_main
from fusedzero.app.model import GPTConfig
from fusedzero.checkpoint import CheckpointError
from fusedzero.testing import run_ranks

from _helpers import gpt_batch, make_gpt

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
BATCH = 4
MUON_HP = dict(lr=0.02, weight_decay=0.1, momentum=0.95)
ADAMW_HP = dict(lr=1e-3, weight_decay=0.01)
KINDS = ("master", "momentum_buffer", "exp_avg", "exp_avg_sq")
# Small buckets: params straddle buckets, so the layouts of the two bucket sizes differ.
SMALL_BUCKET = 2048


def _opt(
    model: nn.Module,
    stage: int,
    bucket: int | None = None,
    precision: Precision | None = None,
    **groups: Any,
) -> ZeroMuon:
    return ZeroMuon(
        muon_param_groups(model, muon=MUON_HP, adamw=ADAMW_HP, **groups),
        stage=stage,
        module=model,
        sharding=Sharding(bucket_numel=bucket),
        precision=precision or Precision(),
    )


def _train(model: nn.Module, opt: ZeroMuon, steps: range, rank: int = 0, world: int = 1) -> None:
    h = BATCH // world
    for step in steps:
        x, y = gpt_batch(CFG, BATCH, step)
        model(x[rank * h : (rank + 1) * h], y[rank * h : (rank + 1) * h])[1].backward()
        opt.step()


def per_param(opt: ZeroMuon) -> dict[str, dict[str, torch.Tensor]]:
    """Each param's full flattened master and rule state by name, from this rank's shards (the
    whole model at one rank, or at stage 0): what must not depend on the layout."""
    st = opt.shard_state()
    numel = {p.index: (p.name, torch.Size(p.shape).numel()) for p in opt.param_infos()}
    out: dict[str, dict[str, torch.Tensor]] = {}
    for i, info in enumerate(opt.shard_infos()):
        tensors = st.tensors(i)
        for s in info.segments():
            name, n = numel[s.param]
            d = out.setdefault(name, {})
            for kind, t in tensors.items():
                full = d.setdefault(kind, torch.full((n,), float("nan"), dtype=t.dtype))
                full[s.start : s.start + s.length] = t[s.local : s.local + s.length].cpu()
    return out


def assert_equal(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for n in want:
        assert got[n].keys() == want[n].keys(), f"{what}: {n}"
        for k in want[n]:
            a, b = got[n][k], want[n][k]
            if not torch.equal(a, b):
                i = int((a != b).nonzero()[0])
                raise AssertionError(f"{what}: {n}.{k} differs at {i}: {a[i]} vs {b[i]}")


def _saved(tmp_path: Path, stage: int = 1, steps: int = 3) -> tuple[Path, dict]:
    model = make_gpt(CFG)
    opt = _opt(model, stage)
    _train(model, opt, range(steps))
    ck.save(opt, tmp_path / "ck", step=steps)
    state = per_param(opt)
    opt.close()
    return tmp_path / "ck" / f"step-{steps:08d}", state


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_resume_is_bitwise_at_one_rank(tmp_path: Path, stage: int) -> None:
    """Train 3 steps, save, train 2 more; a fresh ZeroMuon (other init) that loads the
    checkpoint and trains the same 2 steps ends with bit-identical params, momentum buffers and
    AdamW moments, and the same step count."""
    model = make_gpt(CFG)
    opt = _opt(model, stage, SMALL_BUCKET)
    _train(model, opt, range(3))
    ck.save(opt, tmp_path, step=3)
    _train(model, opt, range(3, 5))
    want = per_param(opt)
    assert {k for d in want.values() for k in d} == set(KINDS)

    twin = make_gpt(CFG, seed=1)
    opt2 = _opt(twin, stage, SMALL_BUCKET)
    got = ck.load(opt2, tmp_path)
    assert got.step == 3 and float(opt2.step_count) == 3
    _train(twin, opt2, range(3, 5))
    assert_equal(per_param(opt2), want, f"stage {stage} resumed")
    opt.close()
    opt2.close()


def test_a_stage3_checkpoint_loads_at_stage1_with_equal_values(tmp_path: Path) -> None:
    """Saved at stage 3 (default buckets), loaded at stage 1 with small buckets (params cut
    across buckets): every param's master, momentum and moments equal the saved ones, and each
    buffer holds its own group's rule's fields only."""
    d, saved = _saved(tmp_path, stage=3)
    m = json.loads((d / "manifest.json").read_text())
    assert m["group_rules"] == ["muon", "adamw"] and m["rule"] == "by-group"
    model = make_gpt(CFG, seed=1)
    opt = _opt(model, 1, SMALL_BUCKET)
    ck.load(opt, d)
    assert_equal(per_param(opt), saved, "stage 3 -> stage 1")
    st = opt.shard_state()
    for i, info in enumerate(opt.shard_infos()):
        fields = set(st.tensors(i))
        muon = opt.group_rules[info.group_index].name == "muon"
        assert fields == ({"master", "momentum_buffer"} if muon else {"master", *KINDS[2:]})
    opt.close()


def test_bf16_momentum_loads_into_fp32_state_and_back(tmp_path: Path) -> None:
    """Momentum saved in bf16 (`Precision(states="bf16")`) loads into an fp32-state ZeroMuon as
    the same values, and saved from there loads back into bf16 bit for bit."""
    model = make_gpt(CFG)
    half = _opt(model, 1, precision=Precision(states="bf16"))
    _train(model, half, range(2))
    ck.save(half, tmp_path / "half", step=2)
    saved = per_param(half)
    half.close()
    assert saved["blocks.0.attn.qkv.weight"]["momentum_buffer"].dtype == torch.bfloat16
    full = _opt(make_gpt(CFG, seed=1), 3)
    ck.load(full, tmp_path / "half")
    up = {n: {k: t.float() for k, t in d.items()} for n, d in saved.items()}
    assert_equal(per_param(full), up, "bf16 -> fp32")
    ck.save(full, tmp_path / "full", step=2)
    full.close()
    back = _opt(make_gpt(CFG, seed=2), 0, precision=Precision(states="bf16"))
    ck.load(back, tmp_path / "full")
    assert_equal(per_param(back), saved, "fp32 -> bf16")
    back.close()


def test_a_checkpoint_of_other_rules_is_refused_in_one_line(tmp_path: Path) -> None:
    """A ZeroMuon checkpoint into a ZeroAdamW, a ZeroAdamW checkpoint into a ZeroMuon, and a
    ZeroMuon checkpoint into one whose groups moved a matrix from Muon to AdamW are each
    refused in one line naming the rules (and the param), leaving the optimizer untouched."""
    d, _ = _saved(tmp_path)

    def refused(opt: Any, src: Path, match: str) -> None:
        before = per_param(opt)
        with pytest.raises(CheckpointError, match=match) as e:
            ck.load(opt, src)
        assert "\n" not in str(e.value), str(e.value)
        assert_equal(per_param(opt), before, "after a refused load")
        opt.close()

    model = make_gpt(CFG)
    refused(
        ZeroAdamW(model.parameters(), stage=1, module=model),
        d,
        "holds muon state for blocks.0.attn.qkv.weight, which this optimizer updates with adamw",
    )
    model = make_gpt(CFG)
    adam = ZeroAdamW(model.parameters(), stage=1, module=model)
    _train(model, adam, range(1))
    ck.save(adam, tmp_path / "adam", step=1)
    adam.close()
    assert json.loads((tmp_path / "adam/step-00000001/manifest.json").read_text())["rule"] == (
        "adamw"
    )
    refused(_opt(make_gpt(CFG), 1), tmp_path / "adam", "holds adamw state for blocks.0")
    moved = _opt(make_gpt(CFG), 1, use_muon={"blocks.1.mlp.fc.weight": False})
    refused(
        moved,
        d,
        "holds muon state for blocks.1.mlp.fc.weight, which this optimizer updates with adamw",
    )


def test_a_manifest_with_its_group_rules_edited_is_refused(tmp_path: Path) -> None:
    """The rules are bound to the shard headers: a manifest whose `group_rules` were swapped
    (or dropped) fails verification before any tensor is read."""
    d, _ = _saved(tmp_path)
    path = d / "manifest.json"
    m = json.loads(path.read_text())
    for edit in (["adamw", "muon"], None):
        e = dict(m)
        if edit is None:
            del e["group_rules"]
        else:
            e["group_rules"] = edit
        path.write_text(json.dumps(e))
        with pytest.raises(CheckpointError, match="group_rules|tensors"):
            ck.verify(d)
    path.write_text(json.dumps(dict(m, group_rules=["muon"])))
    with pytest.raises(CheckpointError, match="group_rules has 1 entries for 2 param groups"):
        ck.verify(d)


def test_ckpt_export_writes_the_model_weights(tmp_path: Path) -> None:
    """`fusedzero ckpt export` of a ZeroMuon checkpoint writes every param (the tied head under
    its own name too) as trained, loadable by `model.load_state_dict`."""
    model = make_gpt(CFG)
    opt = _opt(model, 2)
    _train(model, opt, range(2))
    ck.save(opt, tmp_path / "ck", step=2)
    with opt.gathered_params():
        want = {n: p.detach().clone() for n, p in model.state_dict().items()}
    opt.close()
    out = tmp_path / "m.safetensors"
    assert cli_main(["ckpt", "export", str(tmp_path / "ck"), str(out)]) == 0
    got = load_file(str(out))
    fresh = make_gpt(CFG, seed=1)
    fresh.load_state_dict(got, strict=False)
    for n, p in fresh.named_parameters():
        assert torch.equal(p, want[n]), n


def _w2_save(rank: int, world: int, root: str) -> dict[str, Any]:
    model = make_gpt(CFG)
    opt = _opt(model, 0, SMALL_BUCKET)
    _train(model, opt, range(3), rank, world)
    ck.save(opt, root, step=3)
    out = {"state": per_param(opt)}
    opt.close()
    return out


@pytest.mark.slow
def test_saved_at_two_ranks_stage0_loads_at_one_rank_and_continues(tmp_path: Path) -> None:
    """Saved at W=2 (gloo, stage 0: rank 0 writes), loaded at W=1 at stage 0 and at stage 3
    with other buckets (every owner and offset differs): each param's master, momentum and
    moments equal what both ranks held, and the two continue bit-identically."""
    outs = run_ranks(_w2_save, 2, str(tmp_path))
    assert_equal(outs[1]["state"], outs[0]["state"], "ranks")
    runs = []
    for stage, bucket in ((0, SMALL_BUCKET), (3, None)):
        model = make_gpt(CFG, seed=1)
        opt = _opt(model, stage, bucket)
        ck.load(opt, tmp_path)
        assert_equal(per_param(opt), outs[0]["state"], f"W=2 -> W=1 stage {stage}")
        _train(model, opt, range(3, 5))
        runs.append(per_param(opt))
        opt.close()
    assert_equal(runs[1], runs[0], "continued at stage 3 vs stage 0")
