"""Optimizer state across tp sizes: a tensor-parallel checkpoint root (fusedzero/checkpoint/
_placements.py) loaded at another tp size, tp=1 (a plain model) included.

Param by param, each tp folder's local master and rule state (AdamW: both moments) are read (as
`export` reads them: `weights.read_param`), assembled into the full tensor by the saved placement
(`full_of`: Shard(d) concatenated along d in tp-rank order, _StridedShard chunk by chunk; a
Replicate param from tp rank 0's folder alone), cut to this rank's local tensor by the live
placement (`local_of`) and copied into this rank's segments, as `import_weights` fills masters.
Every value is copied, never recomputed: the state after load is bit-exact. `checkpoint.load` then
commits it as any load (agree, `load_shard_state`), so the dp resharding and the stage are the usual
ones.

Memory: this rank's flat buffers (master and the rule's states, fp32) plus one param's full tensor
and its tp pieces at a time. Only the default memory modes (fp32 master and moments) reshard across
tp; other modes load at the saving tp size.

The record is untrusted: its names and global shapes must equal the live model's, every tp
folder must be bound to it (`placements.check_bound`: an edit that keeps the local shapes
would otherwise assemble other rows), each tp folder's manifest must hold exactly the local
shapes the saved placement gives, and the folders must agree on the step count, before a value
is copied.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fusedzero.checkpoint import _catalog as catalog
from fusedzero.checkpoint._format import Peak
from fusedzero.checkpoint._manifest import (
    CheckpointError,
    manifest_modes,
    manifest_rule,
    value_kinds,
)
from fusedzero.checkpoint._placements import (
    check_bound,
    check_folder,
    describe,
    folder,
    full_of,
    local_of,
    read,
)
from fusedzero.checkpoint._shardfile import ShardReaders, digests
from fusedzero.checkpoint._weights import param_pieces, read_param
from fusedzero.memory_modes import MemoryModes
from fusedzero.state import ShardState

if TYPE_CHECKING:
    from fusedzero.optim import ZeroAdamW


def across_tp(opt: ZeroAdamW, path: Any) -> dict[str, Any] | None:
    """The validated `tensor_parallel.json` of `path` when it is a tp root that `opt` loads
    across tp sizes (saved at another tp size, or `opt` has no tp); None otherwise."""
    rec = read(Path(path))
    if rec is None:
        return None
    tp = getattr(opt, "tp", None)
    return rec if tp is None or tp.size != rec["tp"] else None


def _live(opt: ZeroAdamW) -> tuple[dict[str, dict[str, Any]], int, int]:
    """name -> {shape (global), placement} of the live optimizer's params; tp size and rank."""
    tp = getattr(opt, "tp", None)
    if tp is not None:
        return {p["name"]: p for p in describe(opt)["params"]}, tp.size, tp.rank
    return (
        {
            i.name: {"name": i.name, "shape": list(i.shape), "placement": "R"}
            for i in opt.param_infos()
        },
        1,
        0,
    )


def read_across(
    opt: ZeroAdamW, root: Path, rec: dict[str, Any], peak: Peak, verify: bool
) -> tuple[Path, dict[str, Any], ShardState]:
    """This rank's optimizer state from every tp folder of `root` (see the module docstring):
    (tp rank 0's checkpoint directory, its manifest, the staged state in the default modes).
    Reads only; CheckpointError / ValueError for anything that does not fit."""
    T = rec["tp"]
    live, size, rank = _live(opt)
    saved = {p["name"]: p for p in rec["params"]}
    if set(saved) != set(live):
        raise ValueError(
            f"{root}: params differ: only saved {sorted(set(saved) - set(live))[:5]}"
            f", only live {sorted(set(live) - set(saved))[:5]}"
        )
    for n, p in live.items():
        if saved[n]["shape"] != p["shape"]:
            raise ValueError(
                f"{root}: param {n} has global shape {saved[n]['shape']} in the "
                f"checkpoint, {p['shape']} in the model"
            )
    check_bound(root, rec)  # before any data: the folders were saved with this record
    dirs, manifests, pieces = [], [], []
    for t in range(T):
        # sha256 when read (see [Note: load what was verified] in _shardfile.py)
        d = catalog.verify(folder(root, t, T), checksums=False)
        m = catalog.read_manifest(d)
        modes = manifest_modes(m)
        if modes != MemoryModes():
            raise CheckpointError(
                f"{d}: saved with master={modes.master!r}, states={modes.states!r}; only the "
                "default memory modes (fp32 master and moments) reshard across tp sizes: load "
                f"it at tp={T}, or export_tp + import_weights (weights only)"
            )
        if manifests and m["step_count"] != manifests[0]["step_count"]:
            raise CheckpointError(
                f"{d}: step count {m['step_count']}, tp folder 0 has {manifests[0]['step_count']}"
            )
        check_folder(d, m, rec, t)
        dirs.append(d)
        manifests.append(m)
        pieces.append(param_pieces(m, d))
    entries = [{p["name"]: p for p in m["params"]} for m in manifests]

    infos = opt.shard_infos()
    names = {i.index: (i.name, i.shape) for i in opt.param_infos()}
    kinds = value_kinds(manifest_rule(manifests[0]))
    out = {k: [torch.zeros(info.local_numel, dtype=torch.float32) for info in infos] for k in kinds}
    for bufs in out.values():
        for b in bufs:
            peak.add(b)
    where: dict[int, list[tuple[int, Any]]] = {}  # param index -> (buffer, segment)
    for b, info in enumerate(infos):
        for s in info.segments():
            where.setdefault(s.param, []).append((b, s))
    with contextlib.ExitStack() as stack, torch.no_grad():
        readers = [
            stack.enter_context(ShardReaders(d, digests(m) if verify else None))
            for d, m in zip(dirs, manifests)
        ]
        for idx, segs in sorted(where.items()):
            name, local_shape = names[idx]
            pl, shape = saved[name]["placement"], saved[name]["shape"]
            folders = [0] if pl == "R" else list(range(T))
            for kind in kinds:
                parts = [
                    read_param(readers[t], pieces[t], entries[t][name], kind, peak) for t in folders
                ]
                whole = full_of(
                    [x.view(entries[t][name]["shape"]) for t, x in zip(folders, parts)], pl, shape
                )
                mine = local_of(whole, live[name]["placement"], rank, size).reshape(-1)
                if mine.numel() != math.prod(local_shape):
                    raise CheckpointError(
                        f"{root}: param {name}: {mine.numel()} local "
                        f"elements, the optimizer holds {local_shape}"
                    )
                for b, s in segs:
                    out[kind][b][s.local : s.local + s.length].copy_(
                        mine[s.start : s.start + s.length]
                    )
                for x in parts:
                    peak.sub(x)
    return dirs[0], manifests[0], ShardState(**out)
