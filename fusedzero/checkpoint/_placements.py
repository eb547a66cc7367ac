"""Checkpoints of tensor-parallel optimizers: the mesh and each param's placement.

A checkpoint root of an optimizer whose params are DTensors on a tp mesh of T ranks holds:

    root/tensor_parallel.json    the mesh (dp, tp) and every param's global shape and placement
    root/tp0of2/, root/tp1of2/   one ordinary checkpoint root per tp rank, written by that tp
                                 rank's dp group: its params' local shards, any stage, resharded
                                 along dp on load by the ordinary machinery
    root/tp0of2/tp_binding.json  the folder bound to the record: its tp rank and the sha256 of
                                 the record's canonical JSON (`binding`)
    root/tp0of2/step-.../        each checkpoint's manifest names the tp rank and size that
                                 saved it (`tp_origin`, bound to its shard headers): a step
                                 folder moved into another tp folder is refused (`check_origin`)

`save` and `load` route a tp optimizer into its `tp{t}of{T}` folder (`tp_directory`), after
checking `tensor_parallel.json` against the live model; `export_tp` (fusedzero/checkpoint/
_tp_export.py, also reached by `checkpoint.export` and `fusedzero ckpt export`) writes one
consolidated safetensors file of full tensors (loadable into the unparallelized model, or into
any (dp, tp) layout with `import_weights`, which slices the full tensors by the live
placements: `tp_source`). `load` at another tp size (tp=1, a plain model, included) assembles
the full optimizer state from every tp folder: fusedzero/checkpoint/_tp_reshard.py.

`tensor_parallel.json` is untrusted input: it is parsed against a strict schema (sizes bounded,
placements from a small grammar) and compared with the live model, never used to index files.
The schema cannot see an edit that keeps every local shape (`S(0)` -> `SS(0,2)` on a [8, 6]
weight: each tp rank still holds [4, 6], other rows), and a load across tp sizes or an export
has no live placement to compare with; so each tp folder holds a binding file naming its tp
rank and the digest of the record it was saved with, and `check_bound` compares every folder's
with the record before any data is read (as _binding.py binds a manifest to its shard headers).
A root of record version 1 (before the binding) is refused with the way to convert it:
`fusedzero ckpt upgrade ROOT NEW_ROOT` (fusedzero/checkpoint/_tp_upgrade.py).

[Note: one step across tp folders] Each tp folder is saved by its own dp group; a save killed or
failed after some folders committed leaves their `latest` at different steps, and each tp rank
resolving its own would load a model whose tp slices come from different steps, silently. Where the
folders' newest steps differ, every tp rank takes the newest step all folders hold (a warning names
it), or raises where they share none. Never raises before its collective; after it, every tp rank
raises alike (same data).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fusedzero.checkpoint._binding import canonical
from fusedzero.checkpoint._catalog import list_checkpoints, resolve
from fusedzero.checkpoint._format import write_text_atomic
from fusedzero.checkpoint._manifest import CheckpointError, snippet

TP_FILE = "tensor_parallel.json"
TP_FORMAT = "fusedzero-tensor-parallel"
# 2: each tp folder bound to the record (BINDING_FILE). A version-1 root parses, but loads and
# exports refuse it (`check_bound`); `fusedzero ckpt upgrade` converts it.
TP_VERSION = 2
READABLE_TP_VERSIONS = (1, 2)
BINDING_FILE = "tp_binding.json"
BINDING_FORMAT = "fusedzero-tp-binding"
_MAX_RANKS = 1 << 20  # bounds on what a hostile file may claim
_MAX_PARAMS = 1 << 20
_MAX_DIMS = 8
# Replicate, Shard(dim), _StridedShard(dim, split_factor): "R", "S(0)", "SS(0,3)".
_PLACEMENT = re.compile(r"R|S\((\d)\)|SS\((\d),(\d{1,4})\)")


def placement_str(p: Any) -> str:
    """A DTensor placement as the file writes it."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(p, _StridedShard):
        return f"SS({p.dim},{p.split_factor})"
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Replicate):
        return "R"
    raise ValueError(f"placement {p} cannot be saved (Shard, Replicate or _StridedShard only)")


def describe(opt: Any) -> dict[str, Any]:
    """The tp record of a live optimizer (its `tp` must be set)."""
    tp = opt.tp
    params = []
    for p, info in zip(opt.params, opt.param_infos()):
        pl = tp.placements.get(id(p))
        # A DTensor's shape is the global one; a plain param's from the layout (at stage 3 it
        # is an empty tensor while its unit is freed).
        params.append(
            {
                "name": info.name,
                "shape": list(p.shape if pl else info.shape),
                "placement": "R" if pl is None else placement_str(pl[0]),
            }
        )
    return {
        "format": TP_FORMAT,
        "version": TP_VERSION,
        "tp": tp.size,
        "dp": opt.world_size * opt.replicas,
        "params": params,
    }


