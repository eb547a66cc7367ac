"""`export_tp` in one process: a tensor-parallel root of two tp folders, each an ordinary
checkpoint of one tp rank's local shards (written here by plain single-process optimizers, as
each tp rank's dp group would, and bound to the record as `save` binds them), exports to the
full tensors, assembled by the recorded placements, through the library and `fusedzero ckpt
export`. The record is bound to the folders: an edit that keeps every local shape, a folder
swap or an older unbound root is refused before any data is read. The multi-rank round trip is
tests/checkpoint/test_tp_checkpoint.py (slow).

About internals: fusedzero._dtensor, fusedzero.checkpoint._placements,
fusedzero.checkpoint._tp_export."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fusedzero import checkpoint, cli
from fusedzero.checkpoint import CheckpointError
from fusedzero.checkpoint._placements import TP_VERSION, local_of, write_binding
from fusedzero.optim import ZeroAdamW

T = 2
# name -> (global shape, placement): column-parallel weight and bias, a row-parallel weight,
# a replicated norm, a fused q/k/v split by heads (the GPT plan's _StridedShard).
PARAMS = {
    "up.weight": ([8, 6], "S(0)"),
    "up.bias": ([8], "S(0)"),
    "down.weight": ([6, 8], "S(1)"),
    "norm.weight": ([6], "R"),
    "qkv.weight": ([12, 6], "SS(0,3)"),
}


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {n: torch.randn(shape, generator=g) for n, (shape, _) in PARAMS.items()}


def _tp_module(full: dict[str, torch.Tensor], t: int, size: int = T) -> nn.Module:
    m = nn.Module()
    for prefix in ("up", "down", "norm", "qkv"):
        m.add_module(prefix, nn.Module())
    for n, (_, pl) in PARAMS.items():
        mod, attr = n.split(".")
        local = local_of(full[n], pl, t, size).clone()
        getattr(m, mod).register_parameter(attr, nn.Parameter(local))
    return m


def _record(version: int = TP_VERSION) -> dict:
    return {
        "format": "fusedzero-tensor-parallel",
        "version": version,
        "tp": T,
        "dp": 1,
        "params": [{"name": n, "shape": s, "placement": pl} for n, (s, pl) in PARAMS.items()],
    }


def _root(
    tmp_path: Path, full: dict[str, torch.Tensor], version: int = TP_VERSION, name: str = "root"
) -> Path:
    """A tp root as `save` writes it (version 1: as it wrote it before the binding)."""
    root = tmp_path / name
    rec = _record(version)
    for t in range(T):
        if version >= 2:
            write_binding(root, rec, t)
        m = _tp_module(full, t)
        opt = ZeroAdamW(m.parameters(), lr=1e-2, module=m)
        checkpoint.save(opt, root / f"tp{t}of{T}", step=1).wait()
    (root / "tensor_parallel.json").write_text(json.dumps(rec))
    return root


def test_export_tp_assembles_full_tensors_from_each_tp_folder(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    full = _full()
    r = checkpoint.export_tp(_root(tmp_path, full), tmp_path / "model.safetensors")
    assert r.files == [tmp_path / "model.safetensors"] and r.index is None
    got = load_file(r.files[0])
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
    for t in range(T):  # the folders bound to the edited record too: the data check still acts
        write_binding(root, rec, t)
    with pytest.raises(CheckpointError, match="extra.weight is missing"):
        checkpoint.export_tp(root, tmp_path / "y.safetensors")
    assert not (tmp_path / "y.safetensors").exists()  # nothing written on refusal


def _plain_model() -> nn.Module:
    """The unparallelized model (zeros): a plain optimizer of it loads a tp root across tp."""
    return _tp_module({n: torch.zeros(s) for n, (s, _) in PARAMS.items()}, 0, size=1)


def _load_plain(root: Path) -> nn.Module:
    m = _plain_model()
    opt = ZeroAdamW(m.parameters(), lr=1e-2, module=m)
    checkpoint.load(opt, root)  # across tp sizes: tp_reshard.read_across
    opt.close()
    return m


def _fake_tp_opt(full: dict[str, torch.Tensor], t: int) -> SimpleNamespace:
    """What `tp_directory` reads of tp rank t's optimizer (dp rank 0 of 1): its tp info, its
    params (a DTensor's shape is the global one) and their names, from a real optimizer of the
    rank's local module."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from fusedzero._dtensor import TpInfo

    m = _tp_module(full, t)
    infos = ZeroAdamW(m.parameters(), lr=1e-2, module=m).param_infos()
    parse = {
        "R": Replicate(),
        "S(0)": Shard(0),
        "S(1)": Shard(1),
        "SS(0,3)": _StridedShard(0, split_factor=3),
    }
    params = [torch.empty(PARAMS[i.name][0], device="meta") for i in infos]
    tp = TpInfo(
        mesh=None,
        group=None,
        size=T,
        rank=t,
        placements={id(q): (parse[PARAMS[i.name][1]],) for q, i in zip(params, infos)},
    )
    return SimpleNamespace(
        tp=tp,
        params=params,
        param_infos=lambda: infos,
        world_size=1,
        replicas=1,
        rank=0,
        replica_rank=0,
    )


def _edit(root: Path, name: str, placement: str) -> None:
    rec = json.loads((root / "tensor_parallel.json").read_text())
    for p in rec["params"]:
        if p["name"] == name:
            p["placement"] = placement
    (root / "tensor_parallel.json").write_text(json.dumps(rec))


@pytest.mark.parametrize("name,placement", [("up.weight", "SS(0,2)"), ("qkv.weight", "S(0)")])
def test_an_edit_that_keeps_local_shapes_is_refused(
    tmp_path: Path, name: str, placement: str
) -> None:
    """S(0) -> SS(0,2) on a [8, 6] weight, or the GPT qkv's SS(0,3) -> S(0): every tp folder
    still holds the local shapes the edited placement gives, so only the binding tells: export,
    `fusedzero ckpt export` and a load across tp sizes refuse it, naming the binding file, and
    nothing is written or loaded."""
    full = _full()
    root = _root(tmp_path, full)
    assert torch.equal(_load_plain(root).get_submodule(name.split(".")[0]).weight, full[name])
    _edit(root, name, placement)
    match = r"tp0of2/tp_binding\.json: does not match tensor_parallel\.json"
    with pytest.raises(CheckpointError, match=match):
        checkpoint.export_tp(root, tmp_path / "a.safetensors")
    with pytest.raises(CheckpointError, match=match):
        _load_plain(root)
    assert cli.main(["ckpt", "export", str(root), str(tmp_path / "b.safetensors")]) == 2
    assert not list(tmp_path.glob("*.safetensors"))


def test_a_bound_edit_that_changes_local_shapes_is_refused(tmp_path: Path) -> None:
    """The record and every binding edited together (S(0) -> S(1)): the manifests' local
    shapes still tell, before any data is read."""
    root = _root(tmp_path, _full())
    _edit(root, "up.weight", "S(1)")
    rec = json.loads((root / "tensor_parallel.json").read_text())
    for t in range(T):
        write_binding(root, rec, t)
    with pytest.raises(
        CheckpointError,
        match=r"up.weight has local shape \[4, 6\], the "
        r"record's placement gives \[8, 3\]",
    ):
        _load_plain(root)


def test_swapped_tp_folders_are_refused_by_tp_directory(tmp_path: Path) -> None:
    """tp0of2 and tp1of2 swapped (every local shape is the same on both ranks): the same-tp
    load (`tp_directory`), a save into it, and export refuse it; the intact root resolves."""
    from fusedzero.checkpoint._placements import tp_directory

    full = _full()
    root = _root(tmp_path, full)
    opt = _fake_tp_opt(full, 1)
    assert tp_directory(opt, root, saving=False) == root / "tp1of2"
    (root / "tp0of2").rename(root / "x")
    (root / "tp1of2").rename(root / "tp0of2")
    (root / "x").rename(root / "tp1of2")
    for saving in (False, True):
        with pytest.raises(CheckpointError, match=r"tp_binding\.json: does not match"):
            tp_directory(opt, root, saving=saving)
    with pytest.raises(CheckpointError, match=r"tp0of2/tp_binding\.json: does not match"):
        checkpoint.export_tp(root, tmp_path / "a.safetensors")


def test_an_older_unbound_root_is_refused_and_converts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A root of record version 1 (no bindings): refused with the command that converts it;
    `fusedzero ckpt upgrade` writes a bound copy (the old root untouched) that exports and
    loads exactly; a version-2 root is not converted again."""
    from safetensors.torch import load_file

    full = _full()
    old = _root(tmp_path, full, version=1, name="old")
    before = sorted(str(p.relative_to(old)) for p in old.rglob("*"))
    with pytest.raises(CheckpointError, match=r"record version 1.*fusedzero ckpt upgrade"):
        checkpoint.export(old, tmp_path / "a.safetensors")
    with pytest.raises(CheckpointError, match="fusedzero ckpt upgrade"):
        _load_plain(old)
    new = tmp_path / "new"
    assert cli.main(["ckpt", "upgrade", str(old), str(new)]) == 0
    assert sorted(str(p.relative_to(old)) for p in old.rglob("*")) == before
    got = load_file(checkpoint.export(new, tmp_path / "a.safetensors").files[0])
    m = _load_plain(new)
    for n, t in full.items():
        assert torch.equal(got[n], t) and torch.equal(m.get_parameter(n), t), n
    capsys.readouterr()
    assert cli.main(["ckpt", "upgrade", str(new), str(tmp_path / "again")]) == 2
    assert "already record version 2" in capsys.readouterr().err


def test_cli_export_of_a_tp_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`fusedzero ckpt export ROOT OUT` on a tensor-parallel root, as on a plain one: --dtype,
    --max-shard-size (HF shards + index) and --hf-config (config.json beside the weights; the
    config's param check needs transformers, kept out here: it is slow to import)."""
    from safetensors.torch import load_file

    from fusedzero.checkpoint._tp_export import saved_params

    full = _full()
    root = _root(tmp_path, full)
    assert [(p["name"], p["shape"]) for p in saved_params(root)] == [
        (n, s) for n, (s, _) in PARAMS.items()
    ]
    assert (
        cli.main(["ckpt", "export", str(root), str(tmp_path / "a.safetensors"), "--dtype", "bf16"])
        == 0
    )
    got = load_file(tmp_path / "a.safetensors")
    assert {n: t.dtype for n, t in got.items()} == {n: torch.bfloat16 for n in full}
    assert all(torch.equal(got[n], t.bfloat16()) for n, t in full.items())
    assert (
        cli.main(
            [
                "ckpt",
                "export",
                str(root),
                str(tmp_path / "s" / "model.safetensors"),
                "--max-shard-size",
                "200",
            ]
        )
        == 0
    )
    index = json.loads((tmp_path / "s" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(full)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1, files
    got = {k: v for f in files for k, v in load_file(tmp_path / "s" / f).items()}
    assert all(torch.equal(got[n], t) for n, t in full.items())
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "gpt2"}))
    assert (
        cli.main(["ckpt", "export", str(root), str(tmp_path / "hf"), "--hf-config", str(cfg)]) == 0
    )
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert all(torch.equal(got[n], t) for n, t in full.items())
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "gpt2"
    with pytest.raises(CheckpointError, match="would replace the root's tensor_parallel.json"):
        checkpoint.export(root, root / "tensor_parallel.json")


def test_ckpt_inspect_and_verify_take_a_tp_root(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each tp folder inspected and verified, after the bindings; a damaged shard in one tp
    folder fails verify (1), swapped folders are an error (2) before any shard is read."""
    root = _root(tmp_path, _full())
    for cmd in ("inspect", "verify"):
        assert cli.main(["ckpt", cmd, str(root)]) == 0
        out = capsys.readouterr().out
        assert "== tp rank 0 of 2" in out and "== tp rank 1 of 2" in out, out
    shard = next((root / "tp1of2").rglob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert cli.main(["ckpt", "verify", str(root)]) == 1
    assert "FAILED" in capsys.readouterr().out
    (root / "tp0of2").rename(root / "x")
    (root / "tp1of2").rename(root / "tp0of2")
    (root / "x").rename(root / "tp1of2")
    assert cli.main(["ckpt", "verify", str(root)]) == 2
    assert "tp_binding.json: does not match" in capsys.readouterr().err
