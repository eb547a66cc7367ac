"""`export_tp` in one process: a tensor-parallel root of two tp folders, each an ordinary
checkpoint of one tp rank's local shards (written here by plain single-process optimizers, as
each tp rank's dp group would), exports to the full tensors, assembled by the recorded
placements. The multi-rank round trip is tests/checkpoint/test_tp_checkpoint.py (slow)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from fusedzero import checkpoint
from fusedzero.checkpoint.manifest import CheckpointError
from fusedzero.checkpoint.placements import local_of
from fusedzero.optim import ZeroAdamW

T = 2
# name -> (global shape, placement): column-parallel weight and bias, a row-parallel weight,
# a replicated norm.
PARAMS = {"up.weight": ([8, 6], "S(0)"), "up.bias": ([8], "S(0)"),
          "down.weight": ([6, 8], "S(1)"), "norm.weight": ([6], "R")}


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {n: torch.randn(shape, generator=g) for n, (shape, _) in PARAMS.items()}


def _tp_module(full: dict[str, torch.Tensor], t: int) -> nn.Module:
    m = nn.Module()
    for prefix in ("up", "down", "norm"):
        m.add_module(prefix, nn.Module())
    for n, (_, pl) in PARAMS.items():
        mod, attr = n.split(".")
        local = local_of(full[n], pl, t, T).clone()
        getattr(m, mod).register_parameter(attr, nn.Parameter(local))
    return m


def _root(tmp_path: Path, full: dict[str, torch.Tensor]) -> Path:
    root = tmp_path / "root"
    for t in range(T):
        m = _tp_module(full, t)
        opt = ZeroAdamW(m.parameters(), lr=1e-2, module=m, process_group=None)
        checkpoint.save(opt, root / f"tp{t}of{T}", step=1).wait()
    rec = {"format": "fusedzero-tensor-parallel", "version": 1, "tp": T, "dp": 1,
           "params": [{"name": n, "shape": s, "placement": pl} for n, (s, pl) in PARAMS.items()]}
    (root / "tensor_parallel.json").write_text(json.dumps(rec))
    return root


def test_export_tp_assembles_full_tensors_from_each_tp_folder(tmp_path: Path) -> None:
    from safetensors.torch import load_file
    full = _full()
    out = checkpoint.export_tp(_root(tmp_path, full), tmp_path / "model.safetensors")
    got = load_file(out)
    assert set(got) == set(full)
    for n, t in full.items():
        assert torch.equal(got[n], t), n  # fp32 masters: exact
    assert not list(tmp_path.glob(".model.safetensors.tp*"))  # per-tp temporaries removed


def test_export_tp_refuses_a_plain_root_and_a_param_missing_from_a_folder(tmp_path: Path) -> None:
    full = _full()
    root = _root(tmp_path, full)
    with pytest.raises(CheckpointError, match="not a tensor-parallel checkpoint root"):
        checkpoint.export_tp(root / "tp0of2", tmp_path / "x.safetensors")
    rec = json.loads((root / "tensor_parallel.json").read_text())
    rec["params"].append({"name": "extra.weight", "shape": [2], "placement": "R"})
    (root / "tensor_parallel.json").write_text(json.dumps(rec))
    with pytest.raises(CheckpointError, match="extra.weight is missing"):
        checkpoint.export_tp(root, tmp_path / "y.safetensors")
    assert not (tmp_path / "y.safetensors").exists()  # nothing written on refusal
