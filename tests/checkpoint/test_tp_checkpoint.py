"""Checkpoints of tensor-parallel optimizers (fusedzero/checkpoint/placements.py): saved at
(dp=2, tp=2), loaded at (dp=1, tp=2) bit-exactly (state and params, another stage), exported as
one file of full tensors that loads at (dp=4, tp=1) and (dp=2, tp=1); tensor_parallel.json is
validated, not trusted."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fusedzero.checkpoint.manifest import CheckpointError
from fusedzero.checkpoint.placements import full_of, local_of, parse

D, H, BATCH = 12, 20, 4
LR, WD, CLIP = 1e-2, 0.1, 0.05


def make() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, D), nn.LayerNorm(D))


def batch(step: int, rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(BATCH, D, generator=g), torch.randn(BATCH, D, generator=g)
    per = BATCH // dp
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def build(tp: int, dp: int, stage: int):
    from fusedzero.optim import ZeroAdamW
    m = make()
    group = None
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        group, rank = mesh["dp"].get_group(), mesh["dp"].get_local_rank()
    else:
        rank = dist.get_rank()
    opt = ZeroAdamW(m.parameters(), lr=LR, weight_decay=WD, stage=stage, module=m,
                    process_group=group, max_grad_norm=CLIP)
    return m, opt, rank


def train_step(m, opt, step: int, rank: int, dp: int) -> float:
    x, y = batch(step, rank, dp)
    loss = ((m(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def full(m, opt) -> dict[str, torch.Tensor]:
    with opt.gathered_params():
        return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p.detach()).clone()
                for n, p in m.named_parameters()}


def _save_side(rank: int, world: int, root: str, out: str) -> dict:
    from fusedzero import checkpoint
    m, opt, dp_rank = build(2, 2, stage=2)
    for step in range(2):
        train_step(m, opt, step, dp_rank, 2)
    checkpoint.save(opt, root, step=2)
    saved = full(m, opt)
    loss3 = train_step(m, opt, 2, dp_rank, 2)
    after = full(m, opt)
    opt.close()
    if rank == 0:
        checkpoint.export_tp(root, out)
    dist.barrier()
    # (dp=4, tp=1): the plain model, its weights from the consolidated file.
    m4, opt4, _ = build(1, 4, stage=1)
    checkpoint.import_weights(opt4, out)
    return {"saved": saved, "loss3": loss3, "after": after, "dp4": full(m4, opt4)}


def _load_side(rank: int, world: int, root: str, out: str) -> dict:
    from fusedzero import checkpoint
    m, opt, dp_rank = build(2, 1, stage=3)  # another dp size and stage
    checkpoint.load(opt, root)
    loaded = full(m, opt)
    loss3 = train_step(m, opt, 2, dp_rank, 1)
    after = full(m, opt)
    # Hostile: a placement edited in the record fails on every rank, before any collective.
    rec = Path(root) / "tensor_parallel.json"
    text = rec.read_text()
    dist.barrier()
    if rank == 0:
        d = json.loads(text)
        d["params"][0]["placement"] = "S(1)"
        rec.write_text(json.dumps(d))
    dist.barrier()
    try:
        checkpoint.load(opt, root)
        hostile = "no error"
    except CheckpointError as e:
        hostile = str(e)
    dist.barrier()
    if rank == 0:
        rec.write_text(text)
    opt.close()
    m2, opt2, _ = build(1, 2, stage=2)  # (dp=2, tp=1)
    checkpoint.import_weights(opt2, out)
    return {"loaded": loaded, "loss3": loss3, "after": after, "hostile": hostile,
            "dp2": full(m2, opt2)}


@pytest.mark.slow  # spawns 4 then 2 ranks
def test_tp_checkpoint_reshard_matrix(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from fusedzero.testing import run_ranks
    root, out = str(tmp_path / "ckpt"), str(tmp_path / "full.safetensors")
    a = run_ranks(_save_side, 4, root, out, timeout=600)
    assert sorted(p.name for p in Path(root).iterdir()) == ["tensor_parallel.json",
                                                            "tp0of2", "tp1of2"]
    saved = a[0]["saved"]
    exported = load_file(out)
    ref = make()  # the unparallelized model loads the consolidated file as it is
    ref.load_state_dict(exported)
    for n, t in saved.items():
        assert torch.equal(exported[n], t), f"export: {n}"
        for r in a:
            assert torch.equal(r["dp4"][n], t), f"(dp=4, tp=1) import: {n}"
    b = run_ranks(_load_side, 2, root, out, timeout=600)
    for r in b:
        for n, t in saved.items():
            assert torch.equal(r["loaded"][n], t), f"(dp=1, tp=2) load: {n}"
            assert torch.equal(r["dp2"][n], t), f"(dp=2, tp=1) import: {n}"
            # The next step from the loaded state (moments, step count): the uninterrupted
            # run's, up to the order of the dp sum (one rank here, two there): fp32 noise.
            assert torch.allclose(r["after"][n], a[0]["after"][n], rtol=1e-5, atol=1e-6), n
        # The global batch's loss: the mean of the two dp halves' (ranks 0 and 2: tp rank 0).
        assert r["loss3"] == pytest.approx((a[0]["loss3"] + a[2]["loss3"]) / 2, rel=1e-6)
        assert "was saved as" in r["hostile"] and "S(1)" in r["hostile"], r["hostile"]


def test_full_and_local_round_trip() -> None:
    g = torch.Generator().manual_seed(0)
    for shape, pl, size in [((7, 3), "S(0)", 2), ((4, 9), "S(1)", 4), ((12, 2), "SS(0,3)", 2),
                            ((5,), "R", 3), ((9, 4), "S(0)", 4)]:
        t = torch.randn(shape, generator=g)
        parts = [local_of(t, pl, r, size) for r in range(size)]
        assert torch.equal(full_of(parts, pl, list(shape)), t), (shape, pl)
    # The strided split holds [q_r; k_r; v_r]: rows 0-1, 4-5, 8-9 of 12 on rank 0 of 2.
    t = torch.arange(12.0).reshape(12, 1)
    assert local_of(t, "SS(0,3)", 0, 2).flatten().tolist() == [0, 1, 4, 5, 8, 9]


GOOD = {"format": "fusedzero-tensor-parallel", "version": 1, "tp": 2, "dp": 2,
        "params": [{"name": "0.weight", "shape": [20, 12], "placement": "S(0)"}]}


@pytest.mark.parametrize("edit,msg", [
    (lambda d: d.update(tp=0), "tp must be an integer"),
    (lambda d: d.update(tp=True), "tp must be an integer"),
    (lambda d: d.update(version=2), "version 2"),
    (lambda d: d.update(format="x"), "not a fusedzero-tensor-parallel record"),
    (lambda d: d["params"][0].update(placement="S(2)"), "names dim 2"),
    (lambda d: d["params"][0].update(placement="P"), "is not R, S(d) or SS(d,k)"),
    (lambda d: d["params"][0].update(placement="S(0) "), "is not R, S(d) or SS(d,k)"),
    (lambda d: d["params"][0].update(placement="SS(0,0)"), "split factor"),
    (lambda d: d["params"][0].update(shape=[-1, 2]), "is not a list of sizes"),
    (lambda d: d["params"][0].update(extra=1), "exactly name, shape, placement"),
    (lambda d: d["params"].append(dict(d["params"][0])), "is not a new non-empty name"),
])
def test_record_is_validated(edit, msg: str) -> None:
    d = json.loads(json.dumps(GOOD))
    parse(json.dumps(d), Path("x"))  # the good record parses
    edit(d)
    with pytest.raises(CheckpointError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        parse(json.dumps(d), Path("x"))
    with pytest.raises(CheckpointError, match="not JSON"):
        parse("[" * 100000, Path("x"))
