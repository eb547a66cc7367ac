"""Move in from FSDP2: a `torch.distributed.checkpoint` folder -> a fusedzero checkpoint.

    fusedzero ckpt import-dcp DCP_DIR OUT          # then: checkpoint.load(opt, OUT), any W/stage

The DCP folder is what FSDP2 (`fully_shard`) + `torch.optim.AdamW` write with the distributed
state-dict API (the usual torchtitan / recipe layout):

    model_sd, optim_sd = torch.distributed.checkpoint.state_dict.get_state_dict(model, optim)
    torch.distributed.checkpoint.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=DIR)

Parameters and optimizer state are keyed by the model's parameter names, so the converter needs no
model class: it builds a stand-in module with those names and shapes, puts the params into a
one-rank `ZeroAdamW` as its fp32 master, torch's AdamW state into the AdamW rule's state fields
(fusedzero/rules/_adamw.py; they carry torch's names) and the step into its step count, and writes
it with `fusedzero.checkpoint.save`. Our checkpoints reshard on load, so the run resumes at any
world size and stage with its moments and step intact. The param groups (their params and the rule's
hyper-parameters) are kept: build the resuming ZeroAdamW with the same groups and `checkpoint.load`
restores the hyper-parameters too.

Offline, one process, no process group. Memory: the whole model's params and their AdamW state
in fp32 (consolidated as DCP's `dcp_to_torch_save` does), plus the optimizer's copy.

[Note: no code from a DCP folder] DCP's `.metadata` is a pickle and its non-tensor items
(hyper-parameters) are `torch.load(weights_only=False)` pickles: read as DCP reads them, a
hostile folder runs code. Here `.metadata` goes through `_MetadataUnpickler`, which builds only
the DCP metadata classes, `torch.Size`, dtypes, layouts and plain containers and refuses any
other global by name; the items are read with `torch.load(weights_only=True)`; every storage
file named in it must be a plain name inside the folder; and the tensors it declares must fit
in the folder's bytes before anything is allocated for them.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fusedzero.checkpoint._catalog import read_manifest
from fusedzero.checkpoint._manifest import value_kinds
from fusedzero.checkpoint._saving import save
from fusedzero.rules._adamw import ADAMW
from fusedzero.state import ShardState

__all__ = ["import_dcp", "read_dcp", "read_dcp_metadata"]

# The AdamW rule's hyper-parameters; other keys of torch's param groups (foreach, fused,
# capturable, differentiable, initial_lr) only choose torch's implementation.
HYPER = tuple(ADAMW.defaults)
# master, then the rule's per-param states under torch's names.
KINDS = value_kinds(ADAMW)


# What `.metadata` may build (module, name); anything else is refused with its name.
_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", n)
    for n in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}
# `.metadata` is a few bytes per tensor chunk: 256 MiB is millions of chunks.
_MAX_METADATA = 256 << 20


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(
                f"refused global {module}.{name}: not a torch.distributed.checkpoint metadata class"
            )
        return super().find_class(module, name)


def read_dcp_metadata(d: Path) -> Any:
    """A DCP folder's `.metadata`, unpickled with the allow-list (see [Note: no code from a DCP
    folder]) and checked: plain storage file names, tensor sizes that fit the folder's bytes."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    f = d / ".metadata"
    try:
        with open(f, "rb") as fh:
            raw = fh.read(_MAX_METADATA + 1)
    except OSError as e:
        raise ValueError(f"{f}: unreadable ({e.strerror or e})") from None
    if len(raw) > _MAX_METADATA:
        raise ValueError(f"{f}: larger than {_MAX_METADATA} bytes; not DCP metadata")
    try:
        md = _MetadataUnpickler(io.BytesIO(raw)).load()
    except Exception as e:  # noqa: BLE001 - a malformed pickle raises anything
        raise ValueError(f"{f}: not loadable as DCP metadata: {type(e).__name__}: {e}") from None
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise ValueError(f"{f}: holds a {type(md).__name__}, not DCP Metadata")
    for idx, info in (md.storage_data or {}).items():
        rel = getattr(info, "relative_path", None)
        if (
            not isinstance(rel, str)
            or not rel
            or rel in (".", "..")
            or "/" in rel
            or "\\" in rel
            or "\0" in rel
        ):
            raise ValueError(
                f"{f}: storage file {rel!r} of {getattr(idx, 'fqn', idx)!r} is not "
                "a plain file name inside the DCP folder"
            )
    have = sum(p.stat().st_size for p in d.iterdir() if p.is_file() and not p.is_symlink())
    need = 0
    for k, v in md.state_dict_metadata.items():
        if isinstance(v, TensorStorageMetadata):
            size, dt = v.size, getattr(v.properties, "dtype", None)
            if (
                not isinstance(dt, torch.dtype)
                or not isinstance(size, tuple)
                or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in size)
            ):
                raise ValueError(f"{f}: {k!r} has size {size!r} and dtype {dt!r}")
            need += math.prod(size) * dt.itemsize
    if need > have:
        raise ValueError(f"{f}: declares {need} bytes of tensors, but the folder holds {have}")
    return md


