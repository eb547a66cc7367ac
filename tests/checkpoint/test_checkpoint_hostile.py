"""Checkpoints as untrusted input (docs/checkpoints.md, "Threat model").

Hostile manifests and planted files are built from a real 1-rank checkpoint of a tiny model
in this process (milliseconds each); the cross-rank cases (a read failing on one rank during
`load`, per-replica RNG with `Groups(replicate=)`) share one spawn of 2 gloo ranks.

About internals: fusedzero.checkpoint._format, fusedzero.checkpoint._saving,
fusedzero.checkpoint._shardfile, fusedzero.checkpoint._weights.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fusedzero import checkpoint as ck
from fusedzero.app.ckpt_cli import main as cli_main
from fusedzero.app.launch import run as train_run
from fusedzero.app.model import GPT
from fusedzero.checkpoint import _format as ckformat, _saving as cksaving, _shardfile as ckshardfile
from fusedzero.optim import ZeroAdamW
from fusedzero.testing import run_ranks

from _helpers import (
    TINY_CKPT,
    copy_root as copy,
    fast_only,
    tiny_ckpt_opt,
    tiny_train,
    two_step_root,
)

CFG = dataclasses.replace(TINY_CKPT, dropout=0.1)
SHARD = "rank00000-of-00001.safetensors"


def build(stage: int = 1, pg: Any = None, rep: Any = None) -> tuple[GPT, ZeroAdamW]:
    return tiny_ckpt_opt(CFG, stage, pg, rep)


train = tiny_train


def snapshot(opt: ZeroAdamW) -> list[torch.Tensor]:
    out = [opt.step_count.clone()]
    st = opt.shard_state()
    assert st.master is not None and st.exp_avg is not None and st.exp_avg_sq is not None
    for master, exp_avg, exp_avg_sq in zip(st.master, st.exp_avg, st.exp_avg_sq, strict=True):
        out += [master.clone(), exp_avg.clone(), exp_avg_sq.clone()]
    return out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root with step-1 and step-2 of a trained tiny model (non-zero moments)."""
    return two_step_root(tmp_path_factory.mktemp("good"), build)


def edit_manifest(
    root: Path, fn: Callable[[dict[str, Any]], Any] | None = None, text: str | None = None
) -> Path:
    f = ck.resolve(root) / ck.MANIFEST
    if fn is not None:
        m = json.loads(f.read_text())
        fn(m)
        text = json.dumps(m)
    assert text is not None
    f.write_text(text)
    return f


def one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert cli_main(argv) == 2
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fusedzero: error: "), cap.err
    assert "Traceback" not in cap.out + cap.err
    return lines[0]


# ---------------------------------------------------------------------------------------------
# 1 path traversal, 3 schema, 14 CLI errors
# ---------------------------------------------------------------------------------------------


def _set_seg(i: int, v: Any) -> Callable[[dict[str, Any]], None]:
    def f(m: dict[str, Any]) -> None:
        m["files"][0]["groups"][0]["segments"][0][i] = v

    return f


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


