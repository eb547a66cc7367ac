"""Checkpoints written before the checkpoint subpackage still load, once converted.

tests/checkpoint/fixtures/ckpt_v1 was written once by tests/checkpoint/fixtures/make_ckpt_v1.py with
the code of that time: 2 gloo ranks, stage 2, bf16 params + fp32 master, dynamic loss scale, two
param groups, caller state. Its `expected/` holds what the saving ranks had in memory. Here it is
loaded in this process (one rank, no process group) at stages 2 and 1 and compared exactly, param by
param.

Format version 3 binds each shard's header to the manifest; older checkpoints are refused by
every load with a message naming the converter, `fusedzero ckpt upgrade`, which checks them and
rewrites them as version 3 (the test loads the converted copy).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from fusedzero import Precision, Sharding, ZeroAdamW, checkpoint as ck
from fusedzero.app.ckpt_cli import main as ckpt_main

from _helpers import refused_then_upgraded

FIXTURE = Path(__file__).parent / "fixtures"
sys.path.insert(0, str(FIXTURE))
import make_ckpt_v1 as gen  # noqa: E402  (the fixture's model, groups and caller state)

KINDS = ("master", "exp_avg", "exp_avg_sq")


def _full_state(opt: ZeroAdamW) -> dict[str, torch.Tensor]:
    """Every param's master / moments, assembled through the typed interface (one rank holds
    all of them)."""
    names = {p.index: p for p in opt.param_infos()}
    st = opt.shard_state()
    out = {
        f"{p.name}.{k}": torch.full(p.shape, float("nan")) for p in names.values() for k in KINDS
    }
    for i, info in enumerate(opt.shard_infos()):
        for s in info.segments():
            p = names[s.param]
            for k, bufs in zip(KINDS, (st.master, st.exp_avg, st.exp_avg_sq)):
                assert bufs is not None
                out[f"{p.name}.{k}"].view(-1)[s.start : s.start + s.length] = bufs[i][
                    s.local : s.local + s.length
                ]
    return out


@pytest.mark.parametrize("stage", [2, 1])
def test_v1_checkpoint_loads(tmp_path: Path, stage: int) -> None:
    old = tmp_path / "old"
    shutil.copytree(FIXTURE / "ckpt_v1" / "root", old)
    want = safetensors.torch.load_file(FIXTURE / "ckpt_v1" / "expected" / "state.safetensors")
    values = json.loads((FIXTURE / "ckpt_v1" / "expected" / "values.json").read_text())

    model = gen.make_model()
    opt = ZeroAdamW(
        gen.param_groups(model, lr=0.5),
        stage=stage,
        module=model,
        precision=Precision(param_dtype=torch.bfloat16, loss_scale="dynamic"),
        sharding=Sharding(bucket_numel=64),
    )
    got = ck.load(opt, refused_then_upgraded(old, opt, 1, tmp_path / "root"))

    assert got.step == values["step"]
    assert got.caller_state["rank"] == 0 and got.caller_state["data_pos"] == 17
    assert got.caller_state["sched"] == values["caller_state"]["0"]["sched"]
    assert torch.equal(got.caller_state["t"], torch.arange(3))
    assert got.rng_restored
    assert float(opt.step_count.reshape(-1)[0]) == values["step_count"]
    st = opt.shard_state()
    assert st.scaler == {
        "scale": values["scaler"]["scale"],
        "growth_tracker": float(values["scaler"]["growth_tracker"]),
    }
    assert [g["lr"] for g in opt.param_groups] == [values["lr"]] * 2  # hyper-parameters too
    assert [g["weight_decay"] for g in opt.param_groups] == values["weight_decay"]

    have = _full_state(opt)
    assert sorted(have) == sorted(want)
    for k, w in want.items():
        assert torch.equal(have[k], w), f"{k}: max diff {(have[k] - w).abs().max()}"
    # The model's bf16 params are the cast of the loaded master.
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), want[f"{n}.master"].to(torch.bfloat16)), n


def test_upgrade_refuses_a_corrupt_old_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = tmp_path / "old"
    shutil.copytree(FIXTURE / "ckpt_v1" / "root", old)
    shard = old / "step-00000002" / "rank00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x40  # one bit of a moment: only the sha256 can tell
    shard.write_bytes(bytes(data))
    assert ckpt_main(["ckpt", "upgrade", str(old), str(tmp_path / "new")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fusedzero: error: checkpoint") and "\n" not in err, err
    assert "failed verification, so it is not converted" in err and "sha256 mismatch" in err
    assert not (tmp_path / "new" / "step-00000002").exists()
    assert not (tmp_path / "new" / ck.LATEST).exists()
