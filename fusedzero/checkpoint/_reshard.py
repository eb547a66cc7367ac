"""Resharding: which slices of which saved shards fill this rank's new local shards.

A saved segment `[param, start, length, local]` and a new one overlap in a run of elements; every
overlap becomes one read (file, tensor key, source offset, destination offset, length). Reads
that continue each other are merged, so loading at the saving layout is one slice per tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from fusedzero._layout import Segment, intersect
from fusedzero.checkpoint._manifest import CheckpointError

if TYPE_CHECKING:
    from fusedzero.state import ShardInfo


class Read(NamedTuple):
    """Copy `length` elements of `file`'s `{key}.<kind>` from `src` to `dst` of a local shard."""

    file: str
    key: str
    src: int
    dst: int
    length: int


def match_params(
    manifest: dict[str, Any], table: dict[int, tuple[str, tuple[int, ...]]], d: Path
) -> dict[int, int]:
    """saved param index -> new param index, matched by name; ValueError lists differences."""
    saved = {p["name"]: (p["index"], tuple(p["shape"])) for p in manifest["params"]}
    new = {name: (i, shape) for i, (name, shape) in table.items()}
    diffs = []
    only_model = [n for n in new if n not in saved]
    only_ckpt = [n for n in saved if n not in new]
    if only_model:
        diffs.append(f"in the model, not in the checkpoint: {only_model}")
    if only_ckpt:
        diffs.append(f"in the checkpoint, not in the model: {only_ckpt}")
    for n, (_, shape) in new.items():
        if n in saved and saved[n][1] != shape:
            diffs.append(
                f"{n}: shape {list(saved[n][1])} in the checkpoint, {list(shape)} in the model"
            )
    if diffs:
        raise ValueError(
            f"checkpoint {d} does not match this model's parameters:\n  " + "\n  ".join(diffs)
        )
    return {saved[n][0]: new[n][0] for n in new}


def plan(
    infos: list[ShardInfo],
    table: dict[int, tuple[str, tuple[int, ...]]],
    manifest: dict[str, Any],
    mapping: dict[int, int],
) -> list[list[Read]]:
    """Per buffer of `infos`: the reads covering exactly every element of this rank's new
    segments (`table`: param index -> (name, shape), for the error message)."""
    saved: list[Segment] = []
    source: dict[int, tuple[str, str]] = {}  # id(saved segment) -> (file, tensor key)
    for e in manifest["files"]:
        for g in e["groups"]:
            for p, start, length, local in g["segments"]:
                seg = Segment(mapping[p], start, length, e["rank"], local)
                saved.append(seg)
                source[id(seg)] = (e["name"], g["key"])
    out = []
    for info in infos:
        segs = info.segments()
        covered = dict.fromkeys(range(len(segs)), 0)
        pos = {id(s): i for i, s in enumerate(segs)}
        reads = []
        for sa, sb, start, length in intersect(segs, saved):
            fname, key = source[id(sb)]
            reads.append(
                Read(fname, key, sb.local + start - sb.start, sa.local + start - sa.start, length)
            )
            covered[pos[id(sa)]] += length
        for i, s in enumerate(segs):
            if covered[i] != s.length:
                raise CheckpointError(
                    f"the checkpoint's segment tables cover {covered[i]} of the {s.length} "
                    f"elements [{s.start}, {s.start + s.length}) of {table[s.param][0]}"
                )
        out.append(merge(reads))
    return out


def merge(reads: list[Read]) -> list[Read]:
    """Join reads that continue each other in both source and destination (fewer slices)."""
    out: list[Read] = []
    for r in sorted(reads, key=lambda r: (r.file, r.key, r.src)):
        if out:
            last = out[-1]
            if (
                (last.file, last.key) == (r.file, r.key)
                and last.src + last.length == r.src
                and last.dst + last.length == r.dst
            ):
                out[-1] = last._replace(length=last.length + r.length)
                continue
        out.append(r)
    return out
