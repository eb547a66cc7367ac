"""Sharded checkpoints on gloo ranks: bit-exact resume, resharding across world sizes and stages,
export / import, corruption and killed saves, bounded memory.

Process start-up dominates: each spawn runs several scenarios, shared through module fixtures.
    S1 (4 ranks): train A (stage 2, fp32 params, dropout) and B (stage 1, bf16 params + fp32
        master, dynamic loss scale) to step 3, save, continue to step 6.
    S2 (2 ranks): load A at stages 1 and 0, B at stage 2 (and 3); import an export; a corrupt
        shard; train A and B at 2 ranks to 3, save (as C and D), continue to 6.
    S3 (2 ranks): resume C and D in a new process group, train to 6: bitwise equal.
    S4 (3 ranks): load A at stages 2 and 0, B at stage 1; save B and A (stage 0: rank 0 alone
        writes) again at 3 ranks.
    W=1 (this process, no process group): loads, exports, errors, CLI.

About an internal: fusedzero.checkpoint._format.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from torch.optim.lr_scheduler import LambdaLR

from fusedzero import Precision, Sharding, ZeroAdamW, checkpoint as ck
from fusedzero.app.ckpt_cli import main as cli_main
from fusedzero.app.model import GPT, GPTConfig, gpt_param_groups
from fusedzero.checkpoint import _format as ckformat
from fusedzero.testing import run_ranks

from _helpers import gpt_batch, make_gpt

pytestmark = pytest.mark.slow  # spawns ranks or the CLI

# Dropout on: resuming is bit-exact only if every rank's RNG state is restored too.
CFG = GPTConfig(vocab_size=61, block_size=12, n_layer=2, n_head=2, n_embd=22, dropout=0.1)
GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4 ranks
LR = 1e-3
# Small buckets: params straddle buckets and shards, and every layout has several buckets.
BUCKET = 1500
K, N = 3, 6  # save after K steps, train to N

CONFIGS: dict[str, dict[str, Any]] = {
    "A": {"stage": 2},
    "B": {"stage": 1, "param_dtype": torch.bfloat16, "loss_scale": "dynamic"},
}


# ---------------------------------------------------------------------------------------------
# Workers (module level: spawned ranks import them)
# ---------------------------------------------------------------------------------------------


def make_model(seed: int = 0) -> GPT:
    return make_gpt(CFG, seed)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return gpt_batch(CFG, GLOBAL_BATCH, step)


def build(
    cfg: dict[str, Any], stage: int | None = None, seed: int = 0, bucket: int = BUCKET
) -> tuple[GPT, ZeroAdamW, LambdaLR]:
    model = make_model(seed)
    opt = ZeroAdamW(
        gpt_param_groups(model, 0.1),
        lr=LR,
        module=model,
        stage=cfg["stage"] if stage is None else stage,
        max_grad_norm=1.0,
        precision=Precision(param_dtype=cfg.get("param_dtype"), loss_scale=cfg.get("loss_scale")),
        sharding=Sharding(bucket_numel=bucket),
    )
    sched = LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.25 * s))
    return model, opt, sched


def train(
    model: GPT, opt: ZeroAdamW, sched: LambdaLR, rank: int, world: int, steps: range
) -> list[torch.Tensor]:
    losses = []
    for step in steps:
        x, y = global_batch(step)
        n = GLOBAL_BATCH // world
        _, loss = model(x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n])
        opt.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.detach().clone())
    return losses


def local_state(opt: ZeroAdamW, model: GPT | None = None) -> dict[str, Any]:
    """This rank's optimizer state, by flat buffer, with its segment tables."""
    st = opt.shard_state()
    assert st.master is not None and st.exp_avg is not None and st.exp_avg_sq is not None
    out = {
        "names": list(opt.param_names),
        "groups": [
            {
                "segments": list(info.segments()),
                "master": st.master[i].clone(),
                "exp_avg": st.exp_avg[i].clone(),
                "exp_avg_sq": st.exp_avg_sq[i].clone(),
            }
            for i, info in enumerate(opt.shard_infos())
        ],
        "step_count": opt.step_count.clone(),
        "lrs": [g["lr"] for g in opt.param_groups],
        "scaler": None if opt.scaler is None else opt.scaler.state_dict(),
    }
    if model is not None:
        with opt.gathered_params():  # waits for in-flight gathers; stage 3: gathers, then frees
            out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def train_save(rank: int, world: int, name: str, d: Path) -> dict[str, Any]:
    """Train config `name` to K, save into `d`, continue to N."""
    model, opt, sched = build(CONFIGS[name])
    torch.manual_seed(100 + rank)  # each rank its own dropout stream
    losses = train(model, opt, sched, rank, world, range(K))
    if name == "A":
        # A: a sync save at K-1, then an async one at K with rotation; training goes on while
        # the shard is written, from a private copy.
        ck.save(opt, d, step=K - 1, caller_state={"marker": K - 1}, keep_last=1)
    state = {"sched": sched.state_dict(), "next_step": K, "rank": rank}
    h = ck.save(opt, d, step=K, caller_state=state, keep_last=1, async_=name == "A")
    at_save = local_state(opt, model)
    losses += train(model, opt, sched, rank, world, range(K, N))
    h.wait()
    return {
        "at_save": at_save,
        "final": local_state(opt, model),
        "losses": losses,
        "dirs": sorted(p.name for p in d.iterdir()),
    }