HOSTILE: list[tuple[str, Callable[[dict[str, Any]], Any] | None, str | None, str]] = [
    # (case, manifest edit, or raw text, words the error must contain)
    (
        "absolute shard name",
        lambda m: m["files"][0].update(name="/etc/passwd"),
        None,
        "files[0].name is '/etc/passwd'; it must be a plain name",
    ),
    (
        "../ shard name",
        lambda m: m["files"][0].update(name="../../step-00000001/" + SHARD),
        None,
        "files[0].name",
    ),
    (
        "other plain name",
        lambda m: m["files"][0].update(name="notes.txt"),
        None,
        "files[0].name is 'notes.txt', expected 'rank00000-of-00001.safetensors'",
    ),
    ("step_count NaN", None, "NaN", "NaN is not valid JSON"),
    (
        "step_count string",
        lambda m: m.update(step_count="2"),
        None,
        "step_count is str '2', expected a finite number",
    ),
    (
        "step_count fraction",
        lambda m: m.update(step_count=2.5),
        None,
        "step_count is 2.5, expected a whole number",
    ),
    ("negative offset", _set_seg(3, -4), None, "segments[0][3] is -4, expected 0 <= value"),
    ("huge offset", _set_seg(3, 10**15), None, "lie outside the shard's"),
    ("float offset", _set_seg(1, 1.5), None, "segments[0][1] is float 1.5, expected an integer"),
    ("string offset", _set_seg(2, "7"), None, "segments[0][2] is str '7', expected an integer"),
    ("segment past its param", _set_seg(2, 10**6), None, "lie outside"),
    ("missing key", lambda m: m.pop("files"), None, "manifest field files is missing"),
    (
        "wrong type",
        lambda m: m.update(params={"a": 1}),
        None,
        "params is dict {'a': 1}, expected a JSON list",
    ),
    (
        "param without shape",
        lambda m: m["params"][0].pop("shape"),
        None,
        "params[0].shape is missing",
    ),
    (
        "deep nesting",
        None,
        '{"format": "fusedzero-checkpoint", "x": ' + _nested(100000) + "}",
        "nested too deeply",
    ),
    (
        "deep hyper-parameter",
        lambda m: m["param_groups"][0].update(lr=json.loads(_nested(100))),
        None,
        "nested deeper than",
    ),
    (
        "segment twice",
        lambda m: m["files"][0]["groups"][0]["segments"].append(
            m["files"][0]["groups"][0]["segments"][0]
        ),
        None,
        "every element must be saved exactly",
    ),
    (
        "segment missing",
        lambda m: m["files"][0]["groups"][0]["segments"].pop(),
        None,
        "every element must be saved exactly once",
    ),
    (
        "param twice in one group",
        lambda m: m["param_groups"][0]["param_names"].append(
            m["param_groups"][0]["param_names"][0]
        ),
        None,
        "twice in the same param group",
    ),
    (
        "param in two groups",
        lambda m: m["param_groups"][1]["param_names"].append(
            m["param_groups"][0]["param_names"][0]
        ),
        None,
        "which param_groups[0] lists too",
    ),
    (
        "rank outside the world",
        lambda m: m["ranks"][0].update(rank=5),
        None,
        "ranks[0].rank is 5, expected 0 <= value < 1",
    ),
    ("bad sha", lambda m: m["files"][0].update(sha256="zz"), None, "files[0].sha256"),
    (
        "scaler NaN-free",
        lambda m: m.update(scaler={"scale": -1.0, "growth_tracker": 0}),
        None,
        "scaler.scale is -1.0, expected > 0",
    ),
    (
        "tp rank past its size",
        lambda m: m.update(tp={"rank": 2, "size": 2}),
        None,
        "tp.rank is 2, expected 0 <= value < 2",
    ),
    (
        "tp with an extra key",
        lambda m: m.update(tp={"rank": 0, "size": 2, "x": 1}),
        None,
        "tp has keys ['rank', 'size', 'x']",
    ),
]


# The fast tier: one case of each kind of check (file names, JSON text, ranges, presence,
# nesting, coverage of the params); the slow tier runs them all.
FAST_HOSTILE = {
    "absolute shard name",
    "step_count NaN",
    "negative offset",
    "missing key",
    "deep nesting",
    "segment twice",
}


