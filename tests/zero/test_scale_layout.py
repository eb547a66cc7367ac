"""Large-W geometry without a cluster: 64-bit offsets, per-rank bucket sizes, padding bounds.

Everything here is arithmetic or meta-device tensors: no storage past a few KB, no process
group. The emulated optimizer itself is tests/zero/test_scale.py (slow tier).

About internals: fusedzero._flat, fusedzero._layout, fusedzero.kernels._launch,
fusedzero.kernels._table.
"""

from __future__ import annotations

import pytest
import torch

from fusedzero._flat import FlatBuffer
from fusedzero._layout import (
    ALIGN,
    DEFAULT_BUCKET_NUMEL,
    MIN_SHARD_BYTES,
    build_layout,
    default_bucket_numel,
)
from fusedzero.emulate import meta_model
from fusedzero.kernels import Strided, _launch, _table as table
from fusedzero.plan import LinkModel, PlanConfig, plan_model
from fusedzero.stage import Stage

BIG = 1 << 31
META = torch.device("meta")


def _covers(L, ranks) -> dict[int, list[tuple[int, int]]]:
    """Every param's element runs over the given ranks, sorted."""
    runs: dict[int, list[tuple[int, int]]] = {}
    for r in ranks:
        for s in L.segments(r):
            assert 0 <= s.local and s.local + s.length <= L.local_numel, (r, s)
            runs.setdefault(s.param, []).append((s.start, s.start + s.length))
    return {k: sorted(v) for k, v in runs.items()}


def test_flat_buffer_past_2_31_elements_on_meta() -> None:
    # One 2**31-element matrix, then a small param whose offset is past 2**31: a buffer of
    # > 2**31 elements at W=1024, built on the meta device (no storage), last rank.
    W = 1024
    with torch.device("meta"):
        ps = [
            torch.nn.Parameter(torch.empty(65536, 32768)),
            torch.nn.Parameter(torch.empty(3, 1000)),
        ]
    buf = FlatBuffer(
        group_index=0,
        params=ps,
        names=["big", "small"],
        indices=[0, 1],
        dtype=torch.bfloat16,
        stage=Stage.GRADIENTS,
        world_size=W,
        rank=W - 1,
        bucket_numel=None,
        reduce_dtype=torch.float32,
        device=META,
    )
    L = buf.layout
    assert L.params[1].offset == BIG and L.numel == BIG + 3000
    assert L.padded_numel > BIG and L.padded_numel % (W * ALIGN) == 0
    assert buf.param_flat is not None and buf.param_flat.numel() == L.padded_numel
    assert ps[1].shape == (3, 1000)  # a view into the buffer past 2**31
    assert ps[1].storage_offset() == BIG
    # The last rank's segments: its pieces of both params, in local order, offsets exact.
    segs = L.segments(W - 1)
    assert [s.param for s in segs][-1] == 1
    assert sum(s.length for s in segs if s.param == 1) == 3000
    last = segs[-1]
    assert last.start + last.length == 3000
    # The kernel's view of this rank's pieces passes the launcher's checks with 64-bit sizes.
    own = buf.own(buf.param_flat)
    _launch.check_stream("out", own, (torch.bfloat16,), L.num_buckets, L.shard_numel, META)
    assert own.base == (W - 1) * L.shard_numel


def test_segments_partition_an_8b_buffer_at_1024_ranks() -> None:
    # The 8B shape's decay group as one stage-1/2 buffer (8.0e9 elements > 2**31) at W=1024:
    # the ranks' segments cover every param exactly once, what checkpoint resharding relies on.
    shapes = [tuple(p.shape) for p in meta_model("llama-8b").parameters() if p.dim() >= 2]
    L = build_layout([(i, f"p{i}", sh) for i, sh in enumerate(shapes)], 1024, itemsize=2)
    assert L.numel > 3 * BIG and L.params[-1].offset > 3 * BIG
    runs = _covers(L, range(1024))
    for i, (a, b) in enumerate(shapes):
        cur = 0
        for lo, hi in runs[i]:
            assert lo == cur, (i, lo, cur)
            cur = hi
        assert cur == a * b, (i, cur)