def w_train_save(rank: int, world: int, root: str) -> dict[str, Any]:
    """S1: train A and B to K, save, continue to N."""
    return {name: train_save(rank, world, name, Path(root) / name) for name in CONFIGS}


def w_resume(rank: int, world: int, root: str, runs: dict[str, str]) -> dict[str, Any]:
    """S3: a new process group resumes each config from its checkpoint (runs: name -> dir)."""
    out = {}
    for name, dirname in runs.items():
        model, opt, sched = build(CONFIGS[name], seed=7)  # other weights: the load must set them
        torch.manual_seed(999)  # another RNG state: the load must restore each rank's
        got = ck.load(opt, Path(root) / dirname)
        sched.load_state_dict(got.caller_state["sched"])
        start = got.caller_state["next_step"]
        losses = train(model, opt, sched, rank, world, range(start, N))
        out[name] = {
            "final": local_state(opt, model),
            "losses": losses,
            "caller": got.caller_state,
            "step": got.step,
        }
    return out


def w_reshard(rank: int, world: int, root: str, jobs: list[dict[str, Any]]) -> list[Any]:
    """Load checkpoints at this world size and the given stages; optionally save again,
    import weights, expect an error, or train and save a config. One result per job."""
    out: list[Any] = []
    for job in jobs:
        if "train" in job:
            out.append(train_save(rank, world, job["train"], Path(root) / job["save"]))
            continue
        cfg = CONFIGS[job["cfg"]]
        model, opt, _ = build(cfg, stage=job["stage"], seed=5, bucket=job.get("bucket", BUCKET))
        src = Path(root) / job["src"]
        if "import" in job:
            ck.import_weights(opt, Path(root) / job["import"])
            ck.save(opt, Path(root) / job["save"], step=0)
            out.append(None)
            continue
        try:
            got = ck.load(opt, src, restore_rng=False)
        except (ck.CheckpointError, ValueError) as e:
            out.append({"error": f"{type(e).__name__}: {e}"})
            continue
        res = local_state(opt, model)
        res["peak"] = got.peak_buffer_bytes
        res["local_numel"] = [info.local_numel for info in opt.shard_infos()]
        if "save" in job:
            ck.save(opt, Path(root) / job["save"], step=K)
        out.append(res)
    return out


# ---------------------------------------------------------------------------------------------
# Assembling full per-param state from shards (the independent reference)
# ---------------------------------------------------------------------------------------------

NUMEL = {n: p.numel() for n, p in make_model().named_parameters()}