def parse(text: str, where: Path) -> dict[str, Any]:
    """`tensor_parallel.json` -> a validated record; CheckpointError for anything malformed."""

    def bad(msg: str) -> CheckpointError:
        return CheckpointError(f"{where}: {msg}")

    try:
        d = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise bad(f"not JSON ({e})") from None
    if not isinstance(d, dict) or d.get("format") != TP_FORMAT:
        raise bad(f"not a {TP_FORMAT} record")
    v = d.get("version")
    if type(v) is not int or v not in READABLE_TP_VERSIONS:
        raise bad(f"version {v!r}, this library reads {READABLE_TP_VERSIONS}")
    for k in ("tp", "dp"):
        v = d.get(k)
        if type(v) is not int or not 1 <= v <= _MAX_RANKS:
            raise bad(f"{k} must be an integer in [1, {_MAX_RANKS}], got {v!r}")
    params = d.get("params")
    if not isinstance(params, list) or len(params) > _MAX_PARAMS:
        raise bad("params must be a list")
    names = set()
    for i, p in enumerate(params):
        if not isinstance(p, dict) or set(p) != {"name", "shape", "placement"}:
            raise bad(f"params[{i}] must have exactly name, shape, placement")
        n, shape, pl = p["name"], p["shape"], p["placement"]
        if not isinstance(n, str) or not n or len(n) > 1000 or n in names:
            raise bad(f"params[{i}].name {n!r} is not a new non-empty name")
        names.add(n)
        if (
            not isinstance(shape, list)
            or len(shape) > _MAX_DIMS
            or not all(type(x) is int and 0 <= x < 1 << 48 for x in shape)
        ):
            raise bad(f"param {n}: shape {shape!r} is not a list of sizes")
        m = _PLACEMENT.fullmatch(pl) if isinstance(pl, str) else None
        if m is None:
            raise bad(f"param {n}: placement {pl!r} is not R, S(d) or SS(d,k)")
        dim = m.group(1) or m.group(2)
        if dim is not None and int(dim) >= len(shape):
            raise bad(f"param {n}: placement {pl} names dim {dim} of a {len(shape)}-D shape")
        if m.group(3) is not None and not 1 <= int(m.group(3)) <= shape[int(dim)]:
            raise bad(f"param {n}: split factor in {pl} out of range")
    return d


def read(root: Path) -> dict[str, Any] | None:
    f = root / TP_FILE
    if f.is_symlink() or (f.exists() and not f.is_file()):
        raise CheckpointError(f"{f}: not a regular file")
    if not f.is_file():
        return None
    if f.stat().st_size > 64 << 20:
        raise CheckpointError(f"{f}: larger than 64 MiB; not a record this library wrote")
    try:
        text = f.read_bytes().decode()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"{f}: unreadable ({type(e).__name__}: "
            f"{snippet(str(e), 120)}); not a record this library wrote"
        ) from None
    return parse(text, f)


def _check_matches(saved: dict[str, Any], live: dict[str, Any], root: Path) -> None:
    if saved["tp"] != live["tp"]:
        raise CheckpointError(
            f"{root} was saved at tp={saved['tp']}, this optimizer has tp={live['tp']}: "
            "checkpoint.load reshards it, but a root holds one tp size: save into another "
            "root"
        )
    mine = {p["name"]: p for p in live["params"]}
    theirs = {p["name"]: p for p in saved["params"]}
    if set(mine) != set(theirs):
        raise CheckpointError(
            f"{root}: params differ: only saved "
            f"{sorted(set(theirs) - set(mine))[:5]}, only live "
            f"{sorted(set(mine) - set(theirs))[:5]}"
        )
    for n, p in mine.items():
        if (theirs[n]["shape"], theirs[n]["placement"]) != (p["shape"], p["placement"]):
            raise CheckpointError(
                f"{root}: param {n} was saved as {theirs[n]['shape']} {theirs[n]['placement']}, "
                f"the model has {p['shape']} {p['placement']}"
            )


def folder(root: Path, t: int, size: int) -> Path:
    """Tp rank t's checkpoint root inside tp root `root` of `size` tp ranks."""
    return root / f"tp{t}of{size}"


def binding(rec: dict[str, Any], t: int) -> dict[str, Any]:
    """What tp folder t's BINDING_FILE holds: its place and the digest of the record."""
    digest = hashlib.sha256(canonical(rec).encode()).hexdigest()
    return {"format": BINDING_FORMAT, "tp_rank": t, "tp": rec["tp"], "record_sha256": digest}


