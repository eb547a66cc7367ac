"""Memory modes through the optimizer (`Precision(master=, states=)`): validation, resident bytes
against the formula, stages and ranks agreeing in a mode, and checkpoints that keep each state in
its own dtype, reshard it and convert between modes. The kernel numerics of every mode are
tests/kernels/test_kernels.py's (and the modes helper's); here the plumbing around them.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from torch import nn

from fusedzero import Precision, Sharding, ZeroAdamW, checkpoint as ck
from fusedzero.kernels import dequantize_blockwise, quantize_blockwise
from fusedzero.testing import fake_group, run_ranks

MASTERS = ("fp32", "bf16-kahan", "bf16-sr", "bf16")
STATES = ("fp32", "bf16", "int8")
# Bytes per local-shard element, written out here independently of fusedzero/memory_modes.py: bf16
# params; an fp32 master only in master="fp32"; Kahan adds a bf16 comp.
MASTER_BYTES = {"fp32": 4, "bf16-kahan": 2, "bf16-sr": 0, "bf16": 0}
STATE_BYTES = {"fp32": 4 + 4, "bf16": 2 + 2, "int8": 1 + 1}


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    # 17 * 33 + 33 + 33 * 5 + 5 elements: params that are not multiples of 128 (padding).
    return nn.Sequential(nn.Linear(17, 33), nn.Tanh(), nn.Linear(33, 5))


def _groups(m: nn.Module) -> list[dict]:
    return [
        {"params": [m[0].weight, m[2].weight]},
        {"params": [m[0].bias, m[2].bias], "weight_decay": 0.0, "lr": 5e-3},
    ]


def _opt(m: nn.Module, master: str, states: str, stage: int = 1, seed: int = 0) -> ZeroAdamW:
    return ZeroAdamW(
        _groups(m),
        lr=1e-2,
        stage=stage,
        module=m,
        max_grad_norm=0.5,
        precision=Precision(param_dtype=torch.bfloat16, master=master, states=states, seed=seed),
        sharding=Sharding(bucket_numel=600),
    )


def _train(m: nn.Module, opt: ZeroAdamW, steps: int, seed: int = 1, accum: int = 2) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for _ in range(accum):
            x = torch.randn(8, 17, generator=g).bfloat16()
            (m(x).float().pow(2).mean() / accum).backward()
        opt.step()
        opt.zero_grad()


# -- validation and memory -----------------------------------------------------------------------
def test_bf16_master_modes_need_bf16_params_and_names_are_checked() -> None:
    m = _model()
    with pytest.raises(ValueError, match="param_dtype=torch.bfloat16"):
        ZeroAdamW(m.parameters(), precision=Precision(master="bf16-kahan"))  # fp32 params
    with pytest.raises(ValueError, match="param_dtype is torch.float16"):
        ZeroAdamW(m.parameters(), precision=Precision(master="bf16-sr", param_dtype=torch.float16))
    with pytest.raises(ValueError, match="master='kahan'"):
        ZeroAdamW(m.parameters(), precision=Precision(master="kahan"))
    with pytest.raises(ValueError, match="states='int4'"):
        ZeroAdamW(m.parameters(), precision=Precision(states="int4"))
    # bf16 params without param_dtype are their own master: allowed.
    ZeroAdamW(
        _model().bfloat16().parameters(), precision=Precision(master="bf16-kahan", states="int8")
    ).close()


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_resident_optimizer_bytes_equal_the_formula_in_every_mode(stage: int) -> None:
    """opt.memory().optimizer == sum over buffers of local elements x bytes per element + two
    fp32 scales per 128 elements (int8), with local elements from the layout: padded / W from
    stage 1 (W=3: ranks pad), padded at stage 0."""
    W = 3
    for master, states in itertools.product(MASTERS, STATES):
        with fake_group(2, W):
            m = _model()
            opt = _opt(m, master, states, stage=stage)
            want = 0
            for b in opt.flat_groups:
                L = b.layout
                assert L.local_numel == (L.padded_numel if stage == 0 else L.padded_numel // W)
                per = MASTER_BYTES[master] + STATE_BYTES[states]
                want += per * L.local_numel + (
                    2 * 4 * L.local_numel // 128 if states == "int8" else 0
                )
            assert opt.memory().optimizer == want, (master, states, stage)
            opt.close()


# -- every stage in a mode: one process, then two ranks ------------------------------------------
@pytest.mark.parametrize(
    "master,states", [("bf16-kahan", "int8"), ("bf16-sr", "bf16"), ("bf16", "int8")]
)
def test_stages_agree_bitwise_in_a_mode(master: str, states: str) -> None:
    """At one rank the stages differ only in where grads and params live: the same mode gives
    bit-identical params and states at stages 0-3 (grad accumulation and clipping on)."""
    results = []
    for stage in (0, 1, 2, 3):
        m = _model()
        opt = _opt(m, master, states, stage=stage)
        _train(m, opt, 3)
        with opt.gathered_params():
            params = [p.detach().clone() for p in m.parameters()]
        st = opt.shard_state()
        results.append(
            (
                params,
                [
                    {k: t.clone() for k, t in st.tensors(i).items()}
                    for i in range(len(opt.flat_groups))
                ],
            )
        )
        opt.close()
    for stage, (params, states_) in enumerate(results[1:], start=1):
        for a, b in zip(params, results[0][0]):
            assert torch.equal(a, b), (master, states, stage)
        if stage < 3:  # stage 3 groups buffers by unit: another buffer order
            for x, y in zip(states_, results[0][1]):
                assert all(torch.equal(x[k], y[k]) for k in x), (master, states, stage)


def w_train(rank: int, world: int, master: str, states: str, stage: int) -> list[torch.Tensor]:
    m = _model()
    opt = _opt(m, master, states, stage=stage)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(8 * world, 17, generator=g).bfloat16()
        (m(x[rank * 8 : (rank + 1) * 8]).float().pow(2).mean()).backward()
        opt.step()
        opt.zero_grad()
    with opt.gathered_params():
        return [p.detach().clone() for p in m.parameters()]


@pytest.mark.slow
def test_two_ranks_match_one_rank_in_kahan_int8() -> None:
    """2 gloo ranks at stage 2 vs one process on the same global batch, bf16-kahan + int8.
    Only the grads' summation order differs (the ranks' halves summed by the reduction vs in
    one backward): an fp32 ulp in a moment can flip one int8 code, which moves that element's
    update by a few percent of lr, and a master on a bf16 rounding boundary may land on the
    other side (one bf16 ulp of the param, the comp holding the difference). A misplaced shard
    or scale would move it by O(lr). So: one bf16 ulp plus 5% of lr per step over 3 steps."""
    two = run_ranks(w_train, 2, "bf16-kahan", "int8", 2)
    m = _model()
    opt = _opt(m, "bf16-kahan", "int8", stage=0)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(16, 17, generator=g).bfloat16()
        (m(x[:8]).float().pow(2).mean() / 2 + m(x[8:]).float().pow(2).mean() / 2).backward()
        opt.step()
        opt.zero_grad()
    for a, b, ref in zip(two[0], two[1], m.parameters()):
        assert torch.equal(a, b)
        r = ref.detach().float()
        tol = torch.finfo(torch.bfloat16).eps * r.abs() + 0.05 * 1e-2 * 3
        assert ((a.float() - r).abs() <= tol).all(), (a.float() - r).abs().max()


# -- checkpoints ----------------------------------------------------------------------------------
def _state(opt: ZeroAdamW) -> list[dict[str, torch.Tensor]]:
    st = opt.shard_state()
    return [{k: t.clone() for k, t in st.tensors(i).items()} for i in range(len(opt.flat_groups))]


@pytest.mark.parametrize(
    "master,states",
    [("bf16-kahan", "int8"), ("bf16-sr", "bf16"), ("fp32", "int8"), ("bf16", "fp32")],
)
def test_same_mode_resume_is_bit_exact(tmp_path: Path, master: str, states: str) -> None:
    """Saved at stage 1, loaded at stage 2: every stored tensor (codes, scales, comp) equal, and
    two more steps equal an uninterrupted run's (bf16-sr: the seed and the step count)."""
    m, opt = _model(), None
    opt = _opt(m, master, states, stage=1, seed=7)
    _train(m, opt, 3)
    ck.save(opt, tmp_path, step=3)
    m2 = _model(seed=5)  # other initial values: all must come from the checkpoint
    opt2 = _opt(m2, master, states, stage=2, seed=7)
    ck.load(opt2, tmp_path)
    a, b = _state(opt), _state(opt2)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), k
    _train(m, opt, 2, seed=9)
    _train(m2, opt2, 2, seed=9)
    for p, q in zip(m.parameters(), m2.parameters()):
        assert torch.equal(p, q)
    manifest = ck.read_manifest(ck.resolve(tmp_path))
    assert manifest["modes"] == {"master": master, "states": states}


