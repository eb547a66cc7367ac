"""`export_tp`: one model's safetensors of full tensors from a tensor-parallel checkpoint root
(see fusedzero/checkpoint/_placements.py for the layout), and `export`, which `checkpoint.export`,
`fusedzero ckpt export` and `hf.export_hf` call: a tp root through `export_tp`, any other
checkpoint through `weights.export`."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from fusedzero.checkpoint import _weights as weights
from fusedzero.checkpoint._catalog import read_manifest, resolve
from fusedzero.checkpoint._manifest import CheckpointError
from fusedzero.checkpoint._placements import TP_FILE, check_bound, folder, full_of, read
from fusedzero.checkpoint._weights import Exported

_FOLDER = re.compile(r"tp\d+of\d+")


def export(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int | None = None,
    verify: bool = True,
) -> Exported:
    """`checkpoint.export` (see `weights.export` for the arguments), for any checkpoint: a
    tensor-parallel root (it holds tensor_parallel.json) is exported with `export_tp`."""
    if read(Path(src)) is not None:
        return export_tp(src, out, dtype=dtype, max_shard_bytes=max_shard_bytes, verify=verify)
    return weights.export(src, out, dtype=dtype, max_shard_bytes=max_shard_bytes, verify=verify)


def saved_params(src: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Each param a checkpoint holds: name, full shape and aliases (tied names), from a plain
    checkpoint's manifest or a tp root's record (aliases from tp folder 0's manifest)."""
    root = Path(src)
    rec = read(root)
    if rec is None:
        return read_manifest(resolve(src))["params"]
    check_bound(root, rec)
    m = read_manifest(resolve(folder(root, 0, rec["tp"])))
    aliases = {p["name"]: p.get("aliases", []) for p in m["params"]}
    return [
        {"name": p["name"], "shape": p["shape"], "aliases": aliases.get(p["name"], [])}
        for p in rec["params"]
    ]


def export_tp(
    root: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int | None = None,
    verify: bool = True,
) -> Exported:
    """One safetensors file (or HF-style shards + index above `max_shard_bytes`, as
    `weights.export`) of full tensors under the model's names from a tensor-parallel checkpoint
    root: each tp folder's latest checkpoint exported, then assembled by the recorded
    placements. Refuses a root whose folders are not bound to its record before reading data.
    Offline; holds the whole model in memory once, as every tp rank's part and assembled:
    `peak_buffer_bytes` counts both."""
    from safetensors.torch import load_file

    root, out = Path(root), Path(out)
    rec = read(root)
    if rec is None:
        raise CheckpointError(f"{root}: no {TP_FILE}: not a tensor-parallel checkpoint root")
    check_bound(root, rec)
    target = out.resolve()
    if target.parent == root.resolve() and (
        target.name == TP_FILE or _FOLDER.fullmatch(target.name)
    ):
        raise CheckpointError(
            f"export output {out} would replace the root's {target.name}; choose another name"
        )
    T = rec["tp"]
    parts = []
    for t in range(T):
        tmp = out.with_name(f".{out.name}.tp{t}")
        try:
            weights.export(folder(root, t, T), tmp, dtype=dtype, verify=verify)
            parts.append(load_file(tmp))
        finally:
            tmp.unlink(missing_ok=True)
    full = {}
    for p in rec["params"]:
        n = p["name"]
        if any(n not in d for d in parts):
            raise CheckpointError(f"{root}: param {n} is missing from a tp folder's checkpoint")
        full[n] = full_of([d[n] for d in parts], p["placement"], p["shape"]).contiguous()
    for n, t in parts[0].items():  # a tied param's other names: replicated over tp
        if n not in full:
            full[n] = full_of([d.get(n, t) for d in parts], "R", list(t.shape))
    held = sum(t.numel() * t.element_size() for d in [*parts, full] for t in d.values())
    files, index, total = _write(full, out, max_shard_bytes)
    return Exported(files, index, total, held)


def _write(
    full: dict[str, torch.Tensor], out: Path, max_shard_bytes: int | None
) -> tuple[list[Path], Path | None, int]:
    """`full` as `out`, or as HF-style shards plus an index (`weights.export_files`):
    (files, index, tensor bytes)."""
    names = list(full)
    sizes = [full[x].numel() * full[x].element_size() for x in names]
    with weights.export_files(out, sizes, max_shard_bytes) as ex:
        for k, c in enumerate(ex.cut):
            mine = [names[i] for i in c]
            ex.write(
                k,
                [(x, full[x].dtype, tuple(full[x].shape)) for x in mine],
                ((x, full[x]) for x in mine),
            )
        ex.commit()
    files, index, total = ex.paths, ex.index, ex.total
    return files, index, total
