"""Schema validation of a checkpoint manifest: checkpoints are untrusted input
(docs/checkpoints.md).

A manifest is read from disk that anyone may have edited, so nothing in it is used before
`validate` has checked the whole of it: every key's presence and type, ranges (ranks inside the
world, offsets inside their tensors), finiteness of every number, plain file names that match
the shard naming, and that the segment tables cover every element of every param exactly once.
The first problem found is raised as one `CheckpointError` naming the field (a JSON path such as
`files[1].groups[0].segments[3][2]`) and what was expected, so callers never see a KeyError,
TypeError or RecursionError from a hostile manifest.

The bottom of the checkpoint package: it imports nothing from it, and `CheckpointError` lives
here (re-exported by `fusedzero.checkpoint`).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from fusedzero import _dtypes as dtypes
from fusedzero.memory_modes import MASTER_MODES, STATE_MODES, MemoryModes
from fusedzero.rules import Rule
from fusedzero.rules._adamw import ADAMW
from fusedzero.rules._muon import MUON

FORMAT = "fusedzero-checkpoint"
# 2: `modes` (memory modes: each state stored in its own dtype, with its scales); a version-1
# manifest has none and its states are fp32 (`manifest_modes`).
# 3: each shard's header records what its bytes mean (`_binding.py`). Versions 1 and 2 are read
# only by the converter (`fusedzero ckpt upgrade`, `_upgrade.py`); loading them is refused.
VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
STEP_DIR = re.compile(r"^step-(\d+)$")
_SHARD = re.compile(r"^rank(\d{5})-of-(\d{5})\.safetensors$")
_KEY = re.compile(r"^fg(\d+)$")
_SHA = re.compile(r"^[0-9a-f]{64}$")
_DTYPES = dtypes.READABLE_NAMES  # float64 too: read, never written
# JSON nesting allowed in the free-form parts (hyper-parameters): deep enough for any real
# value, shallow enough that nothing recurses near Python's limit.
_MAX_DEPTH = 32
# The largest manifest a reader accepts: the largest legitimate one plus MARGIN. That is 1024
# ranks x a 70B model (fusedzero.emulate's llama-70b: 723 params, 70.6e9 elements, two param
# groups) with the default buckets (fusedzero._layout.default_bucket_numel: 1 MiB of each rank's
# shard per bucket, 2**28 fp32 / 2**29 bf16 elements at W=1024) and default stage-3 units (one
# per layer), at the stage and param dtype that spell the most: stage 3 with fp32 params, 162
# flat buffers per rank. Counted from the layouts (fusedzero.plan.model_layouts; recomputed by
# tests/checkpoint/test_scale_ckpt.py): 409 buckets cut the params into 346,656 segments over all
# ranks, each spelled by json.dumps(indent=1) at its depth in at most 78 bytes, and every rank
# lists 162 group entries of at most 156 bytes besides their segments. Each rank's packed RNG
# state is 19,000 bytes of base64 (torch, python, numpy); 64 KiB per rank (state, rank and file
# entries) leaves ~45 KiB for its caller state. Params, hyper-parameters and the fixed fields:
# ~500 bytes per param, 1 MiB. In all 27.0 + 25.9 + 67.1 + 1.0 = 121 MB, 151 MB with the
# margin, held once as text while it is parsed (~2.5x that as Python objects). Smaller buckets
# or finer units multiply the segments or groups: past the cap `save` refuses to write the
# manifest (naming its size), so it never writes one that no reader accepts.
MARGIN = 0.25
_RANKS = 1024
_SEGMENTS, _SEGMENT_BYTES = 346_656, 78
_GROUPS, _GROUP_BYTES = _RANKS * 162, 156
_RANK_BYTES = 64 << 10
_REST_BYTES = 1 << 20
MAX_MANIFEST = int(
    (1 + MARGIN)
    * (_SEGMENTS * _SEGMENT_BYTES + _GROUPS * _GROUP_BYTES + _RANKS * _RANK_BYTES + _REST_BYTES)
)
# `latest` holds one step folder's name ("step-00000120\n"): a few KB is more than plenty.
MAX_LATEST = 4096
# Ints stay below 2**62: products of shapes and offset sums then fit an int64 everywhere.
_MAX_INT = 1 << 62


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or inconsistent with its manifest."""


