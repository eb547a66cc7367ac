"""Stage 3 from the meta device with the model's own init, run on this rank's elements only
(fusedzero/_shard_init.py): values independent of the world size, nothing gathered, the refusals.

Ranks of W = 8 and 1024 are emulated one at a time on torch's fake process group (each builds
its own shard; the collectives move nothing) and compared element-wise with a W = 1 build.

About internals: fusedzero._layout, fusedzero._local_param, fusedzero._shard_init.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fusedzero import FullUnitInit, Precision, Sharding, ZeroAdamW
from fusedzero._layout import ALIGN
from fusedzero._local_param import BLOCK, block_seed
from fusedzero.checkpoint import import_weights
from fusedzero.emulate import emulate, fake_group

V, D, F = 50, 24, 40


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, F)
        self.down = nn.Linear(F, D, bias=False)
        self.rms = nn.RMSNorm(D)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D, padding_idx=3)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.conv = nn.Conv1d(D, 8, 3)  # fan-in over a receptive field (dim 3)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.embed.weight  # tied: one param, the root unit's


def _meta_net() -> Net:
    with torch.device("meta"):
        return Net()


def hf_init(name: str, m: nn.Module) -> None:
    """What a transformers `_init_weights` does, `.data` and all (the tied head skipped)."""
    if name == "head":
        return
    if isinstance(m, nn.Linear):
        m.weight.data.normal_(mean=0.0, std=0.02)
        if m.bias is not None:
            m.bias.data.zero_()
    elif isinstance(m, nn.Embedding):
        m.weight.data.normal_(mean=0.0, std=0.02)
        m.weight.data[m.padding_idx].zero_()
    elif isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
        m.weight.data.fill_(1.0)
        if getattr(m, "bias", None) is not None:
            m.bias.data.zero_()
    elif isinstance(m, nn.Conv1d):
        nn.init.trunc_normal_(m.weight, std=0.02, a=-0.03, b=0.03)
        nn.init.constant_(m.bias, 0.5)


Init = Callable[[str, nn.Module], None] | FullUnitInit | None


def _build(
    W: int, rank: int, init: Init, dtype: torch.dtype | None = None
) -> tuple[Net, ZeroAdamW]:
    model = _meta_net()
    # bucket_numel: the smallest bucket, so that many ranks hold a few pieces of every param.
    kw = dict(
        stage=3,
        module=model,
        device="cpu",
        precision=Precision(param_dtype=dtype),
        sharding=Sharding(param_init_fn=init, bucket_numel=W * ALIGN),
    )
    if W == 1:
        return model, ZeroAdamW(model.parameters(), **kw)
    with fake_group(rank, W):
        return model, ZeroAdamW(model.parameters(), **kw)


def _full(init: Init) -> dict[str, torch.Tensor]:
    model, opt = _build(1, 0, init)
    with opt.gathered_params():
        return {n: p.detach().reshape(-1).clone() for n, p in model.named_parameters()}


def _assert_shard_is(
    opt: ZeroAdamW, ref: dict[str, torch.Tensor], where: str, master_is_cast: bool = True
) -> int:
    """Every element this rank holds equals the W = 1 value (an init: a separate fp32 master
    holds it exactly, the param shard its cast); returns how many there were."""
    held = 0
    for buf in opt.flat_groups:
        assert buf.param_shard is not None
        for seg in buf.layout.segments(buf.shard_rank):
            name = next(s.name for s in buf.layout.params if s.index == seg.param)
            got = buf.param_shard[seg.local : seg.local + seg.length]
            want = ref[name][seg.start : seg.start + seg.length].to(buf.dtype)
            assert torch.equal(got, want), (where, name, seg)
            if buf.master is not None and master_is_cast:
                exact = ref[name][seg.start : seg.start + seg.length]
                assert torch.equal(buf.master[seg.local : seg.local + seg.length], exact), where
            held += seg.length
        if buf.master is not None and master_is_cast:
            assert torch.equal(buf.param_shard, buf.master.to(buf.dtype)), where
    return held


@pytest.mark.parametrize("init", [None, hf_init], ids=["reset_parameters", "hf_init"])
def test_values_are_the_same_at_w_1_and_8(init: Init) -> None:
    torch.manual_seed(1234)
    ref = _full(init)
    held = sum(_assert_shard_is(_build(8, r, init)[1], ref, f"W=8 rank {r}") for r in range(8))
    assert held == sum(p.numel() for p in _meta_net().parameters())  # every element once
    # bf16 params hold the cast of the same draws.
    _assert_shard_is(_build(8, 5, init, torch.bfloat16)[1], ref, "W=8 rank 5, bf16")


@pytest.mark.parametrize("init", [None, hf_init], ids=["reset_parameters", "hf_init"])
def test_values_are_the_same_at_w_1_and_1024(init: Init) -> None:
    # 128 elements per rank per bucket: the first rank, the middle, the last holding data,
    # and the last rank (padding only).
    torch.manual_seed(1234)
    ref = _full(init)
    first = _build(1024, 0, init)[1]
    _assert_shard_is(first, ref, "W=1024 rank 0")
    last = max(math.ceil(b.layout.numel / ALIGN) for b in first.flat_groups)  # ranks with data
    for r in (last // 2, last - 1, 1023):
        held = _assert_shard_is(_build(1024, r, init)[1], ref, f"W=1024 rank {r}")
        assert (held > 0) == (r < last), (r, held)


def test_reset_parameters_on_local_elements_keeps_torch_s_distributions() -> None:
    torch.manual_seed(0)
    v = _full(None)
    # kaiming_uniform_(a=sqrt(5)) bounds from the full fan-in (conv: in_channels * kernel).
    for name, fan_in in (
        ("blocks.0.up.weight", D),
        ("blocks.1.down.weight", F),
        ("conv.weight", D * 3),
    ):
        bound = 1 / math.sqrt(fan_in)
        assert v[name].abs().max() <= bound and v[name].abs().max() > 0.9 * bound, name
    assert torch.equal(v["blocks.0.norm.weight"], torch.ones(D))
    assert torch.equal(v["blocks.1.rms.weight"], torch.ones(D))
    # The tied weight keeps its first holder's init, the embedding's normal_ with the padding
    # row zero (the head's kaiming_uniform_ is dropped): std 1 over 1176 draws (error ~2%).
    w = v["embed.weight"].view(V, D)
    assert torch.equal(w[3], torch.zeros(D))
    assert abs(torch.cat([w[:3], w[4:]]).std().item() - 1.0) < 0.1


def test_hf_init_padding_row_trunc_normal_and_seed() -> None:
    torch.manual_seed(7)
    v = _full(hf_init)
    assert torch.equal(v["embed.weight"].view(V, D)[3], torch.zeros(D))
    w = v["blocks.0.up.weight"]
    assert abs(w.std().item() - 0.02) < 0.003  # 960 draws: the std's error is ~2.3%
    assert torch.equal(v["blocks.0.up.bias"], torch.zeros(F))
    c = v["conv.weight"]
    assert c.abs().max() <= 0.03 and torch.equal(v["conv.bias"], torch.full((8,), 0.5))
    # The stream is keyed by torch.initial_seed(): another seed, other values; the same, same.
    torch.manual_seed(8)
    assert not torch.equal(_full(hf_init)["blocks.0.up.weight"], w)
    torch.manual_seed(7)
    assert torch.equal(_full(hf_init)["blocks.0.up.weight"], w)
    # One block's values are torch's normal_ from the documented seed (see the module's note).
    g = torch.Generator().manual_seed(block_seed(7, "blocks.0.up.weight", 0, 0))
    assert torch.equal(w, torch.empty(D * F).normal_(0.0, 0.02, generator=g))


def test_nothing_gathered_and_one_block_of_scratch() -> None:
    model, opt = _build(8, 3, None)
    z = opt.zero3
    assert z is not None and z.init_stats is not None
    assert z.materialize_peak == 0 and z.max_gathered_numel == 0
    # Scratch: one random block, at most min(BLOCK, largest param) elements.
    largest = max(p.numel() for p in _meta_net().parameters())
    assert z.init_stats.scratch_peak <= min(BLOCK, largest)
    # Random fills at W=1: embedding normal_; each Linear/Conv weight and bias uniform_ (not
    # the tied head's weight: its holder's init is dropped); every param is < BLOCK: one block
    # per fill.
    _, one = _build(1, 0, None)
    assert one.zero3 is not None and one.zero3.init_stats is not None
    assert one.zero3.init_stats.blocks_drawn == 1 + 2 * (2 + 1) + 2
    assert one.zero3.init_stats.scratch_peak == largest


def _refused(fn: Callable[[nn.Module], None], match: str) -> None:
    def init(name: str, m: nn.Module) -> None:
        if isinstance(m, nn.Linear) and m.bias is not None:
            fn(m)

    with pytest.raises((NotImplementedError, RuntimeError), match=match):
        _build(1, 0, init)


def test_refusals_name_the_op_and_the_fallback() -> None:
    _refused(lambda m: nn.init.orthogonal_(m.weight), r"aten\.new_empty.*FullUnitInit")
    _refused(
        lambda m: m.weight.mul_(torch.ones(3)),
        r"aten\.mul_\.Tensor takes a tensor of shape \(3,\), which does not broadcast to "
        r"\(40, 24\).*FullUnitInit",
    )
    _refused(
        lambda m: m.bias.view(1, F).expand(3, F).zero_(),
        r"view \(shape \(3, 40\), stride \(0, 1\)\) of blocks.0.up.bias whose elements "
        r"overlap.*FullUnitInit",
    )
    _refused(lambda m: m.weight.add_(m.weight.sum()), r"aten\.sum.*FullUnitInit")
    _refused(
        lambda m: m.weight.bernoulli_(torch.full((F, D), 0.5)),
        r"bernoulli_\.Tensor draws with per-element parameters.*FullUnitInit",
    )
    _refused(
        lambda m: setattr(m, "weight", nn.Parameter(torch.ones(F, D))),
        r"assigned new tensors to \['blocks.0.up.weight'.*FullUnitInit",
    )
    # The fallback takes any init: every rank builds each unit in full, as an eager build.
    _, opt = _build(
        1,
        0,
        FullUnitInit(
            lambda n, m: nn.init.orthogonal_(m.weight) if isinstance(m, nn.Linear) else None
        ),
    )
    assert opt.zero3 is not None and opt.zero3.materialize_peak > 0


def strided_init(name: str, m: nn.Module) -> None:
    """Writes through views that are not one run of the param: columns, a transpose."""
    if isinstance(m, nn.Linear) and m.bias is not None:  # up: (F, D)
        m.weight.t()[12].normal_(0.0, 1.0)  # column 12: F runs of one element
        m.weight[:, :5].fill_(3.0)
        m.weight[:, 7].copy_(torch.arange(F, dtype=torch.float32))
        m.weight[:, 8:10].mul_(torch.full((F, 2), 0.0)).add_(torch.arange(2.0))


def test_writes_through_strided_views_are_the_same_at_w_1_and_8(monkeypatch) -> None:
    torch.manual_seed(2)
    ref = _full(strided_init)
    w = ref["blocks.1.up.weight"].view(F, D)
    assert torch.equal(w[:, :5], torch.full((F, 5), 3.0))
    assert torch.equal(w[:, 7], torch.arange(F, dtype=torch.float32))
    assert torch.equal(w[:, 8:10], torch.arange(2.0).expand(F, 2))
    assert w[:, 12].std() > 0.5  # N(0, 1), drawn column-wise
    for r in range(8):
        _assert_shard_is(_build(8, r, strided_init)[1], ref, f"W=8 rank {r}")
    from fusedzero import _local_param as local_param

    monkeypatch.setattr(local_param, "MAX_RUNS", 4)  # a column is F = 40 runs
    with pytest.raises(NotImplementedError, match=r"in 40 runs \(more than 4\).*FullUnitInit"):
        _build(1, 0, strided_init)


def test_full_unit_init_equals_the_eager_build() -> None:
    torch.manual_seed(0)
    eager = {n: p.detach().reshape(-1).clone() for n, p in Net().named_parameters()}
    torch.manual_seed(0)
    full = _full(FullUnitInit())
    # The tied weight too: the head's reset_parameters draws into a scratch tensor, as the eager
    # head drew its own weight before tying, so the embedding's draw stays and so does the stream.
    assert full.keys() == eager.keys()
    for n, t in full.items():
        assert torch.equal(eager[n], t), n


# -- loading at stage 3: straight into the shards, unit storage never gathered --------------------
class _NewBytes(TorchDispatchMode):
    """Bytes of every new (not view, not in-place) real tensor an op makes: an upper bound on
    what a call holds above the state it writes into."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if not func.is_view and not func._schema.is_mutable:
            self.bytes += sum(
                t.numel() * t.element_size()
                for t in tree_flatten(out)[0]
                if isinstance(t, torch.Tensor) and t.device.type != "meta"
            )
        return out