def assemble(states: list[dict[str, Any]]) -> dict[str, dict[str, torch.Tensor]]:
    """Full flattened master / exp_avg / exp_avg_sq per param name from every rank's shard.
    Elements held by several ranks (stage 0) must agree; every element must be held; padding
    must be zero."""
    full: dict[str, dict[str, torch.Tensor]] = {}
    seen: dict[str, torch.Tensor] = {}
    for st in states:
        names = st["names"]
        for g in st["groups"]:
            covered = torch.zeros(g["master"].numel(), dtype=torch.bool)
            for s in g["segments"]:
                n = names[s.param]
                if n not in full:
                    full[n] = {k: torch.full((NUMEL[n],), float("nan")) for k in ck.KINDS}
                    seen[n] = torch.zeros(NUMEL[n], dtype=torch.bool)
                covered[s.local : s.local + s.length] = True
                for k in ck.KINDS:
                    v = g[k][s.local : s.local + s.length]
                    dst = full[n][k][s.start : s.start + s.length]
                    was = seen[n][s.start : s.start + s.length]
                    assert torch.equal(dst[was], v[was]), f"{n} {k}: ranks disagree"
                    dst.copy_(v)
                seen[n][s.start : s.start + s.length] = True
            for k in ck.KINDS:
                assert not g[k][~covered].any(), f"{k}: padding is not zero"
    for n in NUMEL:
        assert n in full and bool(seen[n].all()), f"{n}: not every element is held by a rank"
    return full


def assert_state_equal(got: dict, ref: dict, what: str) -> None:
    assert got.keys() == ref.keys(), what
    for n in ref:
        for k in ck.KINDS:
            a, b = got[n][k], ref[n][k]
            if not torch.equal(a, b):
                i = int((a != b).nonzero()[0])
                raise AssertionError(f"{what}: {n}.{k} differs at element {i}: {a[i]} vs {b[i]}")


# ---------------------------------------------------------------------------------------------
# Fixtures: one spawn each, shared by the tests
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def s1(root: Path) -> list[dict[str, Any]]:
    return run_ranks(w_train_save, 4, str(root))


@pytest.fixture(scope="module")
def exported(s1: list, root: Path) -> dict[str, Any]:
    """A exported in fp32, B in bf16 (this process, offline)."""
    return {
        "A": ck.export(root / "A", root / "A.safetensors"),
        "B": ck.export(root / "B", root / "B.safetensors", dtype=torch.bfloat16),
    }


@pytest.fixture(scope="module")
def s2(s1: list, exported: dict, root: Path) -> list[list[Any]]:
    """2 ranks: loads of the 4-rank checkpoints, an import, a corrupt shard, and the first half
    of the resume test (train C and D at 2 ranks, save, continue)."""
    bad = root / "A-bad"
    shutil.copytree(root / "A", bad)
    f = ck.resolve(bad) / "rank00003-of-00004.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0x40
    f.write_bytes(bytes(data))
    jobs = [
        {"cfg": "A", "src": "A", "stage": 1},
        {"cfg": "A", "src": "A", "stage": 0},
        {"cfg": "B", "src": "B", "stage": 2, "bucket": 700},
        {"cfg": "A", "src": "A", "stage": 2, "import": "A.safetensors", "save": "A-import"},
        {"cfg": "A", "src": "A-bad", "stage": 1},
        {"train": "A", "save": "C"},
        {"train": "B", "save": "D"},
    ]
    jobs += [{"cfg": "B", "src": "B", "stage": 3, "save": "B-zero3"}]
    return run_ranks(w_reshard, 2, str(root), jobs)


@pytest.fixture(scope="module")
def s4(s1: list, root: Path) -> list[list[Any]]:
    jobs = [
        {"cfg": "A", "src": "A", "stage": 2},
        {"cfg": "B", "src": "B", "stage": 1, "save": "B-3ranks"},
        {"cfg": "A", "src": "A", "stage": 0, "save": "A-stage0"},
    ]  # rank 0 alone writes
    return run_ranks(w_reshard, 3, str(root), jobs)


def saved_state(s1: list, name: str) -> dict[str, dict[str, torch.Tensor]]:
    return assemble([o[name]["at_save"] for o in s1])


