"""Checkpoints of tensor-parallel optimizers (fusedzero/checkpoint/_placements.py,
_tp_reshard.py): saved at (dp=2, tp=2), loaded at (dp=1, tp=2), (dp=4, tp=1) and (dp=2, tp=1)
with the optimizer state bit-exact (another stage each), exported as one file of full tensors;
tensor_parallel.json is validated, not trusted.

About an internal: fusedzero.checkpoint._placements."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fusedzero.checkpoint import CheckpointError
from fusedzero.checkpoint._placements import full_of, local_of, parse, write_binding

D, H, BATCH = 12, 20, 4
LR, WD, CLIP = 1e-2, 0.1, 0.05


def make() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, D), nn.LayerNorm(D))


def batch(step: int, rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(BATCH, D, generator=g), torch.randn(BATCH, D, generator=g)
    per = BATCH // dp
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def build(tp: int, dp: int, stage: int):
    from fusedzero import Groups, ZeroAdamW

    m = make()
    group = None
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        group, rank = mesh["dp"].get_group(), mesh["dp"].get_local_rank()
    else:
        rank = dist.get_rank()
    opt = ZeroAdamW(
        m.parameters(),
        lr=LR,
        weight_decay=WD,
        stage=stage,
        module=m,
        max_grad_norm=CLIP,
        groups=Groups(shard=group),
    )
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
        return {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p.detach()).clone()
            for n, p in m.named_parameters()
        }


KINDS = ("master", "exp_avg", "exp_avg_sq")


def state_pieces(opt) -> dict:
    """This rank's optimizer state as pieces of each param's local tensor, with the param's
    local shape and placement: `assemble` in the test process makes full tensors of them."""
    from fusedzero.checkpoint._placements import describe

    st = opt.shard_state()
    infos = {i.index: i for i in opt.param_infos()}
    pl = {p["name"]: p["placement"] for p in describe(opt)["params"]} if opt.tp else {}
    pieces: dict = {}
    for b, info in enumerate(opt.shard_infos()):
        for s in info.segments():
            name = infos[s.param].name
            for kind in KINDS:
                pieces.setdefault((name, kind), {})[s.start] = getattr(st, kind)[b][
                    s.local : s.local + s.length
                ].clone()
    return {
        "pieces": pieces,
        "step": st.step_count,
        "tp_rank": opt.tp.rank if opt.tp else 0,
        "shapes": {i.name: i.shape for i in infos.values()},
        "placements": {i.name: pl.get(i.name, "R") for i in infos.values()},
    }


def assemble(reports: list[dict]) -> dict[tuple[str, str], torch.Tensor]:
    """(name, kind) -> the full tensor, from every rank's `state_pieces`: the dp pieces of each
    tp rank joined in order, then the tp ranks' local tensors joined by the placement."""
    by_tp: dict[int, dict] = {}
    for r in reports:
        mine = by_tp.setdefault(r["tp_rank"], {})
        for key, parts in r["pieces"].items():
            mine.setdefault(key, {}).update(parts)
    r0 = reports[0]
    out = {}
    for key in by_tp[0]:
        name = key[0]
        locals_ = [
            torch.cat([t for _, t in sorted(by_tp[t][key].items())]).view(
                [r for r in reports if r["tp_rank"] == t][0]["shapes"][name]
            )
            for t in sorted(by_tp)
        ]
        out[key] = _join(locals_, r0["placements"][name])
    return out


def _join(locals_: list[torch.Tensor], pl: str) -> torch.Tensor:
    """Shard(d): concatenated along d in tp-rank order; Replicate: tp rank 0's (the others must
    hold the same values). The test model has no _StridedShard param."""
    if pl == "R":
        for t in locals_[1:]:
            assert torch.equal(t, locals_[0]), "a Replicate param's state differs over tp"
        return locals_[0]
    assert pl in ("S(0)", "S(1)"), pl
    return torch.cat(locals_, int(pl[2]))