def parse(text: str, where: Path) -> dict[str, Any]:
    """JSON text -> validated manifest dict; CheckpointError for anything malformed."""
    try:
        m = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise CheckpointError(
            f"{where}: manifest is nested too deeply to be a {FORMAT} manifest"
        ) from None
    except ValueError as e:
        raise CheckpointError(f"{where}: unreadable manifest ({e})") from None
    validate(m, where)
    return m


def manifest_modes(m: dict[str, Any]) -> MemoryModes:
    """The memory modes the states of a validated manifest were saved in."""
    return MemoryModes(**m["modes"]) if "modes" in m else MemoryModes()


# The update rules whose state checkpoints hold, by `Rule.name`: a manifest names its rule in
# `rule`; one without (written before rules were named) holds AdamW state. A rule joins here
# when its checkpoints are supported: its state fields are the tensors of the shard files.
RULES: dict[str, Rule] = {ADAMW.name: ADAMW, MUON.name: MUON}
# `rule` of a manifest whose param groups run different rules: `group_rules` lists each group's
# (a reader that predates it refuses the name instead of reading the shards as AdamW's).
BY_GROUP = "by-group"


def manifest_rule(m: dict[str, Any]) -> Rule:
    """The update rule whose state fields a validated manifest's shards hold; CheckpointError
    for one whose groups run different rules (`manifest_group_rules`)."""
    name = m.get("rule", ADAMW.name)
    if name == BY_GROUP:
        raise CheckpointError(
            f"the checkpoint's param groups run different update rules {m['group_rules']}: "
            "this path reads one rule's state"
        )
    return RULES[name]


def manifest_group_rules(m: dict[str, Any]) -> list[Rule]:
    """The rule of each param group of a validated manifest."""
    if m.get("rule") == BY_GROUP:
        return [RULES[n] for n in m["group_rules"]]
    return [manifest_rule(m)] * len(m["param_groups"])


def rule_names(rules: list[Rule]) -> dict[str, Any]:
    """What a manifest records for an optimizer whose groups run `rules`: `rule`, and where they
    differ `group_rules`; ValueError for a rule whose state checkpoints do not hold (it could be
    saved but never loaded)."""
    for rule in rules:
        if rule.name not in RULES:
            raise ValueError(
                f"checkpoints hold the state of the update rules {sorted(RULES)}, not "
                f"{rule.name!r}: add it to fusedzero/checkpoint/_manifest.py's RULES "
                "(docs/rules.md)"
            )
    names = [r.name for r in rules]
    if len(set(names)) > 1:
        return {"rule": BY_GROUP, "group_rules": names}
    return {"rule": names[0] if names else ADAMW.name}


def value_kinds(rule: Rule) -> tuple[str, ...]:
    """The per-element values of a param a checkpoint of `rule` holds, in any memory mode: the
    master and the rule's value fields (not the block scales, nor the Kahan compensation)."""
    return ("master",) + tuple(
        f.name for f in rule.state_fields(MemoryModes()) if f.scale_of is None
    )


def _no_constant(name: str) -> Any:
    # Python's json accepts NaN/Infinity, which JSON does not: a manifest never holds them.
    raise ValueError(f"{name} is not valid JSON (a manifest holds only finite numbers)")


def plain_name(name: Any, field: str, where: Path) -> str:
    """A file or folder name that stays inside its folder: no separator, not '.', '..'."""
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\0" in name
    ):
        raise CheckpointError(
            f"{where}: {field} is {snippet(name)}; it must be a plain name "
            "inside the checkpoint folder (no '/', '..' or absolute path)"
        )
    return name


def snippet(v: Any, n: int = 40) -> str:
    """At most ~`n` characters of `v` for an error message, escaped: what a file holds is never
    echoed whole (a `latest` linked to a credentials file) nor raw (terminal escapes)."""
    r = ascii(v) if isinstance(v, (str, bytes)) else repr(v)
    return r if len(r) <= n else r[: n - 3] + "..."