@pytest.mark.parametrize(
    "case, fn, text, words",
    fast_only(HOSTILE, lambda h: h[0] in FAST_HOSTILE),
    ids=[h[0] for h in HOSTILE],
)
def test_hostile_manifest_is_one_clear_error_everywhere(
    good: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    case: str,
    fn: Callable[[dict[str, Any]], Any] | None,
    text: str | None,
    words: str,
) -> None:
    root = copy(good, tmp_path)
    edit_manifest(root, fn, text)
    model, opt = build()
    train(model, opt, 1, seed=5)
    before = snapshot(opt)
    for call in (
        lambda: ck.verify(root),
        lambda: ck.inspect(root),
        lambda: ck.export(root, tmp_path / "out.safetensors"),
        lambda: ck.load(opt, root),
        lambda: ck.find_latest(root / "step-00000002"),
    ):
        with pytest.raises(ck.CheckpointError) as e:
            call()
        assert words in str(e.value), f"{case}: {e.value}"
    assert same(snapshot(opt), before)
    for cmd in (["verify"], ["inspect"], ["export"]):
        argv = ["ckpt", *cmd, str(root)] + (
            [str(tmp_path / "o.safetensors")] if cmd == ["export"] else []
        )
        assert words.split("'")[0] in one_line_error(capsys, argv)
    # Recovery passes over it to the previous checkpoint.
    found = ck.find_latest(root)
    assert found.path.name == "step-00000001" and words in found.skipped[0]


def test_step_count_edited_to_another_number_fails_verification(good: Path, tmp_path: Path) -> None:
    root = copy(good, tmp_path)
    edit_manifest(root, lambda m: m.update(step_count=9))
    with pytest.raises(
        ck.CheckpointError,
        match=r"header metadata does not match the manifest "
        r".*'step_count': \('2', '9'\)",
    ):
        ck.verify(root)
    assert cli_main(["ckpt", "verify", str(root)]) == 1


def test_latest_and_shards_never_lead_outside_the_checkpoint(
    good: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 1234)
    root = copy(good, tmp_path)
    for name in ("../c/step-00000001", str(good / "step-00000001"), "..", "manifest.json"):
        (root / ck.LATEST).write_text(name + "\n")
        with pytest.raises(ck.CheckpointError, match="latest"):
            ck.resolve(root)
        assert "latest" in one_line_error(capsys, ["ckpt", "verify", str(root)])
    (root / ck.LATEST).write_text("step-00000002\n")
    # A shard replaced by a link to a file outside: refused, and its size is not revealed.
    shard = ck.resolve(root) / SHARD
    shard.unlink()
    shard.symlink_to(secret)
    with pytest.raises(ck.CheckpointError, match="a symlink; shard files must be regular"):
        ck.verify(root)
    assert cli_main(["ckpt", "inspect", str(root)]) == 1
    out = capsys.readouterr().out
    assert "SYMLINK" in out and "1,234" not in out and "1234" not in out


def test_refused_pickle_payload_is_a_clear_checkpoint_error(good: Path, tmp_path: Path) -> None:
    root = copy(good, tmp_path)

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, ("echo pwned",))

    buf = io.BytesIO()
    torch.save({"caller": Evil()}, buf)  # what a saver would write, with a code-running global
    payload = base64.b64encode(buf.getvalue()).decode()
    edit_manifest(root, lambda m: m["ranks"][0].update(state=payload))
    model, opt = build()
    before = snapshot(opt)
    with pytest.raises(ck.CheckpointError) as e:
        ck.load(opt, root)
    msg = str(e.value)
    assert "ranks[0].state is refused" in msg and "weights_only=False" not in msg, msg
    assert "posix.system" in msg or "os.system" in msg
    assert same(snapshot(opt), before)  # the optimizer is untouched


@pytest.mark.filterwarnings("ignore:optimizer contains a parameter group with duplicate")
def test_param_listed_twice_in_one_group_is_reported_as_such() -> None:
    torch.manual_seed(0)
    model = GPT(CFG)
    p = model.wte.weight
    with pytest.raises(ValueError, match=r"param group 0 lists a parameter twice"):
        ZeroAdamW([{"params": [p, p]}], module=model)
    with pytest.raises(ValueError, match="more than one param"):  # torch says it first
        ZeroAdamW([{"params": [p]}, {"params": [p]}], module=model)


# ---------------------------------------------------------------------------------------------
# 2 planted symlinks, 6 export into the checkpoint, 13 failed saves, 14 keep_last + symlink
# ---------------------------------------------------------------------------------------------


