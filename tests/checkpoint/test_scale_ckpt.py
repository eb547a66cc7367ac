"""Checkpoints at large W, emulated one rank at a time (fusedzero/emulate_ckpt.py): save at
W ranks (W shard files and a manifest written by the library's own save), verify, and load into
8 ranks; the manifest grows O(params + W), not O(params x W).

Every value is a function of (param, element) (a `ShardInit`), so what rank r of 8 loads can be
checked against the formula on its own segments, whatever W saved it.

About internals: fusedzero._layout, fusedzero.checkpoint._catalog, fusedzero.checkpoint._loading,
fusedzero.checkpoint._manifest.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fusedzero import Precision, Sharding, ShardInit, ZeroAdamW
from fusedzero._layout import FlatLayout
from fusedzero.checkpoint import (
    _catalog as catalog,
    _loading as loading,
    _manifest as manifest_format,
)
from fusedzero.emulate import LlamaShape, meta_model, param_groups
from fusedzero.emulate_ckpt import emulated_rank, save_emulated
from fusedzero.plan import PlanConfig, model_layouts

SHAPE = LlamaShape(n_layer=2, d=64, ffn=128, vocab=256, n_head=4, n_kv_head=2)


def _values(name: str, start: int, n: int) -> torch.Tensor:
    code = sum(map(ord, name)) % 13
    idx = torch.arange(start, start + n, dtype=torch.float64)
    return ((idx % 1009) * 1e-3 + code * 0.01 - 0.5).to(torch.float32)


def _init(name: str, out: torch.Tensor, start: int) -> None:
    out.copy_(_values(name, start, out.numel()))


def _make() -> ZeroAdamW:
    model = meta_model(SHAPE)
    return ZeroAdamW(
        param_groups(model),
        stage=3,
        module=model,
        device="cpu",
        precision=Precision(param_dtype=torch.bfloat16),
        sharding=Sharding(param_init_fn=ShardInit(_init)),
    )


def _moments(opt: ZeroAdamW) -> None:
    for b in opt.flat_groups:
        assert b.master is not None
        b.exp_avg.copy_(b.master * 2)
        b.exp_avg_sq.copy_(b.master.abs() * 3)


def _check_loaded(opt: ZeroAdamW) -> int:
    """Every segment of every buffer holds the formula's values; returns elements checked."""
    n = 0
    for b in opt.flat_groups:
        names = {s.index: s.name for s in b.layout.params}
        assert b.master is not None
        for s in b.layout.segments(b.shard_rank):
            want = _values(names[s.param], s.start, s.length).to(torch.bfloat16).float()
            sl = slice(s.local, s.local + s.length)
            assert torch.equal(b.master[sl], want), (names[s.param], s.start)
            assert torch.equal(b.exp_avg[sl], want * 2)
            assert torch.equal(b.exp_avg_sq[sl], want.abs() * 3)
            n += s.length
    return n


def _segment_entries(manifest: dict) -> int:
    return sum(len(g["segments"]) for f in manifest["files"] for g in f["groups"])


@pytest.mark.slow
def test_save_at_1024_verify_and_load_at_8(tmp_path: Path) -> None:
    # About 5 minutes on a loaded 2-core machine: 1024 optimizers built and saved in turn.
    W = 1024
    saved = save_emulated(_make, W, tmp_path, prepare=_moments)
    assert saved.shard_files == W
    catalog.verify(saved.path)  # sizes, headers and sha256 of all W files
    manifest = json.loads((saved.path / "manifest.json").read_text())
    assert manifest["world_size"] == W and len(manifest["files"]) == W
    _check_segment_bound(manifest, W)
    # Load into 8 ranks: each reads only the slices it needs, from the files holding them.
    total = 0
    for r in range(8):
        with emulated_rank(r, 8):
            opt = _make()
            for b in opt.flat_groups:  # nothing left from the init: the load must write it
                b.exp_avg.zero_()
                b.exp_avg_sq.zero_()
                assert b.master is not None
                b.master.zero_()
            loading.load(opt, saved.path)
            total += _check_loaded(opt)
    assert total == sum(p.numel() for p in meta_model(SHAPE).parameters())


def _check_segment_bound(manifest: dict, W: int) -> None:
    # Over all ranks, a bucket's pieces cut each param at most at the W - 1 piece edges, so its
    # segment entries are at most (its params + W - 1): O(params + W) per bucket, not O(params x W).
    with emulated_rank(0, W):
        layouts = [b.layout for b in _make().flat_groups]
    bound = sum(len(L.params) + L.num_buckets * (W - 1) for L in layouts)
    assert _segment_entries(manifest) <= bound, (_segment_entries(manifest), bound)


@pytest.mark.slow
def test_manifest_and_headers_grow_o_params_plus_w(tmp_path: Path) -> None:
    # What one more rank adds to the manifest is bounded (its file entry, one segment list per
    # buffer, its packed RNG state: ~20 KB here), and a shard header does not grow with W.
    sizes, headers = {}, {}
    for W in (32, 128):
        saved = save_emulated(_make, W, tmp_path / str(W))
        sizes[W] = saved.manifest_bytes
        manifest = json.loads((saved.path / "manifest.json").read_text())
        _check_segment_bound(manifest, W)
        last = sorted(saved.path.glob("*.safetensors"))[-1]
        with open(last, "rb") as f:
            headers[W] = int.from_bytes(f.read(8), "little")
    per_rank = (sizes[128] - sizes[32]) / (128 - 32)
    assert per_rank < 32_000, sizes
    # Only digits differ (W, the rank, tensor offsets), and 8-byte header padding.
    assert headers[128] <= headers[32] + 64, headers


