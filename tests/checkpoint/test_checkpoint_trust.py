"""Trust at the boundaries: no code from files, no silently wrong checkpoints, failures that
explain themselves (see docs/checkpoints.md, "Threat model").

Each case is an attack or a failure that, before these checks, ran code, loaded other data than
was saved with exit code 0, read a file whole, or ended in a Python traceback. The in-process
cases use a 1-rank checkpoint of a tiny model; the train cases are in test_checkpoint_trust_run.py
(they spawn ranks).

About internals: fusedzero.checkpoint._catalog, fusedzero.checkpoint._manifest,
fusedzero.checkpoint._saving.
"""

from __future__ import annotations

import collections
import json
import os
import pickle
import re
import stat
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from fusedzero import checkpoint as ck
from fusedzero.app.cli import main as cli_main
from fusedzero.app.model import GPT
from fusedzero.checkpoint import _catalog as catalog, _saving as saving
from fusedzero.optim import ZeroAdamW

from _helpers import (
    TINY_CKPT,
    copy_root as copy,
    rewrite_shard,
    tiny_ckpt_opt,
    tiny_train,
    two_step_root,
)

CFG = TINY_CKPT
SHARD = "rank00000-of-00001.safetensors"


def build() -> tuple[GPT, ZeroAdamW]:
    return tiny_ckpt_opt(CFG)


train = tiny_train


def snapshot(opt: ZeroAdamW) -> list[Any]:
    st = opt.shard_state()
    out: list[Any] = [
        opt.step_count.clone(),
        [dict((k, v) for k, v in g.items() if k != "params") for g in opt.param_groups],
    ]
    for t in (*st.master, *st.exp_avg, *st.exp_avg_sq):  # type: ignore[misc]
        out.append(t.clone())
    return out


def same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b)
    )


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root with step-1 and step-2 of a trained tiny model (non-zero moments)."""
    return two_step_root(tmp_path_factory.mktemp("good"), build)


def manifest_of(root: Path) -> tuple[Path, dict[str, Any]]:
    f = ck.resolve(root) / ck.MANIFEST
    return f, json.loads(f.read_text())


def one_line(capsys: pytest.CaptureFixture[str], argv: list[str], rc: int = 2) -> str:
    got = cli_main(argv)
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert got == rc and len(lines) == 1 and lines[0].startswith("fusedzero: error: "), (
        got,
        cap.err,
    )
    assert "Traceback" not in cap.out + cap.err
    return lines[0]


# ---------------------------------------------------------------------------------------------
# 3, 5: manifest edits that keep it internally consistent are refused against the shard headers
# ---------------------------------------------------------------------------------------------


def _segments(m: dict[str, Any]) -> list[list[int]]:
    return [s for g in m["files"][0]["groups"] for s in g["segments"]]


def swap_offsets(m: dict[str, Any]) -> None:
    """Two params of the same size trade places in the shard: exports them permuted."""
    for g in m["files"][0]["groups"]:
        by_len: dict[int, list[int]] = {}
        for s in g["segments"]:
            by_len.setdefault(s[2], []).append(s)
        pair = next(v for v in by_len.values() if len(v) >= 2)
        pair[0][3], pair[1][3] = pair[1][3], pair[0][3]
        return


def transpose(m: dict[str, Any]) -> None:
    p = next(p for p in m["params"] if len(p["shape"]) == 2 and p["shape"][0] != p["shape"][1])
    p["shape"] = p["shape"][::-1]


def rename_pair(m: dict[str, Any]) -> None:
    """Two same-shape params swap names: each loads the other's values."""
    seen: dict[tuple[int, ...], dict[str, Any]] = {}
    for p in m["params"]:
        q = seen.setdefault(tuple(p["shape"]), p)
        if q is not p:
            p["name"], q["name"] = q["name"], p["name"]
            for g in m["param_groups"]:
                g["param_names"] = [
                    {p["name"]: q["name"], q["name"]: p["name"]}.get(n, n) for n in g["param_names"]
                ]
            return