def write_binding(root: Path, rec: dict[str, Any], t: int) -> None:
    """Bind tp folder t of `root` to the record `rec` (written before the folder's first
    checkpoint, so a folder holding one and no binding was not written by this version)."""
    f = folder(root, t, rec["tp"])
    f.mkdir(parents=True, exist_ok=True)
    write_text_atomic(f / BINDING_FILE, json.dumps(binding(rec, t), indent=1))


def _binding_problem(f: Path, want: dict[str, Any]) -> str | None:
    if f.is_symlink() or (f.exists() and not f.is_file()):
        return "not a regular file"
    if not f.is_file():
        return (
            f"missing: the folder is not bound to {TP_FILE} (an incomplete save, or a "
            "folder copied in from elsewhere)"
        )
    if f.stat().st_size > 4096:  # the file this library writes is ~200 bytes
        return "larger than 4 KiB; not a binding this library wrote"
    try:
        got = json.loads(f.read_text())
    except (ValueError, RecursionError, UnicodeDecodeError) as e:
        return f"not JSON ({e})"
    if got != want:
        return (
            f"does not match {TP_FILE} (got {canonical(got)[:200]}, expected "
            f"{canonical(want)}): the record was edited after the folder was saved, or the "
            "folder belongs to another root or tp rank; nothing was read"
        )
    return None


def check_bound(root: Path, rec: dict[str, Any], ranks: range | None = None) -> None:
    """Refuse a root whose tp folders (`ranks`, default all) were not saved with the record
    `rec` (read from `root`): CheckpointError naming the file, before any data is read."""
    if rec["version"] < 2:
        raise CheckpointError(
            f"{root / TP_FILE}: record version {rec['version']}, written before tp folders "
            "were bound to it: its placements cannot be checked against the folders; convert "
            f"the root, if you trust it, with `fusedzero ckpt upgrade {root} NEW_ROOT`"
        )
    for t in range(rec["tp"]) if ranks is None else ranks:
        f = folder(root, t, rec["tp"]) / BINDING_FILE
        why = _binding_problem(f, binding(rec, t))
        if why is not None:
            raise CheckpointError(f"{f}: {why}")


def tp_directory(opt: Any, path: str | os.PathLike[str], *, saving: bool) -> Path:
    """Where this rank's dp group saves or loads: `path` itself without tp, else the root's
    `tp{t}of{T}` folder, after checking (and, saving, writing) `tensor_parallel.json` and the
    folders' bindings. Loading, every rank checks the same files (the record and every tp
    folder's binding), so a mismatch fails on every rank before any collective. Saving, a
    rank checks its own folder's binding, if the folder holds a checkpoint (the other tp
    ranks' folders may not be bound yet on a first save)."""
    root = Path(path)
    tp = getattr(opt, "tp", None)
    if tp is None:
        if saving and read(root) is not None:  # load would read the tp folders, not this save
            raise CheckpointError(
                f"{root} holds a tensor-parallel checkpoint ({TP_FILE}); an optimizer without "
                "tp saves into another root (checkpoint.load reads this one at any tp size)"
            )
        return root
    live = describe(opt)
    saved = read(root)
    mine = folder(root, tp.rank, tp.size)
    if saved is not None:
        _check_matches(saved, live, root)
        if not saving:
            check_bound(root, saved)
        elif saved["version"] < TP_VERSION or (mine.is_dir() and list_checkpoints(mine)):
            check_bound(root, saved, range(tp.rank, tp.rank + 1))
    elif not saving:
        raise CheckpointError(
            f"{root}: no {TP_FILE}; a tensor-parallel optimizer loads the "
            "root that checkpoint.save wrote for it"
        )
    if saving and opt.rank == 0 and opt.replica_rank == 0:
        # The record on disk is what the folder is bound to (its dp may be another run's).
        write_binding(root, live if saved is None else saved, tp.rank)
        if tp.rank == 0 and saved is None:
            write_text_atomic(root / TP_FILE, json.dumps(live, indent=1))
    return mine


def tp_origin(opt: Any) -> dict[str, Any]:
    """The manifest field naming the tp rank and size a tp optimizer saves from ({} without tp):
    a step folder moved into another tp folder is refused (`check_origin`)."""
    tp = getattr(opt, "tp", None)
    return {} if tp is None else {"tp": {"rank": tp.rank, "size": tp.size}}


def check_origin(d: Path, m: dict[str, Any], t: int, size: int) -> None:
    """Checkpoint `d` (manifest `m`) sits in tp folder t of `size`: refuse it if its manifest
    says another tp rank saved it (a checkpoint written before the field: nothing to check;
    a removed field no longer matches the shard headers, _binding.py)."""
    got = m.get("tp")
    if got is not None and got != {"rank": t, "size": size}:
        raise CheckpointError(
            f"{d}: saved by tp rank {got['rank']} of {got['size']}, but it sits in the folder "
            f"of tp rank {t} of {size} (a step folder moved between tp folders); nothing was "
            "read"
        )