# -- the manifest's size from the layouts, without saving -----------------------------------------
PARAM_BYTES = 512  # a param's entry and its share of the hyper-parameters (~250 B spelled here)


def _segment_count(L: FlatLayout) -> int:
    """Segments of this buffer over all ranks: each param is cut at every shard edge it crosses
    (pieces are S elements, back to back over the whole buffer), as `L.segments(r)` cuts it."""
    S = L.shard_numel
    return sum((p.offset + p.numel - 1) // S - p.offset // S + 1 for p in L.params if p.numel)


def _spelled(obj: object) -> int:
    return len(json.dumps(obj, indent=1))  # as _saving.py writes the manifest


def _manifest_bound(layouts: list[FlatLayout], W: int, n_params: int, state_bytes: int) -> int:
    """At most the bytes of the manifest of W ranks holding these buffers (every rank writes,
    stages 1-3), from the layouts alone: each segment, group entry and file entry spelled at
    its depth with the widest numbers it can hold, each rank's packed state `state_bytes` long,
    PARAM_BYTES per param and 4 KB for the rest."""
    local = max(L.local_numel for L in layouts)
    seg = [
        n_params,
        max(p.numel for L in layouts for p in L.params),
        max(L.shard_numel for L in layouts),
        local,
    ]

    def group(n: int) -> dict:
        return {
            "key": f"fg{len(layouts)}",
            "group_index": 99,
            "dtype": "bfloat16",
            "unit": len(layouts),
            "local_numel": local,
            "segments": [seg] * n,
        }

    def files(n: int, groups: int, segs: int) -> dict:
        f = {
            "name": f"rank{W:05d}-of-{W:05d}.safetensors",
            "rank": W,
            "bytes": 10**15,
            "sha256": "0" * 64,
            "groups": [group(segs)] * groups,
        }
        return {"files": [f] * n}

    # Each difference adds one item: a segment; a group with its one segment; a file with its.
    one = _spelled(files(1, 1, 1))
    seg_bytes = _spelled(files(1, 1, 2)) - one
    group_bytes = _spelled(files(1, 2, 1)) - one - seg_bytes
    file_bytes = _spelled(files(2, 1, 1)) - one - group_bytes - seg_bytes
    rank = {"rank": W, "replica": 0, "state": "x" * state_bytes}
    rank_bytes = _spelled({"ranks": [rank] * 2}) - _spelled({"ranks": [rank]})
    segments = sum(_segment_count(L) for L in layouts)
    return (
        W * (file_bytes + len(layouts) * group_bytes + rank_bytes)
        + segments * seg_bytes
        + n_params * PARAM_BYTES
        + 4096
    )


def test_manifest_cap_fits_70b_at_1024_ranks_and_no_more() -> None:
    # The largest legitimate manifest (_manifest.py, MAX_MANIFEST): a 70B model at W=1024, the
    # default buckets, bf16 or fp32 params, stages 1-3 (stage 0: rank 0 alone writes a file),
    # each rank's state as large as the cap allows. The cap is it plus MARGIN (to 2%: the
    # cap's parts are rounded), so it fits, and nothing much larger does.
    model = meta_model("llama-70b")
    n = len(list(model.parameters()))
    need = {}
    for dt in (torch.bfloat16, torch.float32):
        for stage in (1, 2, 3):
            cfg = PlanConfig(world_size=1024, precision=Precision(param_dtype=dt))
            layouts = model_layouts(model, cfg, stage)
            need[dt, stage] = _manifest_bound(layouts, 1024, n, manifest_format._RANK_BYTES)
    worst = max(need.values())
    assert worst == need[torch.float32, 3], need  # the case _manifest.py counts
    cap, margin = manifest_format.MAX_MANIFEST, 1 + manifest_format.MARGIN
    assert worst < cap and 0.98 < cap / (margin * worst) < 1.02, (cap, worst, need)


def test_save_at_4_and_load_at_3_emulated(tmp_path: Path) -> None:
    # The fast tier's run of the emulation (the slow tests above take it to W=1024): a real
    # 4-rank checkpoint written from one process, then loaded by each of 3 emulated ranks.
    saved = save_emulated(_make, 4, tmp_path, prepare=_moments)
    assert saved.shard_files == 4 and saved.manifest_bytes > 0
    catalog.verify(saved.path)
    # The bound of the 70B test above holds for a real manifest, and the count of segments.
    written = json.loads((saved.path / "manifest.json").read_text())
    with emulated_rank(0, 4):
        layouts = [b.layout for b in _make().flat_groups]
    assert sum(map(_segment_count, layouts)) == _segment_entries(written)
    state = max(len(r["state"]) for r in written["ranks"])
    bound = _manifest_bound(layouts, 4, len(written["params"]), state)
    assert saved.manifest_bytes <= bound <= 2 * saved.manifest_bytes, (saved.manifest_bytes, bound)
    total = 0
    for r in range(3):
        with emulated_rank(r, 3):
            opt = _make()
            for b in opt.flat_groups:
                assert b.master is not None
                for t in (b.master, b.exp_avg, b.exp_avg_sq):
                    t.zero_()
            loading.load(opt, saved.path)
            total += _check_loaded(opt)
    assert total == sum(p.numel() for p in meta_model(SHAPE).parameters())