def grow(m: dict[str, Any]) -> None:
    """A param claimed to be 10**12 elements, its one segment moved past the shard's end and
    the shard grown to match: schema-valid; export would allocate terabytes."""
    import math

    n = 10**12
    for g in m["files"][0]["groups"]:
        for s in g["segments"]:
            p = m["params"][s[0]]
            if s[1] == 0 and s[2] == math.prod(p["shape"]):
                p["shape"], s[2], s[3] = [n], n, g["local_numel"]
                g["local_numel"] += n
                return
    raise AssertionError("no param in one segment")


BINDING: list[tuple[str, Callable[[dict[str, Any]], Any], str]] = [
    ("swapped segment offsets", swap_offsets, "'groups'"),
    (
        "state dtype fp32 -> bf16",
        lambda m: m.update(modes={"master": "fp32", "states": "bf16"}),
        "'modes'",
    ),
    ("transposed shape", transpose, "'params'"),
    ("stage contradicts the shards", lambda m: m.update(stage=2), "'stage'"),
    ("stage 0 at world size 1", lambda m: m.update(stage=0), "'stage'"),
    ("names swapped", rename_pair, "'params'"),
    ("alias added", lambda m: m["params"][1].update(aliases=["extra.weight"]), "'params'"),
    ("param grown to 10**12 elements", grow, "'groups'"),
    # A tp rank's checkpoint claimed for a plain one (or, removed, the other way round).
    ("tp field added", lambda m: m.update(tp={"rank": 0, "size": 2}), "'tp'"),
]


@pytest.mark.parametrize("case, edit, words", BINDING, ids=[b[0] for b in BINDING])
def test_consistent_manifest_edit_is_refused_by_the_shard_header(
    good: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    case: str,
    edit: Callable[[dict[str, Any]], Any],
    words: str,
) -> None:
    root = copy(good, tmp_path)
    f, m = manifest_of(root)
    edit(m)
    f.write_text(json.dumps(m))
    ck._manifest.validate(m, f)  # the edit is invisible to the schema
    model, opt = build()  # fresh: zero moments, where the checkpoint's are not
    before = snapshot(opt)
    real_empty = torch.empty

    def bounded_empty(*a: Any, **k: Any) -> torch.Tensor:
        t = real_empty(*a, **{**k, "device": "meta"})
        assert t.numel() < 10**8, f"{case}: allocation of {t.numel()} elements"
        return real_empty(*a, **k)

    monkeypatch.setattr(torch, "empty", bounded_empty)
    for call in (
        lambda: ck.verify(root, checksums=False),
        lambda: ck.load(opt, root),
        lambda: ck.export(root, tmp_path / "out.safetensors", verify=False),
    ):
        with pytest.raises((ck.CheckpointError, ValueError)) as e:
            call()
        msg = str(e.value)
        if "does not match this model's parameters" in msg:  # load: the model refuses it first
            continue
        assert "header metadata does not match the manifest" in msg and words in msg, msg
    monkeypatch.setattr(torch, "empty", real_empty)
    assert same(snapshot(opt), before)  # nothing was mutated
    assert not (tmp_path / "out.safetensors").exists()
    assert cli_main(["ckpt", "verify", str(root)]) == 1
    out = capsys.readouterr().out
    assert f"FAILED {ck.resolve(root) / SHARD}: header metadata" in out, out
    assert "Traceback" not in out
    assert ck.find_latest(root).path.name == "step-00000001"  # resume takes the previous one


