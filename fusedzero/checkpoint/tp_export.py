"""`export_tp`: one safetensors file of full tensors from a tensor-parallel checkpoint root
(see fusedzero/checkpoint/placements.py for the layout)."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from fusedzero.checkpoint.manifest import CheckpointError
from fusedzero.checkpoint.placements import TP_FILE, full_of, read
from fusedzero.checkpoint.weights import export


def export_tp(root: str | os.PathLike[str], out: str | os.PathLike[str], *,
              dtype: torch.dtype = torch.float32) -> Path:
    """One safetensors file of full tensors (the model's names) from a tensor-parallel
    checkpoint root: each tp folder's latest checkpoint exported, then assembled by the recorded
    placements. Offline; holds the whole model in memory once."""
    from safetensors.torch import load_file, save_file

    root, out = Path(root), Path(out)
    rec = read(root)
    if rec is None:
        raise CheckpointError(f"{root}: no {TP_FILE}: not a tensor-parallel checkpoint root")
    T = rec["tp"]
    parts = []
    for t in range(T):
        tmp = out.with_name(f".{out.name}.tp{t}")
        export(root / f"tp{t}of{T}", tmp, dtype=dtype)
        parts.append(load_file(tmp))
        tmp.unlink()
    full = {}
    for p in rec["params"]:
        n = p["name"]
        if any(n not in d for d in parts):
            raise CheckpointError(f"{root}: param {n} is missing from a tp folder's checkpoint")
        full[n] = full_of([d[n] for d in parts], p["placement"], p["shape"]).contiguous()
    for n, t in parts[0].items():  # a tied param's other names: replicated over tp
        if n not in full:
            full[n] = full_of([d.get(n, t) for d in parts], "R", list(t.shape))
    save_file(full, str(out))
    return out
