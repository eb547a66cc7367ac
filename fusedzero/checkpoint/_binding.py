"""The manifest bound to its shards: each shard file's own header says what its bytes mean.

A manifest is checked against a schema (`_manifest.py`) and each shard file against the
manifest's size and sha256. That leaves edits that keep the manifest internally consistent:
two params' segment offsets swapped, a state dtype changed, a shape transposed, a stage that
contradicts the shards. Each would load other data than was saved, with no error. So every
shard file records in its safetensors `__metadata__` what its bytes mean -- one row of `BOUND`
each -- and nothing reads a byte of tensor data before every row matches what the manifest
says (`header_problems`), and every tensor's dtype and shape match what the manifest's modes
and segment tables imply (`tensor_problems`). The sha256 in the manifest binds the header to
the file; these rows bind the manifest to the header.

The check is a table: a new manifest field whose meaning the shard bytes depend on (e.g. a
param's tensor-parallel placement) is one more `Bound` row, written by `shard_metadata` and
checked by `header_problems` with no other change.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from fusedzero.checkpoint._format import SHARD_FORMAT, ST_DTYPE, count_str
from fusedzero.checkpoint._manifest import VERSION, manifest_group_rules, manifest_modes
from fusedzero.state import tensor_fields

# The layout digest's own header key (its value: sha256 of every other row, see `_digest`).
DIGEST = "layout_sha256"


def canonical(v: Any) -> str:
    """One spelling of a JSON value (sorted keys, no spaces): equal values, equal strings."""
    return json.dumps(v, sort_keys=True, separators=(",", ":"))


def _touched(m: dict[str, Any], e: dict[str, Any]) -> list[dict[str, Any]]:
    """The manifest's param entries (name, shape, dtype, group, aliases) this file holds."""
    held = {s[0] for g in e["groups"] for s in g["segments"]}
    return [
        {k: p.get(k) for k in ("index", "name", "shape", "dtype", "group", "aliases")}
        for p in m["params"]
        if p["index"] in held
    ]


class Bound(NamedTuple):
    """One header row: `key` in the shard's `__metadata__`, its expected value from the manifest
    `m` and the file's entry `e`, and the first format version whose shards carry it. An
    `optional` row is there exactly when the manifest has the field of the same name: a
    manifest that drops it, or gains it, no longer matches the digest of the rows."""

    key: str
    value: Callable[[dict[str, Any], dict[str, Any]], str]
    since: int
    optional: bool = False


BOUND: tuple[Bound, ...] = (
    Bound("format", lambda m, e: SHARD_FORMAT, 1),
    Bound("rank", lambda m, e: str(e["rank"]), 1),
    Bound("world_size", lambda m, e: str(m["world_size"]), 1),
    Bound("stage", lambda m, e: str(m["stage"]), 1),
    Bound("step", lambda m, e: str(m["step"]), 1),
    # Since version 1 but not in every such shard: checked when present before version 3.
    Bound("step_count", lambda m, e: count_str(m["step_count"]), 3),
    Bound("modes", lambda m, e: canonical(manifest_modes(m).to_json()), 3),
    Bound("params", lambda m, e: canonical(_touched(m, e)), 3),
    Bound("groups", lambda m, e: canonical(e["groups"]), 3),
    # The tp rank and size of a tensor-parallel optimizer's checkpoint (its tp folder's).
    Bound("tp", lambda m, e: canonical(m["tp"]), 3, optional=True),
)


def _bound(m: dict[str, Any]) -> list[Bound]:
    return [b for b in BOUND if not b.optional or b.key in m]


def _digest(rows: dict[str, str]) -> str:
    return hashlib.sha256(canonical(rows).encode()).hexdigest()


def shard_metadata(m: dict[str, Any], e: dict[str, Any]) -> dict[str, str]:
    """The `__metadata__` of the shard file of entry `e` ({rank, groups}) of manifest `m`
    (`m` needs world_size, stage, step, step_count, modes and params; tp where it has one)."""
    rows = {b.key: b.value(m, e) for b in _bound(m)}
    return {**rows, "version": str(VERSION), DIGEST: _digest(rows)}


def _show(got: str | None, want: str) -> str:
    """(got, expected), cut around the first difference when long (segment tables are)."""
    if got is None or len(got) + len(want) <= 120:
        return f"({got!r}, {want!r})"
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    a = max(0, i - 30)
    return (
        f"(...{got[a : i + 40]!r}..., ...{want[a : i + 40]!r}...) first differing at character {i}"
    )


def header_problems(m: dict[str, Any], e: dict[str, Any], meta: dict[str, str]) -> str | None:
    """Why the header `meta` of entry `e`'s file does not fit manifest `m`, or None. A manifest of
    version < 3 checks the rows its shards carry (`step_count` only when present)."""
    legacy = m["version"] < 3
    rows = _bound(m)
    want = {
        b.key: b.value(m, e)
        for b in rows
        if not legacy or b.since == 1 or (b.key == "step_count" and b.key in meta)
    }
    if not legacy:
        want[DIGEST] = _digest({b.key: want[b.key] for b in rows})
    bad = [k for k, v in want.items() if meta.get(k) != v]
    if not bad:
        return None
    return (
        "header metadata does not match the manifest (the manifest was edited, or it "
        "belongs to other shard files) (got, expected): "
        + "; ".join(f"'{k}': {_show(meta.get(k), want[k])}" for k in bad)
    )


def expected_tensors(
    m: dict[str, Any], e: dict[str, Any]
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Every tensor entry `e`'s file must hold: name -> (dtype, shape)."""
    modes, rules = manifest_modes(m), manifest_group_rules(m)
    out = {}
    for g in e["groups"]:
        for f in tensor_fields(modes, rules[g["group_index"]]):
            out[f"{g['key']}.{f.name}"] = (f.dtype, (f.numel(g["local_numel"]),))
    return out


def tensor_problems(
    m: dict[str, Any], e: dict[str, Any], have: dict[str, tuple[str, list[int]]]
) -> str | None:
    """Why the tensors `have` (name -> (safetensors dtype code, shape), from the file's header)
    differ from what the manifest implies, or None. Read before any tensor is allocated."""
    want = expected_tensors(m, e)
    if set(have) != set(want):
        return f"tensors {sorted(set(have) ^ set(want))} differ from the manifest"
    bad = [
        f"{k} is {have[k][0]} {list(have[k][1])}, the manifest implies {ST_DTYPE[dt]} {list(shape)}"
        for k, (dt, shape) in sorted(want.items())
        if (have[k][0], tuple(have[k][1])) != (ST_DTYPE[dt], shape)
    ]
    return "; ".join(bad) or None