@pytest.mark.parametrize(
    "edit, words",
    [
        (
            lambda k, t: t.bfloat16() if k == "fg0.exp_avg" else t,
            "fg0.exp_avg is BF16 [{n}], the manifest implies F32 [{n}]",
        ),
        (
            lambda k, t: t[:-128] if k == "fg0.master" else t,
            "fg0.master is F32 [{m}], the manifest implies F32 [{n}]",
        ),
    ],
    ids=["dtype", "shape"],
)
def test_shard_tensors_are_checked_before_anything_is_allocated(
    good: Path, tmp_path: Path, edit: Callable[[str, torch.Tensor], torch.Tensor], words: str
) -> None:
    root = copy(good, tmp_path)
    d = ck.resolve(root)
    n = manifest_of(root)[1]["files"][0]["groups"][0]["local_numel"]
    rewrite_shard(d, edit)
    want = words.format(n=n, m=n - 128)
    for call in (
        lambda: ck.verify(root),
        lambda: ck.export(root, tmp_path / "o.safetensors"),
        lambda: ck.load(build()[1], root),
    ):
        with pytest.raises(ck.CheckpointError, match=rf"{SHARD}: .*{re.escape(want)}"):
            call()


def test_shard_header_records_what_its_bytes_mean(good: Path) -> None:
    d = ck.resolve(good)
    m = ck.read_manifest(d)
    with safe_open(d / SHARD, framework="pt") as f:
        meta = f.metadata()
    assert m["version"] == 3 and meta["version"] == "3"
    assert json.loads(meta["groups"]) == m["files"][0]["groups"]
    assert json.loads(meta["modes"]) == m["modes"]
    assert [p["name"] for p in json.loads(meta["params"])] == [p["name"] for p in m["params"]]
    assert (meta["stage"], meta["world_size"], meta["rank"]) == ("1", "1", "0")
    assert len(meta["layout_sha256"]) == 64


# ---------------------------------------------------------------------------------------------
# 4: bounded reads of `latest` and the manifest
# ---------------------------------------------------------------------------------------------


def raising_peak(fn: Callable[[], Any], match: str) -> int:
    """Peak bytes Python allocated while `fn` raised the CheckpointError `match` names."""
    tracemalloc.start()
    try:
        with pytest.raises(ck.CheckpointError, match=match):
            fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_latest_is_read_a_few_kb_at_most(good: Path, tmp_path: Path) -> None:
    root = copy(good, tmp_path)
    latest = root / ck.LATEST
    with open(latest, "wb") as f:  # sparse: 64 MiB that take no disk
        f.write(b"step-00000002\n")
        f.truncate(64 << 20)
    peak = raising_peak(lambda: ck.resolve(root), r"latest: larger than 4096 bytes")
    assert peak < 1 << 20, f"reading `latest` allocated {peak} bytes"
    assert ck.find_latest(root).path.name == "step-00000002"  # the step folders still are