def read_dcp(dcp_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The full (unsharded) state dict of a DCP folder, in this process (no process group),
    running no code from it (see [Note: no code from a DCP folder])."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    d = Path(dcp_dir)
    if not (d / ".metadata").is_file():
        raise ValueError(f"{d}: no .metadata file; not a torch.distributed.checkpoint folder")
    md = read_dcp_metadata(d)

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return md

    refused: list[str] = []

    class Planner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                refused.append(
                    f"{d}: item {read_item.dest_index.fqn!r} is refused: {_first_line(e)}"
                )
                raise ValueError(refused[-1]) from None
            # DefaultLoadPlanner.load_bytes, with the item loaded as above.
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    sd: dict[str, Any] = {}
    try:
        _load_state_dict(sd, storage_reader=Reader(d), planner=Planner(), no_dist=True)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP wraps every error
        # in a CheckpointException (a BaseException) holding a page of traceback
        if refused:
            raise ValueError(refused[0]) from None
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        raise ValueError(
            f"{d}: not a readable DCP folder: {type(e).__name__}: "
            f"{' '.join(lines[-1].split()) if lines else ''}"
        ) from None
    return sd


def _first_line(e: BaseException) -> str:
    """torch's weights_only error is a page; its first line names the refused global."""
    text = str(e)
    for line in text.splitlines():
        if "global" in line.lower() and ("unsupported" in line.lower() or "GLOBAL" in line):
            return " ".join(line.split())
    return " ".join(text.split())[:200]


def _standin(shapes: dict[str, tuple[int, ...]]) -> nn.Module:
    """A module whose named_parameters() are exactly `shapes` (dotted names make submodules)."""
    root = nn.Module()
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, nn.Parameter(torch.zeros(shape, dtype=torch.float32)))
    return root


def _full(t: Any) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def import_dcp(
    dcp_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    model_key: str = "model",
    optim_key: str = "optim",
) -> Path:
    """Convert an FSDP2 + torch.optim.AdamW DCP folder into a fusedzero checkpoint at `out`
    (a checkpoint root: `out/step-N` and `out/latest`, N the AdamW step). Returns the step folder.

    Raises ValueError naming what does not fit: a missing key, amsgrad, params whose AdamW steps
    differ, optimizer state for a name the model state lacks, shapes that disagree."""
    from fusedzero.optim import ZeroAdamW

    sd = read_dcp(dcp_dir)
    for k in (model_key, optim_key):
        if k not in sd:
            raise ValueError(
                f"{dcp_dir}: no {k!r} entry (found {sorted(sd)}); save "
                f"{{'{model_key}': model_sd, '{optim_key}': optim_sd}} from "
                "get_state_dict(model, optim), or pass model_key/optim_key"
            )
    model_sd = {k: _full(v) for k, v in sd[model_key].items()}
    osd = sd[optim_key]
    groups, state = osd["param_groups"], osd["state"]
    names = [n for g in groups for n in g["params"]]
    missing = [n for n in names if n not in model_sd]
    if missing:
        raise ValueError(
            f"{dcp_dir}: the optimizer has params the model state lacks: {missing} "
            "(was optim_sd made by get_state_dict, which keys state by name?)"
        )
    for g in groups:
        if g.get("amsgrad"):
            raise ValueError(
                f"{dcp_dir}: a param group has amsgrad=True; ZeroAdamW has no "
                "amsgrad: the max of the second moment would be lost"
            )
    steps = {float(_full(state[n]["step"])) for n in names if n in state}
    if len(steps) > 1:
        raise ValueError(
            f"{dcp_dir}: AdamW steps differ between params ({sorted(steps)}); "
            "ZeroAdamW keeps one step count"
        )
    step = steps.pop() if steps else 0.0

    module = _standin({n: tuple(model_sd[n].shape) for n in names})
    params = dict(module.named_parameters())
    opt_groups = [
        {
            "params": [params[n] for n in g["params"]],
            **{
                k: (tuple(g[k]) if isinstance(ADAMW.defaults[k], tuple) else g[k])
                for k in HYPER
                if k in g
            },
        }
        for g in groups
    ]
    # One rank, stage 1: its local shard is every param; checkpoint.save writes the manifest.
    opt = ZeroAdamW(opt_groups, stage=1, module=module)
    if opt.world_size != 1:
        raise RuntimeError("import_dcp runs offline: call it with no process group initialised")
    index = {n: i for i, n in enumerate(names)}
    full = ShardState(**{k: [] for k in KINDS}, step_count=step)
    with torch.no_grad():
        for info in opt.shard_infos():
            # A param AdamW never stepped has no state: its states stay zero, as torch's.
            bufs = {k: torch.zeros(info.local_numel, dtype=torch.float32) for k in KINDS}
            for s in info.segments():
                n = names[s.param]
                assert index[n] == s.param
                ranges = [(bufs["master"], model_sd[n])]
                if n in state:
                    ranges += [(bufs[k], _full(state[n][k])) for k in KINDS[1:]]
                for dst, src in ranges:
                    if math.prod(src.shape) != math.prod(model_sd[n].shape):
                        raise ValueError(
                            f"{dcp_dir}: {n} has {src.numel()} optimizer elements "
                            f"for {model_sd[n].numel()} params"
                        )
                    dst[s.local : s.local + s.length].copy_(
                        src.detach().reshape(-1)[s.start : s.start + s.length].float()
                    )
            for k, t in bufs.items():
                full.get(k).append(t)  # type: ignore[union-attr]
    opt.load_shard_state(full)
    return save(opt, out, step=int(step)).wait()


def run_import_dcp(args: argparse.Namespace) -> int:
    """`fusedzero ckpt import-dcp DCP_DIR OUT`."""
    d = import_dcp(args.dcp_dir, args.out)
    print(
        f"wrote {d} (step {read_manifest(d)['step']}); resume with "
        "fusedzero.checkpoint.load(opt, OUT) at any world size and stage"
    )
    return 0