def _given(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return Net().state_dict()


@pytest.mark.parametrize("how", ["load_state_dict", "import_weights"])
def test_load_at_stage_3_writes_the_shards_and_gathers_nothing(how: str) -> None:
    sd = _given(5)
    ref = {k: v.reshape(-1) for k, v in sd.items()}
    for W, rank in ((1, 0), (8, 3)):
        model, opt = _build(W, rank, None, torch.bfloat16)
        z = opt.zero3
        assert z is not None
        unit_bytes = min(z.unit_numel(u) for u in range(len(z.modules))) * 2
        with fake_group(rank, W) if W > 1 else contextlib.nullcontext():
            with _NewBytes() as count:
                if how == "load_state_dict":
                    model.load_state_dict(sd)
                else:
                    import_weights(opt, sd)
        # Before: every unit gathered at once (and a copy of the whole local master staged).
        assert z.max_gathered_numel == 0 and count.bytes <= unit_bytes, count.bytes
        # Each rank's runs: the master from the given fp32 values, the param as its cast.
        _assert_shard_is(opt, ref, f"{how} W={W} rank {rank}", master_is_cast=False)
        for buf in opt.flat_groups:
            assert buf.master is not None
            for seg in buf.layout.segments(buf.shard_rank):
                name = next(s.name for s in buf.layout.params if s.index == seg.param)
                got = buf.master[seg.local : seg.local + seg.length]
                assert torch.equal(got, ref[name][seg.start : seg.start + seg.length]), name
    if how == "load_state_dict":  # torch's own checks still run, and name the param
        bad = dict(sd, **{"blocks.1.up.bias": torch.zeros(3)})
        with pytest.raises(RuntimeError, match="size mismatch for blocks.1.up.bias"):
            model.load_state_dict(bad)
        assert all(isinstance(p, nn.Parameter) for p in model.parameters())


def test_load_state_dict_regathers_a_unit_that_was_gathered() -> None:
    model, opt = _build(1, 0, None)
    sd = _given(6)
    with opt.gathered_params():
        model.load_state_dict(sd)
        assert torch.equal(model.blocks[0].up.weight, sd["blocks.0.up.weight"])
    assert opt.zero3 is not None
    assert all(u.state.name == "FREE" for u in opt.zero3.units)


def test_emulate_with_the_model_s_own_init() -> None:
    # bench/bench_shard_init.py's 70B at W=1024, in miniature: the same bytes as the plan.
    e = emulate("tiny", world_size=64, rank=63, init="model")
    assert e.materialized and e.equals_plan
    with pytest.raises(ValueError, match="init must be 'zeros' or 'model', got 'ones'"):
        emulate("tiny", world_size=64, rank=63, init="ones")  # type: ignore[arg-type]


def _gloo_rank(rank: int, world: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(100 + rank)  # each rank its own seed: rank 0's keys every rank's stream
    model = _meta_net()
    opt = ZeroAdamW(
        model.parameters(),
        stage=3,
        module=model,
        device="cpu",
        sharding=Sharding(bucket_numel=world * ALIGN),
    )
    with opt.gathered_params():
        return {n: p.detach().reshape(-1).clone() for n, p in model.named_parameters()}


@pytest.mark.slow  # spawns ranks
def test_two_gloo_ranks_with_their_own_seeds_build_the_w_1_model() -> None:
    from fusedzero.testing import run_ranks

    torch.manual_seed(100)
    ref = _full(None)
    for rank, got in enumerate(run_ranks(_gloo_rank, 2)):
        for n, v in ref.items():
            assert torch.equal(got[n], v), (rank, n)


def test_import_weights_at_stage_3_from_safetensors_files(tmp_path) -> None:
    import safetensors.torch

    sd = {k: v.contiguous() for k, v in _given(9).items() if k != "head.weight"}  # tied
    safetensors.torch.save_file(sd, tmp_path / "model.safetensors")
    ref = {k: v.reshape(-1) for k, v in sd.items()}
    for r in (0, 3):
        _, opt = _build(8, r, None, torch.bfloat16)
        with fake_group(r, 8):
            import_weights(opt, tmp_path)  # each rank reads the rows covering its runs
        _assert_shard_is(opt, ref, f"safetensors, W=8 rank {r}", master_is_cast=False)


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.logit_scale = nn.Parameter(torch.empty(1))
        self.proj = nn.Linear(4, 4)


def test_the_stand_in_passes_for_an_nn_parameter_that_requires_grad() -> None:
    # transformers' Aimv2 `_init_weights` asks `isinstance(m.logit_scale, nn.Parameter)`.
    def init(name: str, m: nn.Module) -> None:
        if isinstance(getattr(m, "logit_scale", None), nn.Parameter):
            assert m.logit_scale.requires_grad
            nn.init.constant_(m.logit_scale, 2.5)
        if isinstance(m, nn.Linear):
            m.reset_parameters()

    with torch.device("meta"):
        model = _Scaled()
    opt = ZeroAdamW(
        model.parameters(),
        stage=3,
        module=model,
        device="cpu",
        sharding=Sharding(param_init_fn=init),
    )
    with opt.gathered_params():
        assert model.logit_scale.item() == 2.5


def _timm_trunc_normal_(t: torch.Tensor, std: float) -> None:
    """timm's `trunc_normal_` at a = -2, b = 2, std << 1: uniform_(-1, 1), then erfinv_."""
    t.uniform_(-1.0, 1.0)
    t.erfinv_()
    t.mul_(std * math.sqrt(2.0))
    t.clamp_(min=-2.0, max=2.0)


def test_bf16_params_are_the_cast_of_an_fp32_init_of_the_master() -> None:
    # In bf16, uniform_(-1, 1) gives exactly +-1 about once in 256 draws: erfinv_ makes that
    # inf, clamped to +-2 (~1000 of these 256K elements); in fp32, once in 2^24.
    def init(name: str, m: nn.Module) -> None:
        _timm_trunc_normal_(m.weight, std=0.02)

    with torch.device("meta"):
        model = nn.Linear(512, 512, bias=False)
    torch.manual_seed(0)
    opt = ZeroAdamW(
        model.parameters(),
        stage=3,
        module=model,
        device="cpu",
        precision=Precision(param_dtype=torch.bfloat16),
        sharding=Sharding(param_init_fn=init),
    )
    (buf,) = opt.flat_groups
    assert buf.master is not None and buf.master.dtype == torch.float32
    assert int((buf.master.abs() > 0.2).sum()) == 0  # 10 sigma
    assert torch.equal(buf.param_shard, buf.master.to(torch.bfloat16))


class _Rotary(nn.Module):
    """A buffer-only module (a rotary embedding's `inv_freq`), filled by `reset_parameters`."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.empty(D // 2), persistent=False)

    def reset_parameters(self) -> None:
        self.inv_freq.copy_(1.0 / 10000 ** (torch.arange(0, D, 2) / D))


class _WithBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rotary = _Rotary()
        self.norm = nn.BatchNorm1d(D)
        self.up = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.norm(x) * self.rotary.inv_freq.repeat(2))


@pytest.mark.parametrize("init", [None, FullUnitInit()], ids=["local", "full_unit"])
def test_meta_buffers_are_materialised_initialised_and_the_same_at_any_w(init: Init) -> None:
    def build(W: int, rank: int) -> tuple[_WithBuffers, ZeroAdamW]:
        with torch.device("meta"):
            model = _WithBuffers()
        kw = dict(stage=3, module=model, device="cpu", sharding=Sharding(param_init_fn=init))
        with fake_group(rank, W) if W > 1 else contextlib.nullcontext():
            return model, ZeroAdamW(model.parameters(), **kw)

    want = {
        "rotary.inv_freq": 1.0 / 10000 ** (torch.arange(0, D, 2) / D),
        "norm.running_mean": torch.zeros(D),
        "norm.running_var": torch.ones(D),
        "norm.num_batches_tracked": torch.tensor(0),
    }
    for W, rank in [(4, 0), (4, 3), (1, 0)]:
        model, _ = build(W, rank)
        got = dict(model.named_buffers())
        assert got.keys() == want.keys()
        for n, b in got.items():
            assert torch.equal(b, want[n]), (W, rank, n)
    model(torch.randn(4, D)).sum().backward()  # runs on real buffers (W = 1)
    assert model.norm.num_batches_tracked.item() == 1


def test_default_init_names_modules_without_reset_parameters() -> None:
    # nn.MultiheadAttention has only `_reset_parameters`: its in_proj_weight stayed at zeros.
    with torch.device("meta"):
        model = nn.TransformerEncoderLayer(16, 2, 32)
    with pytest.raises(ValueError, match=r"self_attn \(MultiheadAttention\).*param_init_fn"):
        ZeroAdamW(model.parameters(), stage=3, module=model, device="cpu")


class _Computed(nn.Module):
    """Buffers computed in `__init__` (on the meta device: no values), a `reset_parameters`
    that resets only the params."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, D, 2) / D), False)
        self.register_buffer("scale", torch.full((3,), 2.0))
        self.weight = nn.Parameter(torch.empty(D))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class _HoldsComputed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rotary = _Computed()
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(2))


@pytest.mark.parametrize("init", [None, FullUnitInit(), hf_init], ids=["local", "full", "fn"])
def test_a_meta_buffer_no_init_writes_is_refused_by_name(init: Init) -> None:
    with torch.device("meta"):
        model = _HoldsComputed()
    with pytest.raises(
        ValueError,
        match=r"buffers rotary\.inv_freq, rotary\.scale .*"
        r"did not write them.*reset_parameters\(\).*param_init_fn=fn.*off the meta",
    ):
        ZeroAdamW(
            model.parameters(),
            stage=3,
            module=model,
            device="cpu",
            sharding=Sharding(param_init_fn=init),
        )


class _Writes(nn.Module):
    """A float and an integer buffer, filled by `reset_parameters` in the way `how` names."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.register_buffer("inv_freq", torch.empty(D // 2), persistent=False)
        self.register_buffer("steps", torch.empty(2, dtype=torch.int64))

    def reset_parameters(self) -> None:
        freq = 1.0 / 10000 ** (torch.arange(0, D, 2) / D)
        if self.how == "in_place":
            self.inv_freq.copy_(freq)
            self.steps.fill_(0)
        elif self.how == "data":  # a fresh version counter: told by the values
            self.inv_freq.data.copy_(freq)
            self.steps.data.zero_()
        else:
            self.inv_freq = freq
            self.steps = torch.zeros(2, dtype=torch.int64)


@pytest.mark.parametrize("init", [None, FullUnitInit()], ids=["local", "full"])
@pytest.mark.parametrize("how", ["in_place", "data", "assigned"])
def test_a_meta_buffer_the_init_writes_in_any_way_is_kept(how: str, init: Init) -> None:
    with torch.device("meta"):
        model = nn.Sequential(_Writes(how), nn.ModuleList([nn.Linear(D, D)]))
    kw = dict(stage=3, module=model, device="cpu", sharding=Sharding(param_init_fn=init))
    ZeroAdamW(model.parameters(), **kw)
    assert torch.equal(model[0].inv_freq, 1.0 / 10000 ** (torch.arange(0, D, 2) / D))
    assert torch.equal(model[0].steps, torch.zeros(2, dtype=torch.int64))


class _TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D, padding_idx=0)
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(2))
        self.head = nn.Linear(D, V)  # its bias is its own
        self.head.weight = self.embed.weight


@pytest.mark.parametrize("W", [1, 8])
def test_a_tied_weight_gets_its_first_holder_s_init(W: int) -> None:
    """The embedding's init (std 1, padding row zero), not the head's (kaiming_uniform_, std
    0.118); the head's bias still gets the head's; at W = 8 each rank holds the W = 1 values."""
    torch.manual_seed(0)
    eager = _TiedLM()
    for init in (FullUnitInit(), None):
        torch.manual_seed(0)
        model, opt = _build_tied(1, 0, init)
        with opt.gathered_params():
            got = {n: p.detach().clone() for n, p in model.named_parameters()}
        w = got["embed.weight"]
        assert torch.equal(w[0], torch.zeros(D))
        # 1176 draws of N(0, 1): the std's error is ~2%, the head's would be 0.118.
        assert abs(w[1:].std().item() - 1.0) < 0.1, init
        b = got["head.bias"]
        assert b.abs().max() <= D**-0.5 and b.abs().max() > 0, init
        if init is not None:  # the eager build's values, the RNG stream included
            for n, p in eager.named_parameters():
                assert torch.equal(got[n], p.detach()), n
        elif W > 1:
            ref = {n: t.reshape(-1) for n, t in got.items()}
            for r in range(W):
                torch.manual_seed(0)
                _assert_shard_is(_build_tied(W, r, None)[1], ref, f"W={W} rank {r}")


def _build_tied(W: int, rank: int, init: Init) -> tuple[_TiedLM, ZeroAdamW]:
    with torch.device("meta"):
        model = _TiedLM()
    kw = dict(
        stage=3,
        module=model,
        device="cpu",
        sharding=Sharding(param_init_fn=init, bucket_numel=W * ALIGN),
    )
    with fake_group(rank, W) if W > 1 else contextlib.nullcontext():
        return model, ZeroAdamW(model.parameters(), **kw)


def test_trunc_normal_patch_restores_what_it_found_and_nests() -> None:
    """The local init's `trunc_normal_` patch (process-wide: see [Note: the trunc_normal_ patch
    is process-wide]) hands plain tensors to the function that was there on entry, restores that
    function (a wrapper installed before it, not torch's own) and survives nesting."""
    from fusedzero._local_param import local_trunc_normal

    calls: list[tuple[int, ...]] = []
    original = nn.init.trunc_normal_

    def wrapper(t: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(tuple(t.shape))
        return original(t, *args, **kwargs)

    nn.init.trunc_normal_ = wrapper
    try:
        with local_trunc_normal():
            with local_trunc_normal():
                assert nn.init.trunc_normal_ is not wrapper
            assert nn.init.trunc_normal_ is not wrapper  # the outer entry still holds
            nn.init.trunc_normal_(torch.empty(3, 5))  # a plain tensor: the entry's function
        assert nn.init.trunc_normal_ is wrapper
        assert calls == [(3, 5)]
    finally:
        nn.init.trunc_normal_ = original