def _fp32_checkpoint(path: Path) -> list[dict[str, torch.Tensor]]:
    """An fp32-master, fp32-states optimizer trained 3 steps and saved to `path`: its state."""
    m = _model()
    opt = _opt(m, "fp32", "fp32")
    _train(m, opt, 3)
    ck.save(opt, path, step=3)
    return _state(opt)


def _loaded(path: Path, master: str, states: str, seed: int) -> ZeroAdamW:
    opt = _opt(_model(seed=seed), master, states)
    ck.load(opt, path)
    return opt


def test_load_converts_states_fp32_to_int8_and_back(tmp_path: Path) -> None:
    src = _fp32_checkpoint(tmp_path / "f32")
    opt8 = _loaded(tmp_path / "f32", "fp32", "int8", seed=5)
    for s, d in zip(src, _state(opt8)):
        assert torch.equal(d["master"], s["master"])
        for name, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            q, scale = quantize_blockwise(s[name], signed=signed)
            assert torch.equal(d[name], q) and torch.equal(d[f"{name}_scale"], scale)
    ck.save(opt8, tmp_path / "i8", step=3)
    back = _loaded(tmp_path / "i8", "fp32", "fp32", seed=6)
    for q8, d in zip(_state(opt8), _state(back)):
        assert torch.equal(
            d["exp_avg"], dequantize_blockwise(q8["exp_avg"], q8["exp_avg_scale"], signed=True)
        )
        assert torch.equal(
            d["exp_avg_sq"],
            dequantize_blockwise(q8["exp_avg_sq"], q8["exp_avg_sq_scale"], signed=False),
        )