def test_default_bucket_is_chosen_per_rank() -> None:
    for W, itemsize in [(1, 2), (8, 2), (64, 2), (128, 2), (1024, 2), (1024, 4), (4096, 2)]:
        b = default_bucket_numel(W, itemsize)
        assert b >= DEFAULT_BUCKET_NUMEL
        # Each rank's shard of a bucket is at least MIN_SHARD_BYTES...
        assert (b // W) * itemsize >= MIN_SHARD_BYTES, (W, itemsize)
        # ...and the bucket is no larger than that needs, or the fixed size at small W.
        assert b == max(DEFAULT_BUCKET_NUMEL, W * MIN_SHARD_BYTES // itemsize)
    assert default_bucket_numel(1024, 2) == 1024 * (1 << 19)  # 1 MiB of bf16 per rank
    # An explicit bucket_numel keeps its meaning: elements per bucket, all ranks together.
    L = build_layout([(0, "w", (1 << 15, 1 << 12))], 1024, 1 << 25)  # 4 buckets' worth
    assert L.num_buckets == 4 and L.bucket_numel == 1 << 25
    assert L.shard_numel == (1 << 25) // 1024


@pytest.mark.parametrize("W", [8, 64, 256, 1024, 4096])
def test_padding_under_half_a_percent_at_every_w(W: int) -> None:
    # Optimizer state per rank against the ZeRO formula 12 Psi / W: the excess is padding
    # (alignment holes, bucket tails). With one global 2**25-element bucket it reached 1.1%
    # at W=4096, stage 3.
    plan = plan_model(meta_model("llama-8b"), PlanConfig(world_size=W))
    for stage in (1, 2, 3):
        opt = plan.stages[stage].optimizer_bytes
        ideal = 12 * plan.params / W
        assert ideal <= opt <= ideal * 1.005, (W, stage, opt / ideal - 1)


def test_kernel_table_entries_past_2_31_are_exact_int64() -> None:
    # Two pieces of a 2**32-element fp32 stream (meta: addresses are 0, nothing allocated):
    # their offsets, the second past 2**31, land in the int64 table exactly.
    t = torch.empty(1 << 32, dtype=torch.float32, device=META)
    S = 1 << 20
    buf = table.Buffer((Strided(t, BIG + 4096, 128),), 2, S, 0)
    _launch.check_stream("master", buf.streams[0], (torch.float32,), 2, S, META)
    pieces = table.pieces_of(buf)
    assert [p.starts[0] for p in pieces] == [128, BIG + 4096 + 128]
    tab = table.build_table(pieces, 1024, torch.device("cpu"))
    assert tab.pieces.dtype == torch.int64
    assert tab.pieces[:, table.Col.STREAMS].tolist() == [128, BIG + 4096 + 128]
    assert tab.pieces[:, table.Col.NUMEL].tolist() == [S, S]
    assert tab.pieces[:, table.Col.FIRST].tolist() == [0, S // 1024]
    assert tab.aligned


def test_launcher_checks_name_sizes_past_2_31() -> None:
    t = torch.empty(BIG + 100, dtype=torch.float32, device=META)
    _launch.check_stream("grad", Strided(t, BIG, 0), (torch.float32,), 2, 100, META)
    with pytest.raises(ValueError, match=f"has {BIG + 100} elements.*need {BIG + 101}"):
        _launch.check_stream("grad", Strided(t, BIG, 1), (torch.float32,), 2, 100, META)
    with pytest.raises(ValueError, match="int64"):
        table.check_entry("offset", 1 << 63)
    with pytest.raises(ValueError, match="int64"):
        table.check_entry("numel", -1)


def test_alpha_beta_ring_model() -> None:
    # W=4, one flat buffer in one bucket: stage 1 is one reduce-scatter and one all-gather
    # (3 ring steps each) plus the grad-norm all-reduce (6): 12 steps.
    p = torch.nn.Parameter(torch.empty(4 * ALIGN * 10, device="meta"))
    from fusedzero.plan import plan_groups

    plan = plan_groups([[("w", p)]], PlanConfig(world_size=4))
    assert plan.ring_steps == {0: 6, 1: 12, 2: 12, 3: 15}
    link = LinkModel(bandwidth=1e9, latency=1e-5)
    got = plan.comm_seconds(link)
    for s in range(4):
        assert got[s] == pytest.approx(
            plan.ring_steps[s] * 1e-5 + plan.stages[s].comm_bytes_per_step / 1e9
        )
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        LinkModel(bandwidth=0)


def test_shard_init_writes_only_the_local_shard_from_element_indices() -> None:
    # Stage 3 from the meta device with a ShardInit: the values are a function of (name,
    # element), written segment by segment; gathered, every param holds the formula's values
    # (bf16), and no unit was gathered to initialise them (materialize_peak stays 0).
    from fusedzero import Precision, Sharding, ShardInit, ZeroAdamW
    from fusedzero.emulate import LlamaShape, param_groups

    def values(name: str, start: int, n: int) -> torch.Tensor:
        return torch.arange(start, start + n, dtype=torch.float32) * 1e-3 + len(name)

    model = meta_model(LlamaShape(n_layer=2, d=32, ffn=64, vocab=48, n_head=4, n_kv_head=2))
    opt = ZeroAdamW(
        param_groups(model),
        stage=3,
        module=model,
        device="cpu",
        precision=Precision(param_dtype=torch.bfloat16),
        sharding=Sharding(
            param_init_fn=ShardInit(lambda n, out, s: out.copy_(values(n, s, out.numel()))),
            bucket_numel=1000,
        ),
    )
    assert opt.zero3 is not None and opt.zero3.materialize_peak == 0
    with opt.gathered_params():
        for name, p in model.named_parameters():
            want = values(name, 0, p.numel()).to(torch.bfloat16).view(p.shape)
            assert torch.equal(p.detach(), want), name
    for b in opt.flat_groups:
        assert b.master is not None and b.param_shard is not None
        assert torch.equal(b.master, b.param_shard.float())
