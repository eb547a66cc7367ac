"""Checkpoints of format version 2 (memory modes in the manifest) still load, once converted.

tests/checkpoint/fixtures/ckpt_v2 was written once by tests/checkpoint/fixtures/make_ckpt_v2.py
with the last code that wrote version 2: 2 gloo ranks, stage 2, bf16 params with a bf16 Kahan
master and int8 moments, two param groups, caller state. Its `expected/` holds what the saving
ranks had in memory, raw and as that code decoded it to fp32. Version 2 is refused by every load
with a message naming `fusedzero ckpt upgrade`; the converted copy is loaded here in one process
(one rank) in the saved modes, where every stored byte must come back, and in fp32 modes, where
the converted values must equal the old code's decoding, exactly.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from fusedzero import Precision, ZeroAdamW, checkpoint as ck
from fusedzero.memory_modes import QBLOCK

from _helpers import refused_then_upgraded

FIXTURE = Path(__file__).parent / "fixtures"
sys.path.insert(0, str(FIXTURE))
import make_ckpt_v2 as gen  # noqa: E402  (the fixture's model, groups and modes)

QB = QBLOCK  # the fixture's scales are per QBLOCK elements, as today
assert gen.QBLOCK == QB


def _per_param(opt: ZeroAdamW, fields: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """`{name}.{field}` for every param, assembled from this (only) rank's buffers; scales per
    QBLOCK-element block of the param."""
    params = {p.index: p for p in opt.param_infos()}
    st = opt.shard_state()
    out: dict[str, torch.Tensor] = {}
    for i, info in enumerate(opt.shard_infos()):
        t = st.tensors(i)
        for s in info.segments():
            p = params[s.param]
            n = math.prod(p.shape)
            for f in fields:
                if f.endswith("_scale"):  # pieces start on a block (ALIGN = QBLOCK)
                    a, b, nb = s.local // QB, s.start // QB, -(-s.length // QB)
                    dst = out.setdefault(f"{p.name}.{f}", torch.full((-(-n // QB),), float("nan")))
                    dst[b : b + nb] = t[f][a : a + nb]
                else:
                    dst = out.setdefault(f"{p.name}.{f}", torch.zeros(n, dtype=t[f].dtype))
                    dst[s.start : s.start + s.length] = t[f][s.local : s.local + s.length]
    shapes = {p.name: tuple(p.shape) for p in params.values()}
    return {
        k: v if k.endswith("_scale") else v.view(shapes[k.rsplit(".", 1)[0]])
        for k, v in out.items()
    }


def _same(have: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(have) == sorted(want)
    for k, w in want.items():
        h = have[k]
        assert h.dtype == w.dtype and torch.equal(h, w), (
            f"{k}: {h.dtype} vs {w.dtype}, max diff {(h.float() - w.float()).abs().max()}"
        )


@pytest.fixture(scope="module")
def upgraded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fixture, refused as it is, then converted by `fusedzero ckpt upgrade`."""
    tmp = tmp_path_factory.mktemp("v2")
    old = tmp / "old"
    shutil.copytree(FIXTURE / "ckpt_v2" / "root", old)
    model = gen.make_model()
    opt = ZeroAdamW(
        gen.param_groups(model),
        stage=2,
        module=model,
        precision=Precision(param_dtype=torch.bfloat16, **gen.MODES),
    )
    root = refused_then_upgraded(old, opt, 2, tmp / "root")
    assert ck.read_manifest(root)["modes"] == gen.MODES
    return root


def _load(root: Path, **modes: str) -> tuple[torch.nn.Module, ZeroAdamW, ck.Loaded]:
    model = gen.make_model()
    opt = ZeroAdamW(
        gen.param_groups(model, lr=0.5),
        stage=2,
        module=model,
        precision=Precision(param_dtype=torch.bfloat16, **modes),
    )
    got = ck.load(opt, root)
    values = json.loads((FIXTURE / "ckpt_v2" / "expected" / "values.json").read_text())
    assert got.step == values["step"] and got.rng_restored
    assert got.caller_state == values["caller_state"]["0"]
    assert float(opt.step_count.reshape(-1)[0]) == values["step_count"]
    assert [g["lr"] for g in opt.param_groups] == [values["lr"]] * 2  # hyper-parameters too
    assert [g["weight_decay"] for g in opt.param_groups] == values["weight_decay"]
    return model, opt, got


def _want() -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(FIXTURE / "ckpt_v2" / "expected" / "state.safetensors")


def test_v2_checkpoint_loads_in_its_modes(upgraded: Path) -> None:
    """Every stored byte comes back: bf16 params and Kahan comp, int8 codes and their scales."""
    model, opt, _ = _load(upgraded, **gen.MODES)
    fields = (*gen.RAW, "exp_avg_scale", "exp_avg_sq_scale")
    want = {k: v for k, v in _want().items() if k.rsplit(".", 1)[1] in fields}
    _same(_per_param(opt, fields), want)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), want[f"{n}.master"]), n


def test_v2_checkpoint_converts_to_fp32_modes(upgraded: Path) -> None:
    """Loaded as fp32 master and moments: the values the old code decoded, bit for bit."""
    _, opt, _ = _load(upgraded)
    want = {k.removesuffix("_fp32"): v for k, v in _want().items() if k.endswith("_fp32")}
    _same(_per_param(opt, ("master", "exp_avg", "exp_avg_sq")), want)