def test_load_converts_fp32_master_to_kahan_and_back(tmp_path: Path) -> None:
    """fp32 -> bf16-kahan: param = rne(master), comp = rne(master - param); back: master =
    param + comp (fusedzero/memory_modes.py, see [Note: converting masters])."""
    src = _fp32_checkpoint(tmp_path / "f32")
    optk = _loaded(tmp_path / "f32", "bf16-kahan", "fp32", seed=5)
    kah = _state(optk)
    for s, d in zip(src, kah):
        p = s["master"].to(torch.bfloat16)
        assert torch.equal(d["master"], p)
        assert torch.equal(d["comp"], (s["master"] - p.float()).to(torch.bfloat16))
        # The pair holds the master to ~2**-16 relative: far closer than the bf16 param alone.
        err = (d["master"].float() + d["comp"].float() - s["master"]).abs()
        assert (err <= s["master"].abs() * 2.0**-15).all()
        assert torch.equal(d["exp_avg"], s["exp_avg"])
    ck.save(optk, tmp_path / "k", step=3)
    back = _loaded(tmp_path / "k", "fp32", "fp32", seed=6)
    for k, d in zip(kah, _state(back)):
        assert torch.equal(d["master"], k["master"].float() + k["comp"].float())
    # The model's weights are the params the optimizer wrote: the bf16 cast of that master.
    with back.gathered_params():
        for b in back.flat_groups:
            for p, slot in zip(b.params, b.layout.params):
                assert p.dtype == torch.bfloat16 and slot.numel == p.numel()


def w_save(rank: int, world: int, root: str) -> list[dict[str, torch.Tensor]]:
    m = _model()
    opt = _opt(m, "bf16-kahan", "int8", stage=2)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(16, 17, generator=g).bfloat16()
        m(x[rank * 8 : (rank + 1) * 8]).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    ck.save(opt, root, step=3)
    return _state(opt)


def _by_param(opt: ZeroAdamW, states: list[dict[str, torch.Tensor]], shard_infos) -> dict:
    """name -> field -> the param's full tensor of that field (scales: per 128-element block
    of the param), assembled from one rank's segments."""
    names = {p.index: p for p in opt.param_infos()}
    out: dict[str, dict[str, dict[int, float]]] = {}
    for info, st in zip(shard_infos, states):
        for s in info.segments():
            d = out.setdefault(names[s.param].name, {})
            for k, t in st.items():
                per = 128 if k.endswith("_scale") else 1
                for j in range(0, s.length, per):
                    d.setdefault(k, {})[(s.start + j) // per] = t[(s.local + j) // per].item()
    return out


@pytest.mark.slow
def test_int8_kahan_checkpoint_reshards_from_two_ranks_to_one_bitwise(tmp_path: Path) -> None:
    """Saved by 2 ranks at stage 2 (bucket_numel 600: several buckets, params cut at shard
    edges), loaded at 1 rank, stage 1: every code, scale and comp of every param equal."""
    saved = run_ranks(w_save, 2, str(tmp_path))
    infos2 = []
    for r in (0, 1):  # the saving ranks' segment tables, without their data
        with fake_group(r, 2):
            o = _opt(_model(), "bf16-kahan", "int8", stage=2)
            infos2.append(o.shard_infos())
            o.close()
    m = _model(seed=5)
    opt = _opt(m, "bf16-kahan", "int8", stage=1)
    ck.load(opt, tmp_path)
    got = _by_param(opt, _state(opt), opt.shard_infos())
    want: dict = {}
    for r in (0, 1):
        for name, fields in _by_param(opt, saved[r], infos2[r]).items():
            for k, v in fields.items():
                want.setdefault(name, {}).setdefault(k, {}).update(v)
    assert got == want


def test_docs_modes_table_is_the_generated_one() -> None:
    import runpy

    root = Path(__file__).resolve().parents[2]
    table = runpy.run_path(str(root / "bench" / "modes_table.py"))["table"]()
    assert table in (root / "docs" / "memory_modes.md").read_text()
    # The headline: bf16-kahan + int8 with bf16 grads moves about half of the default's 28.
    assert "| bf16-kahan | int8 | 4.0625 | 14.125 |" in table


def test_train_flags_parse_and_refuse_bf16_master_without_bf16_params() -> None:
    from fusedzero.app.config import UsageError, parse_args

    cfg = parse_args(["--param-dtype", "bf16", "--master", "bf16-kahan", "--states", "int8"])
    assert (cfg.master, cfg.states) == ("bf16-kahan", "int8")
    with pytest.raises(UsageError, match="--master bf16-sr .* needs --param-dtype bf16"):
        parse_args(["--master", "bf16-sr"])