def load_here(cfg: str, src: Path, stage: int, bucket: int = BUCKET) -> tuple[dict, ZeroAdamW]:
    """W=1 in this process (no process group)."""
    model, opt, _ = build(CONFIGS[cfg], stage=stage, seed=3, bucket=bucket)
    got = ck.load(opt, src, restore_rng=False)
    st = local_state(opt, model)
    st["peak"] = got.peak_buffer_bytes
    st["local_numel"] = [info.local_numel for info in opt.shard_infos()]
    return st, opt


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


def test_resume_is_bitwise_identical_on_2_ranks(s1: list, s2: list, root: Path) -> None:
    runs = {"A": "C", "B": "D"}  # trained, saved at K and continued to N in S2
    first = {"A": 5, "B": 6}
    out = run_ranks(w_resume, 2, str(root), runs)
    for name in CONFIGS:
        for r in range(2):
            ref, got = s2[r][first[name]], out[r][name]
            assert got["step"] == K and got["caller"]["rank"] == r
            assert torch.equal(torch.stack(got["losses"]), torch.stack(ref["losses"][K:])), (
                f"{name} rank {r}: losses {got['losses']} vs {ref['losses'][K:]}"
            )
            a, b = got["final"], ref["final"]
            for n in b["params"]:
                assert torch.equal(a["params"][n], b["params"][n]), f"{name} rank {r}: {n}"
            for ga, gb in zip(a["groups"], b["groups"], strict=True):
                for k in ck.KINDS:
                    assert torch.equal(ga[k], gb[k]), f"{name} rank {r}: {k}"
            assert torch.equal(a["step_count"], b["step_count"])
            assert a["lrs"] == b["lrs"]
            if b["scaler"] is not None:
                assert all(torch.equal(a["scaler"][k], b["scaler"][k]) for k in b["scaler"])
    # The async save rotated the sync one away; `latest` names the async one.
    for d, o in (("A", s1[0]["A"]), ("C", s2[0][first["A"]])):
        assert o["dirs"] == ["latest", ck.step_dir_name(K)]
        assert (root / d / "latest").read_text().strip() == ck.step_dir_name(K)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_reshard_4_to_2_1_3_ranks_and_across_stages_bitwise(
    s1: list, s2: list, s4: list, root: Path, name: str
) -> None:
    ref = saved_state(s1, name)
    cases = {
        "A": [(s2, 0, "2 ranks stage 1"), (s2, 1, "2 ranks stage 0"), (s4, 0, "3 ranks stage 2")],
        "B": [(s2, 2, "2 ranks stage 2, other bucket size"), (s4, 1, "3 ranks stage 1")],
    }
    for out, j, what in cases[name]:
        states = [o[j] for o in out]
        assert_state_equal(assemble(states), ref, f"{name} -> {what}")
        for st in states:
            assert st["step_count"].item() == K
            assert st["lrs"] == s1[0][name]["at_save"]["lrs"]
            for n, p in s1[0][name]["at_save"]["params"].items():
                assert torch.equal(st["params"][n], p), f"{what}: param {n}"
    for stage in (0, 1, 2):
        st, _ = load_here(name, root / name, stage)
        assert_state_equal(assemble([st]), ref, f"{name} -> 1 rank stage {stage}")
    # Saved again at 3 ranks (B at stage 1, A at stage 0), back at 1 rank: the same bits.
    again = {"A": "A-stage0", "B": "B-3ranks"}[name]
    st, _ = load_here(name, root / again, 2, bucket=900)
    assert_state_equal(assemble([st]), ref, f"{name} -> 3 ranks -> 1 rank")
    files = [e["name"] for e in ck.read_manifest(root / again)["files"]]
    assert files == (
        [ck.shard_file_name(0, 3)] if name == "A" else [ck.shard_file_name(r, 3) for r in range(3)]
    )


def test_reshard_stage_1_to_3_and_back_bitwise(s1: list, s2: list, root: Path) -> None:
    ref = saved_state(s1, "B")
    states = [o[7] for o in s2]
    assert_state_equal(assemble(states), ref, "B stage 1 (4 ranks) -> stage 3 (2 ranks)")
    st, _ = load_here("B", root / "B-zero3", 1)
    assert_state_equal(assemble([st]), ref, "B stage 3 (2 ranks) -> stage 1 (1 rank)")