def check_folder(d: Path, m: dict[str, Any], rec: dict[str, Any], t: int) -> None:
    """Checkpoint `d` (manifest `m`) of tp folder t was saved there and holds exactly the
    params of the record, each in the local shape its placement gives on tp rank t; else
    CheckpointError."""
    T = rec["tp"]
    check_origin(d, m, t, T)
    saved = {p["name"]: p for p in rec["params"]}
    for p in m["params"]:
        s = saved.get(p["name"])
        want = (
            None
            if s is None
            else list(local_of(torch.empty(s["shape"], device="meta"), s["placement"], t, T).shape)
        )
        if want != p["shape"]:
            raise CheckpointError(
                f"{d}: param {p['name']} has local shape {p['shape']}, "
                f"the record's placement gives {want}"
            )
    if len(m["params"]) != len(saved):
        raise CheckpointError(f"{d}: {len(m['params'])} params, the record has {len(saved)}")


# -- full tensors ----------------------------------------------------------------------------
def _parts(placement: str, full_dim: int) -> tuple[int | None, int]:
    m = _PLACEMENT.fullmatch(placement)
    assert m is not None
    dim = m.group(1) or m.group(2)
    return (None if dim is None else int(dim)), int(m.group(3) or 1)


def local_of(full: torch.Tensor, placement: str, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s local tensor of `full` under `placement` on `size` ranks (torch.chunk's
    split, as DTensor's Shard; _StridedShard(d, k): each of k chunks split so)."""
    dim, k = _parts(placement, full.dim())
    if dim is None:
        return full
    return torch.cat([_chunks(c, size, dim)[rank] for c in _chunks(full, k, dim)], dim)


def _chunks(t: torch.Tensor, n: int, dim: int) -> list[torch.Tensor]:
    """`torch.chunk` padded to exactly n pieces with empty ones, as DTensor's Shard splits."""
    parts = list(t.chunk(n, dim))
    return parts + [t.narrow(dim, 0, 0)] * (n - len(parts))


def full_of(locals_: list[torch.Tensor], placement: str, shape: list[int]) -> torch.Tensor:
    """The inverse of `local_of` over every rank's local tensor; checks the result's shape."""
    dim, k = _parts(placement, len(shape))
    if dim is None:
        for t in locals_[1:]:
            if not torch.equal(t, locals_[0]):
                raise CheckpointError("a Replicate param differs between tp ranks")
        out = locals_[0]
    else:
        chunks = [_chunks(t, k, dim) for t in locals_]
        out = torch.cat([torch.cat([c[j] for c in chunks], dim) for j in range(k)], dim)
    if list(out.shape) != shape:
        raise CheckpointError(f"tp shards assemble to {list(out.shape)}, the record says {shape}")
    return out


def tp_source(opt: Any, source: Any) -> Any:
    """import_weights into a tp optimizer: full tensors (a file or a mapping) as this rank's
    local tensors, sliced by the live placements."""
    tp = getattr(opt, "tp", None)
    if tp is None:
        return source
    if not isinstance(source, Mapping):
        from safetensors.torch import load_file

        source = load_file(str(source))
    live = {p["name"]: p for p in describe(opt)["params"]}
    out = {}
    for n, t in source.items():
        p = live.get(n)
        if p is not None and list(t.shape) == p["shape"]:
            t = local_of(t, p["placement"], tp.rank, tp.size)
        out[n] = t
    return out


def common_step(opt: Any, mine: Path) -> Path:
    """Collective over the tp group: the checkpoint of tp folder `mine` that every tp rank
    loads. See [Note: one step across tp folders]."""
    tp = opt.tp
    newest: Path | None = None
    payload: Any = None
    try:
        newest = resolve(mine)
        payload = (newest.name, sorted(p.name for p in list_checkpoints(mine)))
    except (CheckpointError, OSError):
        pass  # its own error, on the ranks that meet it, comes through load's agree
    everyone: list[Any] = [None] * tp.size
    dist.all_gather_object(everyone, payload, group=tp.group)
    if newest is None or any(p is None for p in everyone):
        return mine
    if len({p[0] for p in everyone}) == 1:
        return newest
    shared = set.intersection(*(set(p[1]) for p in everyone))
    where = ", ".join(f"tp{t}: {p[0]}" for t, p in enumerate(everyone))
    if not shared:
        raise CheckpointError(
            f"{mine.parent}: the tp folders' newest checkpoints differ "
            f"({where}) and no step is in every folder"
        )
    pick = max(shared, key=lambda n: int(n.split("-")[1]))
    if tp.rank == 0 and opt.rank == 0:
        warnings.warn(
            f"{mine.parent}: the tp folders' newest checkpoints differ ({where}; a "
            f"save that did not finish in every folder): loading {pick}, the newest "
            "in every folder",
            stacklevel=3,
        )
    return mine / pick