def test_planted_symlinks_are_never_written_through(good: Path, tmp_path: Path) -> None:
    root = copy(good, tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    victim_dir = tmp_path / "victim_dir"
    victim_dir.mkdir()
    (victim_dir / "keep").write_text("precious")
    (root / "latest.tmp").symlink_to(victim)
    (root / ".step-00000003.tmp").symlink_to(victim_dir, target_is_directory=True)
    model, opt = build()
    ck.save(opt, root, step=3)
    out = tmp_path / "exp" / "model.safetensors"
    out.parent.mkdir()
    (out.parent / "model.safetensors.tmp").symlink_to(victim)
    ck.export(root, out)
    assert victim.read_text() == "precious"
    assert [p.name for p in victim_dir.iterdir()] == ["keep"]
    assert ck.resolve(root).name == "step-00000003"
    ck.verify(root)
    # A link planted at the final name is replaced, not written through.
    (root / ck.LATEST).unlink()
    (root / ck.LATEST).symlink_to(victim)
    ck.save(opt, root, step=4)
    assert victim.read_text() == "precious" and not (root / ck.LATEST).is_symlink()


def test_export_into_a_checkpoint_is_refused(
    good: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = copy(good, tmp_path)
    d = ck.resolve(root)
    for out in (
        d / SHARD,
        d / "model.safetensors",
        d / "sub" / "m.safetensors",
        root / "step-00000001" / "m.safetensors",
        root / ck.LATEST,
        root / "step-00000009",
    ):
        with pytest.raises(ck.CheckpointError, match="checkpoint"):
            ck.export(root, out)
        assert "export output" in one_line_error(capsys, ["ckpt", "export", str(root), str(out)])
    ck.verify(root)
    ck.verify(root / "step-00000001")
    ck.export(root, root / "beside.safetensors")  # beside the step folders is fine


def test_failed_save_removes_staging_and_names_the_path(
    good: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = copy(good, tmp_path)
    model, opt = build()

    def disk_full(path: Path, n: int) -> None:
        if n > 4096:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckformat, "_write_hook", disk_full)
    with pytest.raises(
        OSError,
        match=r"No space left on device \(writing .*\.step-00000003"
        rf"\.tmp/{SHARD}: the file needs \d+ bytes, \d+ bytes "
        r"free\)",
    ) as e:
        ck.save(opt, root, step=3)
    assert e.value.filename is not None
    assert not (root / ".step-00000003.tmp").exists()
    h = ck.save(opt, root, step=4, async_=True)
    with pytest.raises(ck.CheckpointError, match=rf"No space left on device \(writing .*{SHARD}"):
        h.wait()
    assert not (root / ".step-00000004.tmp").exists()
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000001", "step-00000002"]
    # Saving into a checkpoint folder (not a root) is refused, not nested.
    monkeypatch.setattr(ckformat, "_write_hook", None)
    with pytest.raises(ck.CheckpointError, match="is a checkpoint"):
        ck.save(opt, root / "step-00000002", step=5)


def test_keep_last_with_a_symlinked_step_folder(good: Path, tmp_path: Path) -> None:
    root = copy(good, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    shutil.move(root / "step-00000001", elsewhere)
    (root / "step-00000001").symlink_to(elsewhere, target_is_directory=True)
    model, opt = build()
    ck.save(opt, root, step=3, keep_last=1)
    assert [p.name for p in ck.list_checkpoints(root)] == ["step-00000003"]
    assert (elsewhere / ck.MANIFEST).is_file()  # the link went, not what it points to


# ---------------------------------------------------------------------------------------------
# 7 recovery
# ---------------------------------------------------------------------------------------------


def test_find_latest_falls_back_to_the_newest_verified_checkpoint(
    good: Path, tmp_path: Path
) -> None:
    root = copy(good, tmp_path)
    assert ck.find_latest(root) == ck.Latest(root / "step-00000002", root, [])
    (root / ck.LATEST).unlink()  # lost pointer: still found
    assert ck.find_latest(root).path.name == "step-00000002"
    f = root / "step-00000002" / SHARD
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x10
    f.write_bytes(bytes(data))
    found = ck.find_latest(root)
    assert found.path.name == "step-00000001"
    # `latest` is gone: the fallback says so first, then what it passed over.
    assert len(found.skipped) == 2 and found.skipped[0].startswith(f"{root / ck.LATEST}: missing")
    assert "step-00000002" in found.skipped[1] and "sha256 mismatch" in found.skipped[1]
    # A step folder is a target of its own; its root is where later saves go.
    found = ck.find_latest(root / "step-00000001")
    assert found == ck.Latest(root / "step-00000001", root, [])
    assert ck.save_root(root / "step-00000001") == root and ck.save_root(root) == root
    with pytest.raises(ck.CheckpointError, match="sha256 mismatch"):
        ck.find_latest(root / "step-00000002")
    shutil.rmtree(root / "step-00000001")
    with pytest.raises(ck.CheckpointError, match="no checkpoint under .* passes verification"):
        ck.find_latest(root)


@pytest.mark.slow
def test_train_resumes_from_the_newest_verified_checkpoint(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """`fusedzero train --resume`: newest corrupt and `latest` gone -> the previous one, with a
    warning, and the run goes on from there."""
    data = tmp_path / "data.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    ckpt = tmp_path / "ckpt"
    base = [
        "--n-layer",
        "1",
        "--n-embd",
        "16",
        "--n-head",
        "2",
        "--block-size",
        "16",
        "--batch-size",
        "2",
        "--steps",
        "3",
        "--eval-seqs",
        "2",
        "--nproc",
        "1",
        "--device",
        "cpu",
        "--no-progress",
        "--data",
        str(data),
    ]
    train_run(base + ["--ckpt-dir", str(ckpt), "--save-every", "1", "--stop-at", "2"])
    assert [p.name for p in ck.list_checkpoints(ckpt)] == ["step-00000001", "step-00000002"]
    f = ckpt / "step-00000002" / SHARD
    f.write_bytes(f.read_bytes()[:-8])
    (ckpt / ck.LATEST).unlink()
    capfd.readouterr()
    summary = train_run(base + ["--ckpt-dir", str(ckpt), "--resume"])
    err = capfd.readouterr().err
    assert "fusedzero: warning: --resume: skipped" in err and "step-00000002" in err, err
    assert [x["step"] for x in summary["steps"]] == [1, 2, 3]
    assert ck.find_latest(ckpt) == ck.Latest(ckpt / "step-00000003", ckpt, [])
    # A step folder as the target (train resolves it with find_latest and saves into
    # save_root, as below; one more run would only repeat these two calls).
    assert ck.find_latest(ckpt / "step-00000001").root == ckpt
    assert ck.save_root(ckpt / "step-00000001") == ckpt


# ---------------------------------------------------------------------------------------------
# 2 gloo ranks
# ---------------------------------------------------------------------------------------------


def w_cross_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # -- 8: a read fails on rank 1 only, after planning: every rank raises the same error and
    # nobody's optimizer changed; then the same load succeeds everywhere.
    model, opt = build()
    train(model, opt, 2, seed=rank)
    ck.save(opt, Path(root) / "a", step=2)
    saved = snapshot(opt)
    train(model, opt, 1, seed=10 + rank)
    before = snapshot(opt)
    real = ckshardfile.ShardFile.read_slices

    def vanished(self: Any, slices: list[Any], *, hashed: bool) -> str:
        if any(s.tensor.endswith("exp_avg_sq") for s in slices):
            raise FileNotFoundError(2, "No such file or directory", str(self.path))
        return real(self, slices, hashed=hashed)

    if rank == 1:  # the file disappears between planning and reading
        ckshardfile.ShardFile.read_slices = vanished  # type: ignore[method-assign]
    try:
        ck.load(opt, Path(root) / "a")
        out["error"] = None
    except ck.CheckpointError as e:
        out["error"] = str(e)
    finally:
        ckshardfile.ShardFile.read_slices = real  # type: ignore[method-assign]
    out["untouched"] = same(snapshot(opt), before)
    ck.load(opt, Path(root) / "a")
    out["reloaded"] = same(snapshot(opt), saved)

    # -- 10: the previous async save failed on rank 1 only (see [Note: a failure before the first
    # gather]): the next save, and a load, raise its error on every rank. Before: rank 1 alone
    # raised, and rank 0 waited in the first gather until the group's timeout.
    class FailedSave:
        _reported = False

        def wait(self) -> None:
            raise ck.CheckpointError("disk full on rank 1")

    out["pending"] = []
    for what in ("save", "load"):
        if rank == 1:
            cksaving._pending[opt] = FailedSave()
        try:
            if what == "save":
                ck.save(opt, Path(root) / "b", step=3)
            else:
                ck.load(opt, Path(root) / "a")
            out["pending"].append(None)
        except ck.CheckpointError as e:
            out["pending"].append(str(e))

    # -- 11: import_weights, a read of the source fails on rank 1 only: every rank raises the
    # same error (before: after the ranks agreed, so rank 0 waited in load_shard_state).
    from fusedzero.checkpoint import _weights as ckweights

    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    real_read = ckweights._WeightSource.read_flat

    def unreadable(self: Any, name: str, a: int, b: int) -> torch.Tensor:
        raise OSError(5, "Input/output error", "weights.safetensors")

    if rank == 1:
        ckweights._WeightSource.read_flat = unreadable  # type: ignore[method-assign]
    try:
        ck.import_weights(opt, full)
        out["import"] = None
    except ck.CheckpointError as e:
        out["import"] = str(e)
    finally:
        ckweights._WeightSource.read_flat = real_read  # type: ignore[method-assign]

    # -- 9: HSDP, shard group {rank} x replicate group {0, 1}: each replica's RNG and caller
    # state come back to that replica.
    groups = [dist.new_group([r]) for r in range(world)]
    model, opt = build(stage=1, pg=groups[rank], rep=dist.group.WORLD)
    train(model, opt, 1)
    torch.manual_seed(100 + rank)
    ck.save(opt, Path(root) / "hsdp", step=1, caller_state={"replica": rank})
    dist.barrier()  # replica 1 returns from save at once; replica 0 writes
    expected = torch.rand(4)
    torch.manual_seed(999)
    got = ck.load(opt, Path(root) / "hsdp")
    out["hsdp"] = {
        "caller": got.caller_state,
        "rng_restored": got.rng_restored,
        "rng_ok": torch.equal(torch.rand(4), expected),
    }
    return out


@pytest.mark.slow
def test_load_is_transactional_and_hsdp_state_is_per_replica(tmp_path: Path) -> None:
    res = run_ranks(w_cross_rank, 2, str(tmp_path), timeout=120)
    errors = [r["error"] for r in res]
    assert errors[0] is not None and errors[0] == errors[1], errors  # the same error everywhere
    assert "rank 1:" in errors[0] and "No such file or directory" in errors[0]
    assert SHARD.replace("00001", "00002") in errors[0] or "rank0000" in errors[0]
    for r in res:
        assert r["untouched"] and r["reloaded"], r
    imports = [r["import"] for r in res]
    assert imports[0] is not None and imports[0] == imports[1], imports
    assert "rank 1: [Errno 5] Input/output error" in imports[0], imports
    for k in range(2):  # the same error on both ranks, for the save and for the load
        got = [r["pending"][k] for r in res]
        assert got[0] is not None and got[0] == got[1] and "disk full on rank 1" in got[0], got
    manifest = ck.read_manifest(tmp_path / "hsdp")
    assert sorted((e["rank"], e.get("replica")) for e in manifest["ranks"]) == [(0, 0), (0, 1)]
    for rank, r in enumerate(res):
        assert r["hsdp"] == {"caller": {"replica": rank}, "rng_restored": True, "rng_ok": True}, (
            rank,
            r["hsdp"],
        )