def test_export_equals_trained_params_and_import_export_roundtrip(
    s1: list, s2: list, exported: dict, root: Path
) -> None:
    # A: fp32 params, exported fp32; B: bf16 params (fp32 master), exported bf16.
    for name, dtype in (("A", torch.float32), ("B", torch.bfloat16)):
        params = s1[0][name]["at_save"]["params"]
        sd = safetensors.torch.load_file(exported[name].files[0])
        model = make_model(11).to(dtype)
        model.load_state_dict(sd)  # strict: the tied lm_head.weight is there too
        for n, p in model.named_parameters():
            assert p.dtype == dtype and torch.equal(p.detach(), params[n]), f"{name}: {n}"
    # Imported at 2 ranks (each reading its slices), saved, exported again: the same bytes.
    again = ck.export(root / "A-import", root / "A-again.safetensors")
    assert again.files[0].read_bytes() == exported["A"].files[0].read_bytes()
    # And B at 1 rank through HF-style shards + index.
    sharded = ck.export(
        root / "B", root / "B-hf" / "model.safetensors", dtype=torch.bfloat16, max_shard_bytes=8000
    )
    assert len(sharded.files) > 2 and sharded.index is not None
    model, opt, _ = build(CONFIGS["B"], seed=9)
    ck.import_weights(opt, root / "B-hf")
    ck.save(opt, root / "B-import", step=0)
    again = ck.export(root / "B-import", root / "B-again.safetensors", dtype=torch.bfloat16)
    assert again.files[0].read_bytes() == exported["B"].files[0].read_bytes()
    # A state dict works too, and a wrong one is refused with the differences listed.
    sd = safetensors.torch.load_file(exported["A"].files[0])
    _, opt, _ = build(CONFIGS["A"], seed=9)
    ck.import_weights(opt, sd)
    sd["wpe.weight"] = sd["wpe.weight"][:5]
    sd["extra"] = torch.zeros(3)
    del sd["ln_f.bias"]
    with pytest.raises(ValueError) as e:
        ck.import_weights(opt, sd)
    for part in (
        "wpe.weight: shape [5, 22] in state dict, [12, 22] in the model",
        "missing: ln_f.bias",
        "not params of the model: ['extra']",
    ):
        assert part in str(e.value)


def test_peak_memory_of_export_and_reshard_load_is_bounded(
    s1: list, s2: list, s4: list, exported: dict, root: Path
) -> None:
    """Staging buffers, counted exactly from the tensors the code allocates: export holds one
    param (fp32 + its cast) and one slice; a load (transactional: everything is read before the
    optimizer is written) holds this rank's three fp32 shards and one slice, never more of the
    checkpoint than this rank's own state."""
    largest = max(NUMEL.values())
    total = sum(NUMEL.values())
    assert exported["A"].peak_buffer_bytes <= 2 * 4 * largest < 4 * total
    assert exported["B"].peak_buffer_bytes <= 2 * 4 * largest + 2 * largest
    for out in (s2, s4):
        for o in out:
            for res in o[:3]:
                if res is None or "error" in res:
                    continue
                assert res["peak"] <= 3 * 4 * sum(res["local_numel"]) + 4 * max(res["local_numel"])


def test_corrupt_shard_on_one_rank_fails_every_rank_clearly(s2: list) -> None:
    for o in s2:
        err = o[4]["error"]
        assert "rank00003-of-00004.safetensors: sha256 mismatch" in err, err


def _small_ckpt(root: Path, steps: int = 1, cfg: GPTConfig = CFG, stage: int = 1) -> ZeroAdamW:
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = ZeroAdamW(
        gpt_param_groups(model, 0.1),
        lr=LR,
        stage=stage,
        module=model,
        sharding=Sharding(bucket_numel=BUCKET),
    )
    x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size + 1))
    for _ in range(steps):
        model(x[:, :-1], x[:, 1:])[1].backward()
        opt.step()
    ck.save(opt, root, step=steps)
    return opt


