"""Load: read a checkpoint into an optimizer at any world size or stage, transactionally.

Plan (`reshard.plan`), read every slice into host staging buffers, agree across ranks, and only
then write the optimizer through `opt.load_shard_state` (see [Note: transactional load]).

[Note: transactional load] Every rank first reads all it needs (master, the rule's state, its
caller and RNG state, the hyper-parameters) into staging buffers on the host, then the ranks agree
on success in one collective, and only then is the optimizer written. So a read error on any rank
(a corrupt slice, a file gone after planning) raises the same error on every rank, nobody is left
waiting in a later collective, and the optimizer is untouched everywhere. The cost: this rank's
shard buffers, as saved, are held on the host at once (`peak_buffer_bytes` reports it).

[Note: bound hyper-parameters] Of the hyper-parameters, the numbers (lr, weight_decay, any numeric
group key or tuple of numbers) are restored; the switches and names (maximize: a manifest edited to
`true` would train by gradient ascent) are the constructor's: a manifest whose value differs is
refused (CheckpointError naming the field). With `load_hyperparams=False` (`fusedzero train
--resume`) none of them is read."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from fusedzero.checkpoint._catalog import (
    file_problems,
    link_problem,
    name_problem,
    open_problem,
    read_manifest,
    resolve,
)
from fusedzero.checkpoint._collectives import agree
from fusedzero.checkpoint._format import MANIFEST, Peak
from fusedzero.checkpoint._manifest import (
    VERSION,
    CheckpointError,
    manifest_group_rules,
    manifest_modes,
    manifest_rule,
    snippet,
)
from fusedzero.checkpoint._optview import group_names, param_table
from fusedzero.checkpoint._placements import check_origin, common_step, tp_directory
from fusedzero.checkpoint._rank_state import decode, set_rng_state
from fusedzero.checkpoint._reshard import Read, match_params, plan
from fusedzero.checkpoint._saving import wait_pending
from fusedzero.checkpoint._shardfile import ShardFile, Slice
from fusedzero.checkpoint._tp_reshard import across_tp, read_across
from fusedzero.memory_modes import QBLOCK
from fusedzero.rules import Rule
from fusedzero.state import ShardState, tensor_fields

if TYPE_CHECKING:
    from fusedzero.optim import ZeroAdamW
    from fusedzero.state import ShardInfo


class Loaded(NamedTuple):
    """What `load` restored besides the optimizer."""

    path: Path  # the checkpoint directory read
    step: int  # the caller's step passed to save
    caller_state: Any  # this rank's caller_state (None when the saving run had no such rank)
    rng_restored: bool  # this rank's RNG states were restored
    peak_buffer_bytes: int  # peak bytes of staging buffers (see format.Peak), this rank


def load(
    opt: ZeroAdamW,
    path: str | os.PathLike[str],
    *,
    verify: bool = True,
    restore_rng: bool = True,
    load_hyperparams: bool = True,
    check_caller: Callable[[Any], None] | None = None,
) -> Loaded:
    """Load a checkpoint into `opt` at any world size and stage. Collective and transactional.

    `path` is a checkpoint directory or a root, whose `latest` names the one loaded (a broken
    `latest` is an error here; `find_latest` is what falls back, with its reasons). The
    manifest is validated against the format's schema first, and the folder's name against its
    step. The saved param
    table must match the optimizer's (by name and shape) or ValueError lists the differences.
    Each rank opens only the shard files that hold its new segments, verifies them (size and
    header always; sha256 with `verify`, of the very bytes it stages: see [Note: load what was
    verified] in _shardfile.py), and reads only the overlapping slices (with `verify`, the whole
    file streams through one reused buffer to be hashed).

    All or nothing on every rank: see [Note: transactional load].

    Memory modes: the states are read in the modes they were saved in and converted into this
    optimizer's (`Precision(master=, states=)`; see [Note: converting masters] in
    fusedzero/memory_modes.py): the same modes load bit-exactly, others through fp32 (fp32
    master into bf16-kahan: param = rne(master), comp = rne(master - param); back: master =
    param + comp).

    Restores master (and the params), the rule's state (AdamW: both moments), the step count,
    the loss scaler, and (with `load_hyperparams`, when the param groups hold the same params)
    the hyper-parameters; with `restore_rng`, this rank's saved RNG states if the saving run had
    this rank (with a `Groups(replicate=)`, this rank of this replica).

    See [Note: bound hyper-parameters].

    Everything is checked before anything is written, on every rank: the saved
    hyper-parameters with the constructor's rules (the rule's `check_group`), and,
    with `check_caller`, this rank's caller state (None where the saving run had no such rank):
    it raises (ValueError, TypeError, CheckpointError) to refuse it, on every rank.
    """
    W, rank, group = opt.world_size, opt.rank, opt.process_group
    err: BaseException | None = None
    d = Path(path)
    manifest: dict[str, Any] = {}
    staged = ShardState()
    infos = opt.shard_infos()
    groups: list[dict[str, Any]] | None = None
    state: dict[str, Any] | None = None
    peak = Peak()
    try:  # everything before `agree`: an error on some ranks only reaches every rank there
        across = across_tp(opt, path)  # a tp root saved at another tp size (_tp_reshard.py)
        if across is None:
            path = tp_directory(opt, path, saving=False)  # tp: this tp rank's folder
            if getattr(opt, "tp", None) is not None:  # See [Note: one step across tp folders]
                path = common_step(opt, Path(path))
        wait_pending(opt)
        if across is not None:
            d, manifest, staged = read_across(opt, Path(path), across, peak, verify)
        else:
            d = resolve(path)
            manifest = read_manifest(d)
            tp = getattr(opt, "tp", None)
            if tp is not None:
                check_origin(d, manifest, tp.rank, tp.size)
            table = param_table(opt)
            reads = plan(infos, table, manifest, match_params(manifest, table, d))
            named = name_problem(d, manifest)
            if named is not None:
                raise CheckpointError(named)
            if manifest["version"] < VERSION:  # one problem: convert it
                raise CheckpointError(file_problems(d, manifest, [], False)[0])
            rules = _rules(opt, d, manifest)
            staged = _read_staged(d, manifest, infos, reads, peak, verify, rules)
        _check_values(staged, d, opt.group_rules)
        if load_hyperparams:
            groups = _staged_groups(opt, manifest["param_groups"], d)
        state = _staged_state(manifest, rank, opt.replica_rank, d, restore_rng)
        if check_caller is not None:
            check_caller(None if state is None else state.get("caller"))
    except Exception as e:  # noqa: BLE001 - every rank must learn of it
        err = e
    # The collective that decides: commit or raise. With a replicate_group the replicas agree
    # too, so no replica commits while another raises (they would no longer hold the same).
    try:
        agree(err, group, W, "load")
        err = None
    except Exception as e:  # noqa: BLE001
        err = e
    tp = getattr(opt, "tp", None)
    if tp is not None:  # and the tp ranks: no tp rank commits while another raises
        try:
            agree(err, tp.group, tp.size, "load (across tp ranks)")
            err = None
        except Exception as e:  # noqa: BLE001
            err = e
    replicas = opt.replicas
    if replicas > 1:
        agree(err, opt.replicate_group, replicas, "load (across replicas)")
    elif err is not None:
        raise err

    staged.step_count = manifest["step_count"]
    staged.scaler = manifest.get("scaler")  # applied only when this optimizer has a scaler
    opt.load_shard_state(staged)  # collective at stages 1-3 (it gathers the params)
    if groups is not None:
        for g, new in zip(opt.param_groups, groups):
            for k, v in new.items():
                if isinstance(g.get(k), torch.Tensor):
                    g[k].fill_(v)
                else:
                    g[k] = v
    caller, restored = None, False
    if state is not None:
        caller = state.get("caller")
        if restore_rng and "rng" in state:
            set_rng_state(state["rng"])
            restored = True
    return Loaded(d, manifest["step"], caller, restored, peak.peak)


def _read_staged(
    d: Path,
    manifest: dict[str, Any],
    infos: list[ShardInfo],
    plan: list[list[Read]],
    peak: Peak,
    verify: bool,
    rules: list[Rule],
) -> ShardState:
    """Every buffer's state from the shard files, on the host, as it was saved (the manifest's
    modes: `load_shard_state` converts it into the optimizer's). Each file is opened once, its
    size and header checked against the manifest, and its slices read into the staging
    buffers; with `verify`, in the same pass that hashes it, so what is staged is what was
    verified (see [Note: load what was verified] in _shardfile.py).

    int8 scales are read block by block: a quantization block is QBLOCK elements of one param
    from a multiple of QBLOCK of it at any world size (params and shard pieces start at
    multiples of the layout's ALIGN = QBLOCK), so every read starts on a block and its scales
    are those of blocks [src, src + n) / QBLOCK."""
    saved = manifest_modes(manifest)
    # Each buffer reads its group's rule's fields (None for another rule's).
    names = dict.fromkeys(f.name for r in rules for f in tensor_fields(saved, r))
    out: dict[str, list[torch.Tensor | None]] = {name: [] for name in names}
    by_file: dict[str, list[Slice]] = {}
    for info, reads in zip(infos, plan, strict=True):
        fields = tensor_fields(saved, rules[info.group_index])
        for name in names:
            if all(f.name != name for f in fields):
                out[name].append(None)
        for f in fields:
            kind, scale = f.name, f.per != 1
            dst = peak.add(torch.zeros(f.numel(info.local_numel), dtype=f.dtype))
            out[kind].append(dst)
            for fname, key, src, dl, n in reads:
                if scale:
                    if src % QBLOCK or dl % QBLOCK:
                        raise CheckpointError(
                            f"{d / fname}: {key} segment at local {src} is not on a "
                            f"{QBLOCK}-element block, so its int8 scales cannot be resharded"
                        )
                    src, dl, n = src // QBLOCK, dl // QBLOCK, -(-n // QBLOCK)
                by_file.setdefault(fname, []).append(Slice(f"{key}.{kind}", src, dst[dl : dl + n]))
    entries = {e["name"]: e for e in manifest["files"]}
    for fname, slices in sorted(by_file.items()):
        p, entry = d / fname, entries[fname]
        try:
            why = link_problem(p)
            if why is None:
                with ShardFile(p) as f:
                    why = open_problem(f, manifest, entry)
                    got = f.read_slices(slices, hashed=verify) if why is None else ""
                if why is None and verify and got != entry["sha256"]:
                    why = f"{p}: sha256 mismatch (expected {entry['sha256']}, got {got})"
        except CheckpointError as e:
            why = str(e)
        except OSError as e:  # an I/O error mid-read
            why = f"{p}: cannot read ({e.strerror or e})"
        if why is not None:
            raise CheckpointError(f"checkpoint {d}:\n  {why}")
    return ShardState(**out, modes=saved)


def _rules(opt: ZeroAdamW, d: Path, manifest: dict[str, Any]) -> list[Rule]:
    """Each param group's rule, whose state the checkpoint must hold for every param the group
    holds: one rule for all (the optimizer's must be the checkpoint's), or, where groups run
    different rules, each saved param's group's rule equal to its group's here."""
    saved = manifest_group_rules(manifest)
    if opt.rule is not None and len({r.name for r in saved}) <= 1:
        rule = saved[0] if saved else manifest_rule(manifest)
        if rule.name != opt.rule.name:
            raise CheckpointError(
                f"checkpoint {d} holds {rule.name} state, this optimizer runs {opt.rule.name}"
            )
        return [rule] * len(opt.param_groups)
    mine = {i.name: opt.group_rules[i.group_index].name for i in opt.param_infos()}
    for p in manifest["params"]:
        had = saved[p["group"]].name
        if p["name"] in mine and mine[p["name"]] != had:
            raise CheckpointError(
                f"checkpoint {d} holds {had} state for {p['name']}, which this optimizer "
                f"updates with {mine[p['name']]}"
            )
    return list(opt.group_rules)


def _check_values(staged: ShardState, d: Path, rules: list[Rule]) -> None:
    """Every staged float finite, every state the rule keeps non-negative (an unsigned field,
    e.g. AdamW's second moment) >= 0: a NaN or Inf (a diverged run, an edited shard whose sha256
    was updated too) would train the params to NaN, and the next save would make it `latest`.
    One pass over the staging buffers, on the host."""
    unsigned = {f.name for r in rules for f in r.state_fields(staged.modes) if not f.signed}
    for kind in staged.names():
        for i, t in enumerate(staged.get(kind) or ()):
            if t is None or not t.is_floating_point():
                continue  # int8 codes: every value is one
            bad = ~torch.isfinite(t)
            if kind in unsigned:
                bad |= t < 0
            n = int(bad.sum())
            if n:
                j = int(bad.nonzero()[0, 0])
                raise CheckpointError(
                    f"checkpoint {d}: its {kind} (buffer {i}) holds {n} value(s) that are "
                    f"{'negative or ' if kind in unsigned else ''}not finite, the first "
                    f"{float(t[j])} at element {j}: saved from a diverged run or edited; "
                    "resume from an earlier step"
                )


def _staged_state(
    manifest: dict[str, Any], rank: int, replica: int, d: Path, check_rng: bool
) -> dict[str, Any] | None:
    """This rank's saved caller and RNG state (this replica's with a replicate_group), decoded
    and checked; None when the saving run had no such rank."""
    ranks = manifest["ranks"]
    entry = next((e for e in ranks if e["rank"] == rank and e.get("replica", 0) == replica), None)
    if entry is None:
        return None
    return decode(entry["state"], f"{d / MANIFEST}: ranks[{ranks.index(entry)}].state", check_rng)


def _staged_groups(
    opt: ZeroAdamW, saved: list[dict[str, Any]], d: Path
) -> list[dict[str, Any]] | None:
    """The saved hyper-parameters, typed like the optimizer's own, or None when the saved
    groups hold other params. CheckpointError when a value does not fit (e.g. a string lr)."""
    if [g.get("param_names") for g in saved] != group_names(opt):
        return None
    out = []
    for i, (g, s) in enumerate(zip(opt.param_groups, saved)):
        new: dict[str, Any] = {}
        for k, v in s.items():
            if k == "param_names" or k not in g:
                continue
            cur = g[k]
            field = f"{d / MANIFEST}: param_groups[{i}].{k}"
            if isinstance(cur, (torch.Tensor, float)) or (
                isinstance(cur, int) and not isinstance(cur, bool)
            ):
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise CheckpointError(f"{field} is {snippet(v)}, expected a number")
                new[k] = v
            elif isinstance(cur, bool) or cur is None or isinstance(cur, str):
                # See [Note: bound hyper-parameters]
                if v != cur or type(v) is not type(cur):
                    raise CheckpointError(
                        f"{field} is {snippet(v)}, this optimizer has {cur!r}: a checkpoint "
                        f"restores numbers (lr, weight_decay, ...), not switches; "
                        f"construct {type(opt).__name__}({k}={snippet(v)}) to load it as saved, or "
                        "load_hyperparams=False to keep this optimizer's own"
                    )
            elif isinstance(cur, tuple):
                if (
                    not isinstance(v, list)
                    or len(v) != len(cur)
                    or any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in v)
                ):
                    raise CheckpointError(f"{field} is {snippet(v)}, expected {len(cur)} numbers")
                new[k] = tuple(v)
        merged = {**g, **new}
        try:  # the constructor's rules: a manifest installs nothing ZeroAdamW(...) would refuse
            opt.group_rules[i].check_group(merged)
        except (ValueError, TypeError) as e:
            raise CheckpointError(
                f"{d / MANIFEST}: param_groups[{i}]: {e} ({type(opt).__name__} refuses "
                "it; the checkpoint's hyper-parameters were edited)"
            ) from None
        out.append(new)
    return out
