"""`import_weights` from an HF-style `*.index.json` reads only the shard files beside the index
(docs/checkpoints.md, "Threat model"): an index is input from elsewhere, and a `weight_map` entry
that is a path ("../x", "/x", "a/b") would read a file outside the folder it came with."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

from fusedzero import checkpoint as ck

from _helpers import tiny_ckpt_opt

INDEX = "model.safetensors.index.json"


def _weights() -> tuple[torch.nn.Module, Any, dict[str, torch.Tensor]]:
    """The tiny GPT, its optimizer and its weights (the tied one once)."""
    model, opt = tiny_ckpt_opt()
    sd = {n: p.detach().clone().contiguous() for n, p in model.named_parameters()}
    return model, opt, sd


@pytest.mark.parametrize(
    "name", ["../outside.safetensors", "ABS", "sub/../../outside.safetensors", "..", ""]
)
def test_index_names_only_files_beside_it(tmp_path: Path, name: str) -> None:
    _, opt, sd = _weights()
    outside = tmp_path / "outside.safetensors"  # valid weights: before the check, they loaded
    safetensors.torch.save_file(sd, outside)
    folder = tmp_path / "w"
    (folder / "sub").mkdir(parents=True)
    name = str(outside) if name == "ABS" else name
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": dict.fromkeys(sd, name)}))
    with pytest.raises(ck.CheckpointError) as e:
        ck.import_weights(opt, folder)
    msg = str(e.value)
    assert "\n" not in msg and f"weight_map names {name!r}, which is not a plain file name" in msg


def test_index_weight_map_must_be_an_object(tmp_path: Path) -> None:
    _, opt, _ = _weights()
    (tmp_path / INDEX).write_text(json.dumps({"weight_map": ["model.safetensors"]}))
    with pytest.raises(ck.CheckpointError, match="weight_map is list, expected an object"):
        ck.import_weights(opt, tmp_path / INDEX)


def test_index_with_plain_names_loads(tmp_path: Path) -> None:
    """The ordinary case still works: two shard files beside the index."""
    model, opt, sd = _weights()
    names = sorted(sd)
    half = len(names) // 2
    parts = {"a.safetensors": names[:half], "b.safetensors": names[half:]}
    for f, ns in parts.items():
        safetensors.torch.save_file({n: sd[n] + 1 for n in ns}, tmp_path / f)
    (tmp_path / INDEX).write_text(
        json.dumps({"weight_map": {n: f for f, ns in parts.items() for n in ns}})
    )
    ck.import_weights(opt, tmp_path)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), sd[n] + 1), n