class _Check:
    def __init__(self, where: Path) -> None:
        self.where = where

    def fail(self, field: str, msg: str) -> CheckpointError:
        return CheckpointError(f"{self.where}: manifest field {field} {msg}")

    def get(self, obj: dict[str, Any], key: str, field: str) -> Any:
        if key not in obj:
            raise self.fail(f"{field}.{key}" if field else key, "is missing")
        return obj[key]

    def dict_(self, v: Any, field: str) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise self.fail(field, f"is {_short(v)}, expected a JSON object")
        return v

    def list_(self, v: Any, field: str) -> list[Any]:
        if not isinstance(v, list):
            raise self.fail(field, f"is {_short(v)}, expected a JSON list")
        return v

    def int_(self, v: Any, field: str, lo: int = 0, hi: int = _MAX_INT) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.fail(field, f"is {_short(v)}, expected an integer")
        if not lo <= v < hi:
            raise self.fail(field, f"is {v}, expected {lo} <= value < {hi}")
        return v

    def str_(self, v: Any, field: str) -> str:
        if not isinstance(v, str):
            raise self.fail(field, f"is {_short(v)}, expected a string")
        return v

    def number(self, v: Any, field: str) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self.fail(field, f"is {_short(v)}, expected a finite number")
        return float(v)

    def free(self, v: Any, field: str, depth: int = 0) -> None:
        """Free-form JSON (hyper-parameters): bounded depth, finite numbers."""
        if depth > _MAX_DEPTH:
            raise self.fail(field, f"is nested deeper than {_MAX_DEPTH} levels")
        if isinstance(v, float) and not math.isfinite(v):
            raise self.fail(field, f"is {v}, expected a finite number")
        if isinstance(v, list):
            for i, x in enumerate(v):
                self.free(x, f"{field}[{i}]", depth + 1)
        elif isinstance(v, dict):
            for k, x in v.items():
                self.free(x, f"{field}.{k}", depth + 1)


def _short(v: Any) -> str:
    return f"{type(v).__name__} {snippet(v)}"