def reference(steps: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The uninterrupted single-process run: torch.optim.AdamW + clip_grad_norm_ on the global
    batches; its params after `steps` steps and its losses."""
    m = make()
    opt = torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for step in range(steps):
        x, y = batch(step, 0, 1)
        loss = ((m(x) - y) ** 2).mean()
        loss.backward()
        losses.append(float(loss.detach()))
        torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in m.named_parameters()}, losses


def _resume(tp: int, dp: int, stage: int, root: str) -> dict:
    """Load `root` at (dp, tp), report the state and params right after, train 2 more steps."""
    from fusedzero import checkpoint

    m, opt, dp_rank = build(tp, dp, stage)
    checkpoint.load(opt, root)
    out = {"state": state_pieces(opt), "loaded": full(m, opt)}
    out["losses"] = [train_step(m, opt, step, dp_rank, dp) for step in (2, 3)]
    out["after"] = full(m, opt)
    opt.close()
    return out


def _save_side(rank: int, world: int, root: str, out: str) -> dict:
    from fusedzero import checkpoint

    m, opt, dp_rank = build(2, 2, stage=2)
    for step in range(2):
        train_step(m, opt, step, dp_rank, 2)
    checkpoint.save(opt, root, step=2)
    saved, state = full(m, opt), state_pieces(opt)
    opt.close()
    if rank == 0:
        checkpoint.export_tp(root, out)
    dist.barrier()
    # (dp=4, tp=1): the plain model, its weights from the consolidated file ...
    m4, opt4, _ = build(1, 4, stage=1)
    checkpoint.import_weights(opt4, out)
    dp4 = full(m4, opt4)
    opt4.close()
    # ... and its whole optimizer state from the tp checkpoint root.
    return {"saved": saved, "state": state, "dp4": dp4, "r41": _resume(1, 4, 1, root)}


def _load_side(rank: int, world: int, root: str, out: str) -> dict:
    from fusedzero import checkpoint

    r12 = _resume(2, 1, 3, root)  # (dp=1, tp=2): another dp size and stage
    r21 = _resume(1, 2, 0, root)  # (dp=2, tp=1): the plain model, stage 0
    m, opt, _ = build(2, 1, stage=3)
    # Hostile: an edited placement fails on every rank, before any collective, at the same tp
    # size (against the live model) and across tp sizes (against the folders' bindings).
    rec = Path(root) / "tensor_parallel.json"
    text = rec.read_text()
    dist.barrier()
    if rank == 0:
        d = json.loads(text)
        d["params"][0]["placement"] = "S(1)"
        rec.write_text(json.dumps(d))
    dist.barrier()
    hostile = []
    m1, opt1, _ = build(1, 2, stage=1)
    for o in (opt, opt1):
        try:
            checkpoint.load(o, root)
            hostile.append("no error")
        except (CheckpointError, ValueError) as e:
            hostile.append(str(e))
    dist.barrier()
    if rank == 0:
        rec.write_text(text)
    dist.barrier()  # the restored record, whole, before any rank reads it (write_text truncates)
    # A plain optimizer's save into the tp root is refused (its load would read the tp folders).
    try:
        checkpoint.save(opt1, root, step=9)
        hostile.append("no error")
    except CheckpointError as e:
        hostile.append(str(e))
    # The step folders of the two tp folders swapped: every local shape is the same on both
    # tp ranks and the folders' bindings are intact; only the manifests' tp field tells.
    steps = [
        next(p for p in (Path(root) / f"tp{t}of2").iterdir() if p.name.startswith("step"))
        for t in (0, 1)
    ]
    dist.barrier()

    def swap() -> None:
        if rank == 0:
            steps[0].rename(steps[0].with_name("x"))
            steps[1].rename(steps[0])
            steps[0].with_name("x").rename(steps[1])
        dist.barrier()

    swap()
    try:
        checkpoint.load(opt, root)
        hostile.append("no error")
    except CheckpointError as e:
        hostile.append(str(e))
    swap()
    opt.close()
    opt1.close()
    m2, opt2, _ = build(1, 2, stage=2)  # (dp=2, tp=1)
    checkpoint.import_weights(opt2, out)
    return {"r12": r12, "r21": r21, "hostile": hostile, "dp2": full(m2, opt2)}


@pytest.mark.slow  # spawns 4 then 2 ranks
def test_tp_checkpoint_reshard_matrix(tmp_path: Path) -> None:
    """Saved at (dp=2, tp=2) after 2 steps; loaded at (1, 2), (4, 1) and (2, 1) (the plain
    model): master, exp_avg, exp_avg_sq and the step count bit-exact right after the load, and
    2 more steps within fp32 noise of the uninterrupted torch.optim.AdamW run."""
    from safetensors.torch import load_file

    from fusedzero.testing import run_ranks

    root, out = str(tmp_path / "ckpt"), str(tmp_path / "full.safetensors")
    a = run_ranks(_save_side, 4, root, out, timeout=600)
    assert sorted(p.name for p in Path(root).iterdir()) == [
        "tensor_parallel.json",
        "tp0of2",
        "tp1of2",
    ]
    saved = a[0]["saved"]
    saved_state = assemble([r["state"] for r in a])
    exported = load_file(out)
    ref = make()  # the unparallelized model loads the consolidated file as it is
    ref.load_state_dict(exported)
    for n, t in saved.items():
        assert torch.equal(exported[n], t), f"export: {n}"
        assert torch.equal(saved_state[(n, "master")], t), f"saved master: {n}"
        for r in a:
            assert torch.equal(r["dp4"][n], t), f"(dp=4, tp=1) import: {n}"
    assert saved_state[("0.weight", "exp_avg")].abs().sum() > 0  # moments are not zero
    b = run_ranks(_load_side, 2, root, out, timeout=600)
    after, ref_losses = reference(4)
    layouts = {
        "(dp=4, tp=1)": [r["r41"] for r in a],
        "(dp=1, tp=2)": [r["r12"] for r in b],
        "(dp=2, tp=1)": [r["r21"] for r in b],
    }
    for where, rs in layouts.items():
        state = assemble([r["state"] for r in rs])
        assert set(state) == set(saved_state), where
        for key, t in saved_state.items():
            assert torch.equal(state[key], t), f"{where}: {key} differs from the saved state"
        for r in rs:
            assert r["state"]["step"] == 2, where
            for n, t in saved.items():
                assert torch.equal(r["loaded"][n], t), f"{where} load: {n}"
                # Two more steps: the uninterrupted run's up to the order of the sums.
                torch.testing.assert_close(
                    r["after"][n],
                    after[n],
                    rtol=1e-5,
                    atol=1e-6,
                    msg=lambda m, n=n, where=where: f"{where} {n}: {m}",
                )
        # The global batch's loss: the mean over the dp shards (tp ranks report the same).
        for i, step in enumerate((2, 3)):
            mean = sum(r["losses"][i] for r in rs) / len(rs)
            assert mean == pytest.approx(ref_losses[step], rel=1e-5), (where, step)
    for r in b:
        for n, t in saved.items():
            assert torch.equal(r["dp2"][n], t), f"(dp=2, tp=1) import: {n}"
        same, across, plain_save, moved = r["hostile"]
        assert "was saved as" in same and "S(1)" in same, same
        assert "tp0of2/tp_binding.json: does not match tensor_parallel.json" in across, across
        assert "saves into another root" in plain_save, plain_save
        assert "a step folder moved between tp folders" in moved, moved
    assert sorted(p.name for p in Path(root).iterdir()) == [
        "tensor_parallel.json",
        "tp0of2",
        "tp1of2",
    ]


def _gpt(tp: int):
    from fusedzero import Groups, ZeroAdamW
    from fusedzero.app import tp_plan
    from fusedzero.app.model import GPT, GPTConfig

    torch.manual_seed(0)
    m = GPT(GPTConfig(n_layer=1, n_embd=16, n_head=2, block_size=8))
    mesh = tp_plan.parallelize(m, tp, torch.device("cpu"))
    opt = ZeroAdamW(
        m.parameters(),
        lr=LR,
        weight_decay=WD,
        stage=1,
        module=m,
        max_grad_norm=CLIP,
        groups=Groups(shard=mesh.dp_group),
    )
    return m, opt, mesh


def _gpt_step(m, opt, mesh, step: int) -> None:
    idx = torch.randint(0, 256, (4, 9), generator=torch.Generator().manual_seed(step))
    per = 4 // mesh.dp_size
    x = idx[mesh.dp_rank * per : (mesh.dp_rank + 1) * per]
    m(x[:, :-1], x[:, 1:])[1].backward()
    opt.step()
    opt.zero_grad()


def _gpt_side(rank: int, world: int, root: str) -> dict:
    from fusedzero import checkpoint

    m, opt, mesh = _gpt(2)
    for step in range(2):
        _gpt_step(m, opt, mesh, step)
    checkpoint.save(opt, root, step=2)
    saved = full(m, opt)
    _gpt_step(m, opt, mesh, 2)
    after = full(m, opt)
    opt.close()
    m1, opt1, mesh1 = _gpt(1)  # (dp=4, tp=1): the plain GPT
    checkpoint.load(opt1, root)
    loaded, steps = full(m1, opt1), opt1.shard_state().step_count
    _gpt_step(m1, opt1, mesh1, 2)
    return {
        "saved": saved,
        "after": after,
        "loaded": loaded,
        "steps": steps,
        "after1": full(m1, opt1),
    }


@pytest.mark.slow  # spawns 4 ranks
def test_gpt_strided_qkv_reshards_to_tp1(tmp_path: Path) -> None:
    """The GPT plan's fused q/k/v (_StridedShard) saved at (dp=2, tp=2) loads into the plain
    GPT at (dp=4, tp=1): params bit-exact (torch's full_tensor() of the saved run), and the next
    step (moments, step count) within fp32 noise of the uninterrupted tp run's."""
    from fusedzero.testing import run_ranks

    root = tmp_path / "ckpt"
    a = run_ranks(_gpt_side, 4, str(root), timeout=600)
    assert '"SS(0,3)"' in (root / "tensor_parallel.json").read_text()
    for r in a:
        assert r["steps"] == 2
        for n, t in a[0]["saved"].items():
            assert torch.equal(r["loaded"][n], t), n
            torch.testing.assert_close(r["after1"][n], a[0]["after"][n], rtol=1e-5, atol=1e-6)


def _one_folder_root(root: Path, states: str):
    """A tensor-parallel root of one tp rank written offline (one process): a plain optimizer
    stepped once and saved into `tp0of1`, with the record (and binding) of a tp=1 mesh."""
    from fusedzero import Precision, ZeroAdamW, checkpoint

    m = make()
    opt = ZeroAdamW(
        m.parameters(), lr=LR, weight_decay=WD, module=m, precision=Precision(states=states)
    )
    x, y = batch(0, 0, 1)
    ((m(x) - y) ** 2).mean().backward()
    opt.step()
    rec = {
        "format": "fusedzero-tensor-parallel",
        "version": 2,
        "tp": 1,
        "dp": 1,
        "params": [
            {"name": i.name, "shape": list(i.shape), "placement": "R"} for i in opt.param_infos()
        ],
    }
    write_binding(root, rec, 0)
    checkpoint.save(opt, root / "tp0of1", step=1).wait()
    (root / "tensor_parallel.json").write_text(json.dumps(rec))
    return opt, rec


def test_plain_optimizer_loads_a_tp_root_exactly(tmp_path: Path) -> None:
    """The across-tp path in one process: every state field bit-exact; other memory modes and
    a record whose global shapes differ from the model's are refused before anything is
    written."""
    from fusedzero import checkpoint
    from fusedzero.optim import ZeroAdamW

    opt, rec = _one_folder_root(tmp_path / "a", "fp32")
    m2 = make()
    opt2 = ZeroAdamW(m2.parameters(), lr=LR, weight_decay=WD, module=m2)
    checkpoint.load(opt2, tmp_path / "a")
    want, got = opt.shard_state(), opt2.shard_state()
    assert got.step_count == want.step_count == 1
    for kind in KINDS:
        for a, b in zip(getattr(want, kind), getattr(got, kind), strict=True):
            assert torch.equal(a, b) and b.abs().sum() > 0, kind
    rec["params"][0]["shape"] = [H + 1, D]
    (tmp_path / "a" / "tensor_parallel.json").write_text(json.dumps(rec))
    write_binding(tmp_path / "a", rec, 0)  # bound to the edit too: the shape check acts
    with pytest.raises(ValueError, match="global shape"):
        checkpoint.load(opt2, tmp_path / "a")
    _one_folder_root(tmp_path / "b", "bf16")
    with pytest.raises(CheckpointError, match="only the default memory modes"):
        checkpoint.load(opt2, tmp_path / "b")
    for a, b in zip(want.exp_avg, opt2.shard_state().exp_avg, strict=True):
        assert torch.equal(a, b)  # the refused loads changed nothing


def test_full_and_local_round_trip() -> None:
    g = torch.Generator().manual_seed(0)
    for shape, pl, size in [
        ((7, 3), "S(0)", 2),
        ((4, 9), "S(1)", 4),
        ((12, 2), "SS(0,3)", 2),
        ((5,), "R", 3),
        ((9, 4), "S(0)", 4),
    ]:
        t = torch.randn(shape, generator=g)
        parts = [local_of(t, pl, r, size) for r in range(size)]
        assert torch.equal(full_of(parts, pl, list(shape)), t), (shape, pl)
    # The strided split holds [q_r; k_r; v_r]: rows 0-1, 4-5, 8-9 of 12 on rank 0 of 2.
    t = torch.arange(12.0).reshape(12, 1)
    assert local_of(t, "SS(0,3)", 0, 2).flatten().tolist() == [0, 1, 4, 5, 8, 9]


GOOD = {
    "format": "fusedzero-tensor-parallel",
    "version": 2,
    "tp": 2,
    "dp": 2,
    "params": [{"name": "0.weight", "shape": [20, 12], "placement": "S(0)"}],
}


@pytest.mark.parametrize(
    "edit,msg",
    [
        (lambda d: d.update(tp=0), "tp must be an integer"),
        (lambda d: d.update(tp=True), "tp must be an integer"),
        (lambda d: d.update(version=3), "version 3"),
        (lambda d: d.update(version=True), "True"),
        (lambda d: d.update(format="x"), "not a fusedzero-tensor-parallel record"),
        (lambda d: d["params"][0].update(placement="S(2)"), "names dim 2"),
        (lambda d: d["params"][0].update(placement="P"), "is not R, S(d) or SS(d,k)"),
        (lambda d: d["params"][0].update(placement="S(0) "), "is not R, S(d) or SS(d,k)"),
        (lambda d: d["params"][0].update(placement="SS(0,0)"), "split factor"),
        (lambda d: d["params"][0].update(shape=[-1, 2]), "is not a list of sizes"),
        (lambda d: d["params"][0].update(extra=1), "exactly name, shape, placement"),
        (lambda d: d["params"].append(dict(d["params"][0])), "is not a new non-empty name"),
    ],
)
def test_record_is_validated(edit, msg: str) -> None:
    d = json.loads(json.dumps(GOOD))
    parse(json.dumps(d), Path("x"))  # the good record parses
    edit(d)
    with pytest.raises(CheckpointError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        parse(json.dumps(d), Path("x"))
    with pytest.raises(CheckpointError, match="not JSON"):
        parse("[" * 100000, Path("x"))