def test_manifest_cap_is_enforced_when_reading_and_saving(
    good: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The cap's computation (1024 ranks x 70B) is in fusedzero/checkpoint/_manifest.py, checked
    # by tests/checkpoint/test_scale_ckpt.py: far below the 1 GiB of before, above 1024 rank states.
    assert 1024 * (64 << 10) < ck._manifest.MAX_MANIFEST < 300 * 10**6
    root = copy(good, tmp_path)
    size = (ck.resolve(root) / ck.MANIFEST).stat().st_size
    monkeypatch.setattr(catalog, "MAX_MANIFEST", size - 1)
    peak = raising_peak(lambda: ck.read_manifest(root), rf"larger than {size - 1} bytes")
    assert peak < 2 * size + (64 << 10)
    monkeypatch.setattr(saving, "MAX_MANIFEST", size // 2)
    model, opt = build()
    with pytest.raises(ck.CheckpointError, match="the manifest would be .* bytes, more than"):
        ck.save(opt, root, step=3)
    assert not (root / "step-00000003").exists() and not (root / ".step-00000003.tmp").exists()


# ---------------------------------------------------------------------------------------------
# 6: hyper-parameters and caller state checked before anything is mutated
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, value, words",
    [
        ("lr", -1.0, "Invalid learning rate: -1.0"),
        ("betas", [5.0, -3.0], "Invalid beta parameter at index 0: 5.0"),
        ("betas", [0.9, -3.0], "Invalid beta parameter at index 1: -3.0"),
        ("eps", -1e-8, "Invalid epsilon value"),
        ("weight_decay", -0.1, "Invalid weight_decay value"),
        # Stricter than torch.optim.AdamW on purpose (fusedzero.rules._adamw.check_hyper): eps 0
        # divides by zero at a zero second moment; the rest is inf or 0 in the fp32 update.
        ("eps", 0, r"Invalid epsilon value: 0 \(must be > 0"),
        ("eps", 1e-50, r"Invalid epsilon value: 1e-50 \(must be > 0"),
        ("eps", 1e300, r"Invalid epsilon value: 1e\+300"),
        ("lr", 1e300, r"Invalid learning rate: 1e\+300 \(must be finite in fp32"),
        ("weight_decay", 1e39, r"Invalid weight_decay value: 1e\+39 \(must be finite in fp32"),
    ],
)
def test_invalid_hyper_parameters_are_refused(
    good: Path, tmp_path: Path, key: str, value: Any, words: str
) -> None:
    root = copy(good, tmp_path)
    f, m = manifest_of(root)
    m["param_groups"][1][key] = value
    f.write_text(json.dumps(m))
    model, opt = build()
    before = snapshot(opt)
    with pytest.raises(ck.CheckpointError, match=rf"param_groups\[1\]: {words}"):
        ck.load(opt, root)
    assert same(snapshot(opt), before)
    ck.load(opt, root, load_hyperparams=False)  # the rest of it is sound


@pytest.mark.parametrize("value", [True, 1, "yes", None])
def test_a_switch_edited_into_the_manifest_is_refused(
    good: Path, tmp_path: Path, value: Any
) -> None:
    """See [Note: bound hyper-parameters]: `maximize: true` edited in would train by gradient
    ascent; the switches are the constructor's, so the load is refused and changes nothing."""
    root = copy(good, tmp_path)
    f, m = manifest_of(root)
    m["param_groups"][0]["maximize"] = value
    f.write_text(json.dumps(m))
    model, opt = build()
    before = snapshot(opt)
    with pytest.raises(
        ck.CheckpointError,
        match=r"param_groups\[0\].maximize is .*, this "
        r"optimizer has False",
    ):
        ck.load(opt, root)
    assert same(snapshot(opt), before)
    ck.load(opt, root, load_hyperparams=False)  # the run's own settings: nothing of it is read
    assert all(g["maximize"] is False for g in opt.param_groups)


def test_caller_state_check_runs_before_anything_is_mutated(good: Path, tmp_path: Path) -> None:
    root = copy(good, tmp_path)
    model, opt = build()
    ck.save(opt, root, step=3, caller_state={"step": "abc"})
    train(model, opt, 1, seed=3)
    before = snapshot(opt)
    seen = []

    def check(state: Any) -> None:
        seen.append(state)
        if not isinstance(state["step"], int):
            raise ValueError(f"step is {state['step']!r}")

    with pytest.raises(ValueError, match="step is 'abc'"):
        ck.load(opt, root, check_caller=check)
    assert seen == [{"step": "abc"}] and same(snapshot(opt), before)


# ---------------------------------------------------------------------------------------------
# 1: no code from a DCP folder
# ---------------------------------------------------------------------------------------------


class _Evil:
    """Unpickling it runs a shell command that creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_hostile_dcp_metadata_runs_no_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "pwned"
    dcp_dir = tmp_path / "dcp"
    dcp_dir.mkdir()
    (dcp_dir / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    line = one_line(capsys, ["ckpt", "import-dcp", str(dcp_dir), str(tmp_path / "out")])
    assert "refused global posix.system" in line or "refused global os.system" in line, line
    assert not marker.exists() and not (tmp_path / "out").exists()
    # Other classes are refused by name too, code or not.
    for obj, name in (
        (collections.Counter(), "collections.Counter"),
        (Path("x"), "pathlib.PosixPath"),
    ):
        (dcp_dir / ".metadata").write_bytes(pickle.dumps(obj))
        line = one_line(capsys, ["ckpt", "import-dcp", str(dcp_dir), str(tmp_path / "out")])
        assert (f"refused global {name}" in line) or "not DCP Metadata" in line, line


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_dcp_items_and_storage_names_run_no_code(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from fusedzero.checkpoint.dcp import read_dcp

    good_dir, bad_dir = tmp_path / "good", tmp_path / "bad"
    w = torch.randn(3, 4)
    dcp.save({"w": w, "hp": {"lr": 0.5, "betas": (0.9, 0.95)}}, checkpoint_id=good_dir)
    sd = read_dcp(good_dir)  # real DCP metadata passes the allow-list
    assert torch.equal(sd["w"], w) and sd["hp"] == {"lr": 0.5, "betas": (0.9, 0.95)}
    marker = tmp_path / "pwned"
    dcp.save({"w": w, "hp": _Evil(marker)}, checkpoint_id=bad_dir)  # a BYTE_IO item
    with pytest.raises(ValueError, match=r"item 'hp' is refused: .*(posix|os)\.system"):
        read_dcp(bad_dir)
    assert not marker.exists()
    # A storage file outside the folder is refused before anything is read.
    from fusedzero.checkpoint.dcp import read_dcp_metadata

    md = read_dcp_metadata(good_dir)
    for info in md.storage_data.values():
        info.relative_path = "../../etc/passwd"
    with open(good_dir / ".metadata", "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(ValueError, match="is not a plain file name inside the DCP folder"):
        read_dcp(good_dir)


# ---------------------------------------------------------------------------------------------
# 2: export never replaces what is not a regular file
# ---------------------------------------------------------------------------------------------


def _fifo(p: Path) -> None:
    os.mkfifo(p)


def _link(p: Path) -> None:
    (p.parent / "target").write_text("precious")
    p.symlink_to(p.parent / "target")


def _chardev(p: Path) -> None:
    if os.geteuid() != 0:  # only root makes device nodes: a FIFO stands in for it
        os.mkfifo(p)
        return
    os.mknod(p, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # like /dev/null


@pytest.mark.parametrize(
    "make, kind",
    [
        (_fifo, "a FIFO"),
        (_link, "a symlink"),
        (_chardev, "a (character device|FIFO)"),
        (lambda p: p.mkdir(), "a folder"),
    ],
    ids=["fifo", "symlink", "device", "folder"],
)
def test_export_refuses_an_out_that_is_not_a_regular_file(
    good: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    make: Callable[[Path], None],
    kind: str,
) -> None:
    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir()
    make(out)
    before = os.lstat(out)
    line = one_line(capsys, ["ckpt", "export", str(good), str(out)])
    assert "export output" in line and "refusing to replace it" in line
    assert re.search(f"is {kind}", line), line
    after = os.lstat(out)
    assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino)
    if out.is_symlink():
        assert (tmp_path / "out" / "target").read_text() == "precious"
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".")] == []
    out2 = tmp_path / "out" / "fresh.safetensors"  # a regular file or nothing: written
    ck.export(good, out2)
    ck.export(good, out2)


# ---------------------------------------------------------------------------------------------
# 9 (CLI part): tracebacks only with --debug
# ---------------------------------------------------------------------------------------------


def test_unexpected_errors_are_one_line_unless_debug(
    good: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(path: Any) -> Any:
        raise KeyError("surprise")

    monkeypatch.setattr(ck, "inspect", boom)
    line = one_line(capsys, ["ckpt", "inspect", str(good)], rc=1)
    assert "KeyError: 'surprise'" in line and "--debug" in line
    for argv, env in (
        (["--debug", "ckpt", "inspect", str(good)], "0"),
        (["ckpt", "inspect", str(good), "--debug"], "0"),
        (["ckpt", "inspect", str(good)], "1"),
    ):
        monkeypatch.setenv("FUSEDZERO_DEBUG", env)
        with pytest.raises(KeyError, match="surprise"):
            cli_main(argv)