def validate(m: Any, where: Path) -> None:
    """Raise CheckpointError naming the first field of manifest `m` that is malformed."""
    c = _Check(where)
    if not isinstance(m, dict):
        raise CheckpointError(f"{where}: not a JSON object")
    if m.get("format") != FORMAT:
        raise CheckpointError(
            f"{where}: not a {FORMAT} manifest (format={_short(m.get('format'))})"
        )
    if m.get("version") not in READABLE_VERSIONS or isinstance(m.get("version"), bool):
        raise CheckpointError(
            f"{where}: format version {m.get('version')!r}, this fusedzero "
            f"reads versions {list(READABLE_VERSIONS)}"
        )
    if "modes" in m:
        modes = c.dict_(m["modes"], "modes")
        for key, allowed in (("master", MASTER_MODES), ("states", STATE_MODES)):
            if c.get(modes, key, "modes") not in allowed:
                raise c.fail(
                    f"modes.{key}", f"is {_short(modes[key])}, expected one of {list(allowed)}"
                )
    if "rule" in m and m["rule"] not in RULES and m["rule"] != BY_GROUP:
        raise c.fail("rule", f"is {_short(m['rule'])}, expected one of {sorted(RULES)}")
    if m.get("rule") == BY_GROUP:
        names = c.list_(c.get(m, "group_rules", ""), "group_rules")
        if any(not isinstance(n, str) or n not in RULES for n in names):
            raise c.fail("group_rules", f"is {_short(names)}, each one of {sorted(RULES)}")
        n_groups = len(c.list_(c.get(m, "param_groups", ""), "param_groups"))
        if len(names) != n_groups:
            raise c.fail("group_rules", f"has {len(names)} entries for {n_groups} param groups")
    W = c.int_(c.get(m, "world_size", ""), "world_size", 1, 1 << 20)
    c.int_(c.get(m, "stage", ""), "stage", 0, 4)
    c.int_(c.get(m, "step", ""), "step")
    sc = c.number(c.get(m, "step_count", ""), "step_count")
    if sc < 0 or sc != int(sc) or sc >= 2**53:
        raise c.fail("step_count", f"is {sc}, expected a whole number of steps >= 0")
    if m.get("bucket_numel") is not None:
        c.int_(m["bucket_numel"], "bucket_numel", 1)
    if m.get("param_dtype") is not None and m["param_dtype"] not in _DTYPES:
        raise c.fail(
            "param_dtype", f"is {_short(m['param_dtype'])}, expected null or one of {list(_DTYPES)}"
        )
    if "seed" in m:
        c.int_(m["seed"], "seed", -(1 << 63), 1 << 63)
    if "created" in m:
        c.number(m["created"], "created")
    if "tp" in m:  # saved by a tensor-parallel optimizer: its tp rank and size
        tp = c.dict_(m["tp"], "tp")
        size = c.int_(c.get(tp, "size", "tp"), "tp.size", 1, 1 << 20)
        c.int_(c.get(tp, "rank", "tp"), "tp.rank", 0, size)
        if set(tp) != {"rank", "size"}:
            raise c.fail("tp", f"has keys {sorted(tp)}, expected ['rank', 'size']")

    params = c.list_(c.get(m, "params", ""), "params")
    numels: list[int] = []
    names: dict[str, str] = {}  # every name or alias -> the field that declared it
    for i, p in enumerate(params):
        f = f"params[{i}]"
        c.dict_(p, f)
        if c.int_(c.get(p, "index", f), f"{f}.index") != i:
            raise c.fail(f"{f}.index", f"is {p['index']}, expected {i} (params in index order)")
        nm = c.str_(c.get(p, "name", f), f"{f}.name")
        shape = c.list_(c.get(p, "shape", f), f"{f}.shape")
        numel = 1
        for j, s in enumerate(shape):
            numel *= c.int_(s, f"{f}.shape[{j}]", 0, 1 << 40)
            if numel >= _MAX_INT:
                raise c.fail(f"{f}.shape", f"is {shape}: more elements than any tensor holds")
        numels.append(numel)
        if c.str_(c.get(p, "dtype", f), f"{f}.dtype") not in _DTYPES:
            raise c.fail(f"{f}.dtype", f"is {p['dtype']!r}, expected one of {list(_DTYPES)}")
        n_rules = len(m["group_rules"]) if m.get("rule") == BY_GROUP else _MAX_INT
        c.int_(c.get(p, "group", f), f"{f}.group", 0, n_rules)
        aliases = c.list_(p.get("aliases", []), f"{f}.aliases")
        for j, a in enumerate([nm, *aliases]):
            af = f"{f}.name" if j == 0 else f"{f}.aliases[{j - 1}]"
            c.str_(a, af)
            if a in names:
                raise c.fail(af, f"is {a!r}, a name {names[a]} already has")
            names[a] = af

    groups = c.list_(c.get(m, "param_groups", ""), "param_groups")
    primary = {p["name"] for p in params}
    group_of: dict[str, int] = {}
    for gi, g in enumerate(groups):
        f = f"param_groups[{gi}]"
        c.dict_(g, f)
        for k, v in g.items():
            c.free(v, f"{f}.{k}")
        for j, n in enumerate(c.list_(c.get(g, "param_names", f), f"{f}.param_names")):
            nf = f"{f}.param_names[{j}]"
            if c.str_(n, nf) not in primary:
                raise c.fail(nf, f"is {n!r}, which is no name in params")
            if group_of.get(n) == gi:
                raise c.fail(nf, f"lists {n!r} twice in the same param group")
            if n in group_of:
                raise c.fail(nf, f"lists {n!r}, which param_groups[{group_of[n]}] lists too")
            group_of[n] = gi

    scaler = m.get("scaler")
    if scaler is not None:
        c.dict_(scaler, "scaler")
        if c.number(c.get(scaler, "scale", "scaler"), "scaler.scale") <= 0:
            raise c.fail("scaler.scale", f"is {scaler['scale']}, expected > 0")
        c.int_(c.get(scaler, "growth_tracker", "scaler"), "scaler.growth_tracker", 0, 1 << 31)

    files = c.list_(c.get(m, "files", ""), "files")
    covered: list[list[tuple[int, int, str]]] = [[] for _ in params]
    seen_ranks: dict[int, int] = {}
    for fi, e in enumerate(files):
        f = f"files[{fi}]"
        c.dict_(e, f)
        name = plain_name(c.get(e, "name", f), f"manifest field {f}.name", where)
        r = c.int_(c.get(e, "rank", f), f"{f}.rank", 0, W)
        mt = _SHARD.match(name)
        if mt is None or (int(mt.group(1)), int(mt.group(2))) != (r, W):
            raise c.fail(
                f"{f}.name",
                f"is {name!r}, expected "
                f"'rank{r:05d}-of-{W:05d}.safetensors' (rank {r} of world size {W})",
            )
        if r in seen_ranks:
            raise c.fail(f"{f}.rank", f"is {r}, which files[{seen_ranks[r]}] has too")
        seen_ranks[r] = fi
        c.int_(c.get(e, "bytes", f), f"{f}.bytes")
        sha = c.str_(c.get(e, "sha256", f), f"{f}.sha256")
        if not _SHA.match(sha):
            raise c.fail(f"{f}.sha256", f"is {sha[:70]!r}, expected 64 lowercase hex digits")
        keys: set[str] = set()
        for gi, g in enumerate(c.list_(c.get(e, "groups", f), f"{f}.groups")):
            gf = f"{f}.groups[{gi}]"
            c.dict_(g, gf)
            key = c.str_(c.get(g, "key", gf), f"{gf}.key")
            if not _KEY.match(key) or key in keys:
                raise c.fail(f"{gf}.key", f"is {key!r}, expected a unique 'fg<i>'")
            keys.add(key)
            # With a rule per group, group_index picks the rule of the shard's fields.
            n_rules = len(m["group_rules"]) if m.get("rule") == BY_GROUP else _MAX_INT
            c.int_(c.get(g, "group_index", gf), f"{gf}.group_index", 0, n_rules)
            if c.str_(c.get(g, "dtype", gf), f"{gf}.dtype") not in _DTYPES:
                raise c.fail(f"{gf}.dtype", f"is {g['dtype']!r}, expected one of {list(_DTYPES)}")
            unit = g.get("unit")
            if unit is not None and not isinstance(unit, (int, str)) or isinstance(unit, bool):
                raise c.fail(f"{gf}.unit", f"is {_short(unit)}, expected null, int or string")
            local_numel = c.int_(c.get(g, "local_numel", gf), f"{gf}.local_numel")
            for si, s in enumerate(c.list_(c.get(g, "segments", gf), f"{gf}.segments")):
                sf = f"{gf}.segments[{si}]"
                if not isinstance(s, list) or len(s) != 4:
                    raise c.fail(sf, f"is {_short(s)}, expected [param, start, length, local]")
                p = c.int_(s[0], f"{sf}[0]", 0, max(1, len(params)))
                if p >= len(params):
                    raise c.fail(f"{sf}[0]", f"is {p}, but there are no params")
                start = c.int_(s[1], f"{sf}[1]")
                length = c.int_(s[2], f"{sf}[2]", 1)
                local = c.int_(s[3], f"{sf}[3]")
                if start + length > numels[p]:
                    raise c.fail(
                        sf,
                        f"is {s}: elements [{start}, {start + length}) lie outside "
                        f"{params[p]['name']} ({numels[p]} elements)",
                    )
                if local + length > local_numel:
                    raise c.fail(
                        sf,
                        f"is {s}: local elements [{local}, {local + length}) lie "
                        f"outside the shard's {local_numel}",
                    )
                covered[p].append((start, length, sf))
    _check_coverage(c, params, numels, covered)
    # Stage 0: every rank holds the same state and rank 0 alone writes it; stages 1-3: each
    # rank writes its own shard. Other files would load as another layout than was saved.
    want = [0] if m["stage"] == 0 else list(range(W))
    if sorted(seen_ranks) != want:
        raise c.fail(
            "files",
            f"has shards of ranks {sorted(seen_ranks)[:8]}, but stage "
            f"{m['stage']} at world size {W} writes ranks "
            f"{want if len(want) <= 8 else f'0..{W - 1}'}",
        )

    ranks = c.list_(c.get(m, "ranks", ""), "ranks")
    seen: set[tuple[int, int]] = set()
    for ri, e in enumerate(ranks):
        f = f"ranks[{ri}]"
        c.dict_(e, f)
        key = (
            c.int_(c.get(e, "rank", f), f"{f}.rank", 0, W),
            c.int_(e.get("replica", 0), f"{f}.replica", 0, 1 << 20),
        )
        if key in seen:
            raise c.fail(f, f"repeats rank {key[0]} replica {key[1]}")
        seen.add(key)
        c.str_(c.get(e, "state", f), f"{f}.state")


def _check_coverage(
    c: _Check,
    params: list[dict[str, Any]],
    numels: list[int],
    covered: list[list[tuple[int, int, str]]],
) -> None:
    """Every element of every param in exactly one segment (the shards partition the model)."""
    for i, segs in enumerate(covered):
        end = 0
        for start, length, sf in sorted(segs):
            if start < end:
                raise c.fail(
                    sf,
                    f"overlaps another segment of {params[i]['name']} at element "
                    f"{start}: every element must be saved exactly once",
                )
            if start > end:
                break
            end = start + length
        if end != numels[i]:
            raise c.fail(
                "files",
                f"segments cover elements [0, {end}) of {params[i]['name']}, "
                f"which has {numels[i]}: every element must be saved exactly once",
            )