def test_errors_name_the_file_and_the_problem(tmp_path: Path) -> None:
    good = tmp_path / "good"
    opt = _small_ckpt(good)
    d = ck.resolve(good)
    shard = "rank00000-of-00001.safetensors"

    def broken(tag: str) -> Path:
        b = tmp_path / tag
        shutil.copytree(good, b)
        return b

    def must_fail(path: Path, pattern: str, exc: type[Exception] = ck.CheckpointError) -> None:
        with pytest.raises(exc, match=pattern):
            ck.load(opt, path)
        assert ck.resolve(good) == d  # the good one is untouched and loads
        ck.load(opt, good)

    b = broken("trunc")
    f = ck.resolve(b) / shard
    f.write_bytes(f.read_bytes()[:-100])
    must_fail(b, rf"{shard}: \d+ bytes, manifest says \d+ \(truncated\)")

    b = broken("flip")
    f = ck.resolve(b) / shard
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 1
    f.write_bytes(bytes(data))
    must_fail(b, rf"{shard}: sha256 mismatch \(expected [0-9a-f]{{64}}, got [0-9a-f]{{64}}\)")
    with pytest.raises(ck.CheckpointError, match="sha256 mismatch"):
        ck.verify(b)
    assert cli_main(["ckpt", "verify", str(b)]) == 1  # a check that failed, not an error

    b = broken("missing-shard")
    (ck.resolve(b) / shard).unlink()
    must_fail(b, rf"{shard}: missing shard file")

    b = broken("missing-manifest")
    (ck.resolve(b) / ck.MANIFEST).unlink()
    must_fail(b, r"latest names 'step-00000001', but .* has no manifest.json")
    must_fail(ck.resolve(good).parent / "nowhere", "does not exist")
    must_fail(tmp_path, r"not a checkpoint: .* has no manifest.json")

    # A manifest of another checkpoint of the same model: of another step, the folder's name
    # refuses it (see [Note: latest decides]); of the same step, the shard headers do.
    other = tmp_path / "other"
    _small_ckpt(other, steps=2)
    b = broken("foreign-manifest")
    shutil.copy(ck.resolve(other) / ck.MANIFEST, ck.resolve(b) / ck.MANIFEST)
    must_fail(b, r"named for step 1, but its manifest is of step 2 \(copied or renamed\)")
    b = broken("foreign-manifest-same-step")
    m = json.loads((ck.resolve(other) / ck.MANIFEST).read_text())
    (ck.resolve(b) / ck.MANIFEST).write_text(json.dumps(dict(m, step=1)))
    must_fail(b, rf"{shard}: header metadata does not match the manifest")

    # A checkpoint of another model: ValueError listing every difference.
    small = GPTConfig(vocab_size=61, block_size=10, n_layer=1, n_head=2, n_embd=22)
    _small_ckpt(tmp_path / "small", cfg=small)
    must_fail(
        tmp_path / "small",
        r"(?s)does not match this model's parameters.*"
        r"in the model, not in the checkpoint: \['blocks.1.*"
        r"wpe.weight: shape \[10, 22\] in the checkpoint, \[12, 22\] in the model",
        ValueError,
    )


def test_failed_save_leaves_latest_on_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: Any
) -> None:
    opt = _small_ckpt(tmp_path)

    def disk_full(path: Path, n: int) -> None:
        if n > 4096:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckformat, "_write_hook", disk_full)
    with pytest.raises(OSError, match="No space left"):
        ck.save(opt, tmp_path, step=2)
    h = ck.save(opt, tmp_path, step=3, async_=True)
    with pytest.raises(ck.CheckpointError, match="No space left"):
        h.wait()
    monkeypatch.setattr(ckformat, "_write_hook", None)
    with pytest.raises(ValueError, match="caller_state must be loadable"):
        ck.save(opt, tmp_path, step=4, caller_state={"gen": torch.Generator()})
    assert (tmp_path / "latest").read_text().strip() == ck.step_dir_name(1)
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == [ck.step_dir_name(1)]
    ck.load(opt, tmp_path)
    ck.save(opt, tmp_path, step=2)  # a stale staging directory does not get in the way
    assert ck.resolve(tmp_path).name == ck.step_dir_name(2)


def _killed_save_child(root: str, marker: str) -> None:
    opt = _small_ckpt(Path(root))
    torch.save([m.clone() for m in opt.shard_state().master or []], Path(root) / "expected.pt")

    def hang(path: Path, n: int) -> None:
        # Written whole, then renamed: the parent polls for the marker and kills at once, and
        # a marker it could see between its creation and its write read as '' (a flaky CI run).
        part = Path(marker + ".part")
        part.write_text(str(path))
        os.replace(part, marker)
        time.sleep(120)

    ckformat._write_hook = hang
    x = torch.randint(0, CFG.vocab_size, (2, CFG.block_size + 1))
    opt.module(x[:, :-1], x[:, 1:])[1].backward()
    opt.step()
    ck.save(opt, root, step=2)


def test_save_killed_part_way_leaves_previous_checkpoint_loadable(tmp_path: Path) -> None:
    marker = tmp_path / "writing"
    p = multiprocessing.get_context("spawn").Process(
        target=_killed_save_child, args=(str(tmp_path), str(marker))
    )
    p.start()
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert p.is_alive() and time.monotonic() < deadline, "child died before writing"
        time.sleep(0.05)
    os.kill(p.pid, 9)  # SIGKILL while the second save is writing its shard
    p.join()
    assert ".tmp" in marker.read_text()
    assert (tmp_path / "latest").read_text().strip() == ck.step_dir_name(1)
    assert (tmp_path / f".{ck.step_dir_name(2)}.tmp").is_dir()  # the killed save's debris
    assert not (tmp_path / ck.step_dir_name(2)).exists()
    ck.verify(tmp_path)
    _, opt, _ = build({"stage": 2})
    ck.load(opt, tmp_path, restore_rng=False)
    expected = torch.load(tmp_path / "expected.pt")
    full = assemble([local_state(opt)])
    _, opt1, _ = build({"stage": 1})
    for info, m in zip(opt1.shard_infos(), expected):
        for s in info.layout.segments(0):
            n = opt1.param_names[s.param]
            assert torch.equal(
                full[n]["master"][s.start : s.start + s.length], m[s.local : s.local + s.length]
            ), n


def test_keep_last_rotation_and_cli(tmp_path: Path, capsys: Any) -> None:
    opt = _small_ckpt(tmp_path)
    for step in (2, 3, 4):
        ck.save(opt, tmp_path, step=step, keep_last=2)
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == [
        ck.step_dir_name(3),
        ck.step_dir_name(4),
    ]
    assert cli_main(["ckpt", "inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "world size   1" in out and "step         4" in out
    assert "wte.weight" in out and "also lm_head.weight" in out
    assert cli_main(["ckpt", "verify", str(tmp_path)]) == 0
    assert (
        cli_main(
            ["ckpt", "export", str(tmp_path), str(tmp_path / "m.safetensors"), "--dtype", "bf16"]
        )
        == 0
    )
    sd = safetensors.torch.load_file(tmp_path / "m.safetensors")
    assert {v.dtype for v in sd.values()} == {torch.bfloat16}
    assert {n: tuple(t.shape) for n, t in sd.items()} == {
        n: tuple(t.shape) for n, t in make_model().state_dict().items()
    }
    assert cli_main(["ckpt", "inspect", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fusedzero: error: not a checkpoint") and err.count("\n") == 1


def test_streaming_writer_matches_safetensors(tmp_path: Path) -> None:
    ts = {
        "a": torch.randn(3, 5),
        "b": torch.arange(7, dtype=torch.bfloat16),
        "c": torch.zeros(0),
        "d": torch.tensor(2.5, dtype=torch.float16),
    }
    w = ck.SafetensorsWriter(
        tmp_path / "x.safetensors",
        [(k, t.dtype, tuple(t.shape)) for k, t in ts.items()],
        {"k": "v"},
    )
    for k, t in ts.items():
        w.write(k, t)
    size, sha = w.close()
    got = safetensors.torch.load_file(tmp_path / "x.safetensors")
    assert got.keys() == ts.keys() and all(torch.equal(got[k], ts[k]) for k in ts)
    assert size == (tmp_path / "x.safetensors").stat().st_size
    assert len(sha) == 64
