"""`fusedzero plan --optimizer muon`: the bytes and comm of ZeroMuon at every stage, and the
Newton-Schulz FLOPs per rank and padding of the Muon buffers as the engine lays them out (the
owner layout at stages 1-3 over several ranks).

About internals: fusedzero._owner_layout (the layout the numbers must be those of),
fusedzero.rules._muon (`MUON.blocks`), the engine's flat buffers (`opt.flat_groups`, each one's
`layout` and `local_shard()`)."""

from __future__ import annotations

import json

import pytest
import torch

from fusedzero import Precision, Sharding, ZeroMuon, muon_param_groups
from fusedzero._owner_layout import build_owner_layout, rank_costs
from fusedzero.app.model import GPT, GPTConfig, gpt_muon_param_groups
from fusedzero.app.plan_cli import preset_model
from fusedzero.cli import main
from fusedzero.plan import PlanConfig, plan_groups, plan_model, plan_muon_model
from fusedzero.rules._muon import MUON
from fusedzero.testing import fake_group

from _helpers import assert_memory_is_plan, make_gpt

CFG = dict(n_layer=2, n_head=2, n_embd=64, block_size=16, vocab_size=64)


def _groups(model: torch.nn.Module) -> list[dict]:
    return gpt_muon_param_groups(model, 0.1, muon_lr=0.02, lr=3e-3, betas=(0.9, 0.95))


def _muon(
    model: torch.nn.Module, stage: int, precision: Precision, bucket: int | None, **kw
) -> ZeroMuon:
    return ZeroMuon(
        _groups(model),
        stage=stage,
        module=model,
        max_grad_norm=1.0,
        precision=precision,
        sharding=Sharding(bucket_numel=bucket),
        **kw,
    )


@pytest.mark.parametrize("states", ["fp32", "bf16"])
@pytest.mark.parametrize("pdt", [torch.float32, torch.bfloat16], ids=str)
def test_plan_equals_zero_muon_memory_and_comm(states: str, pdt: torch.dtype) -> None:
    """At one rank (every stage) and at stage 0 on two ranks, the plan's resident bytes and
    comm bytes are ZeroMuon's `memory()` and `opt.comm` after a step, to the byte: the Muon
    groups keep one state field and the Newton-Schulz scratch, the AdamW groups two fields."""
    with torch.device("meta"):
        meta = GPT(GPTConfig(**CFG))
    precision = Precision(param_dtype=pdt, reduce_dtype=torch.float32, states=states)
    bucket = 5000  # several buckets per flat buffer
    for W, stages in ((1, (0, 1, 2, 3)), (2, (0,))):
        cfg = PlanConfig(world_size=W, precision=precision, sharding=Sharding(bucket_numel=bucket))
        plan = plan_muon_model(meta, cfg)
        adamw_only = plan_model(meta, cfg)
        for stage in stages:
            with fake_group(0, W):
                torch.manual_seed(0)
                model = GPT(GPTConfig(**CFG))
                opt = _muon(model, stage, precision, bucket)
                assert [r.name for r in opt.group_rules] == [r.name for r in plan.group_rules]
                x = torch.randint(0, CFG["vocab_size"], (2, CFG["block_size"]))
                model(x, x)[1].backward()
                opt.step()
                opt.zero_grad()
                want = plan.stages[stage]
                what = f"W={W} stage={stage} {pdt} states={states}"
                assert_memory_is_plan(opt, want, what)
                opt.close()
            # fp32 states: Muon's 4 B of momentum and 2 B of Newton-Schulz scratch per element
            # against AdamW's 8 B of moments (bf16 states: 2 + 2 against 2 + 2)
            if states == "fp32":
                assert want.optimizer_bytes < adamw_only.stages[stage].optimizer_bytes, what


@pytest.mark.parametrize("bucket", [5000, None], ids=["bins-of-the-largest", "default-bucket"])
@pytest.mark.parametrize("W", [2, 4])
def test_plan_equals_zero_muon_at_stages_1_to_3_over_ranks(W: int, bucket: int | None) -> None:
    """Over W ranks at stages 1-3 (each rank of a fake group, one at a time), where the Muon
    buffers take the owner layout: `plan_groups` with the optimizer's group rules gives every
    rank's `memory()` and its comm bytes after a step to the byte, and `plan_muon_model`'s
    Muon numbers are the engine's buffers': their padding, and each rank's Newton-Schulz FLOPs
    over the matrices its local shards hold. With buckets too small for more than a matrix a
    bin, and with the default bucket (a rank's bins in one bucket)."""
    with torch.device("meta"):
        meta = GPT(GPTConfig(**CFG))
    names = {id(p): n for n, p in meta.named_parameters()}
    groups = [[(names[id(p)], p) for p in g["params"]] for g in _groups(meta)]
    precision = Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    cfg = PlanConfig(world_size=W, precision=precision, sharding=Sharding(bucket_numel=bucket))
    m = plan_muon_model(meta, cfg).muon_layout
    assert m is not None
    for stage in (1, 2, 3):
        flops, pads = [0] * W, set()
        for r in range(W):
            with fake_group(r, W):
                model = make_gpt(GPTConfig(**CFG))
                opt = _muon(model, stage, precision, bucket, device="cpu")
                plan = plan_groups(groups, cfg, model=meta, rules=opt.group_rules)
                x = torch.randint(0, CFG["vocab_size"], (2, CFG["block_size"]))
                model(x, x)[1].backward()
                opt.step()
                want = plan.stages[stage]
                what = f"W={W} stage={stage} rank={r}"
                assert_memory_is_plan(opt, want, what)
                pad = 0
                for buf in opt.flat_groups:
                    if opt.group_rules[buf.group_index].element_wise:
                        continue
                    pad += buf.layout.padded_numel - buf.layout.param_numel
                    shard = buf.local_shard()
                    for seg in shard.segments:
                        b = MUON.blocks(shard.shapes[seg.param])
                        assert seg.length % b.numel == 0, what  # whole matrices only
                        flops[r] += seg.length // b.numel * b.cost
                pads.add(pad)
                opt.close()
        got = (m.padding, m.ns_flops_max, m.ns_flops_mean, m.ns_balance)
        if stage == 3:
            got = (m.stage3_padding, m.stage3_ns_flops_max, m.stage3_ns_flops_mean)
            got += (m.stage3_ns_balance,)
        mean = sum(flops) / W
        assert got == (pads.pop(), max(flops), mean, max(flops) / mean), (stage, flops)
        assert not pads, (stage, pads)  # every rank's buffers alike


def test_memory_is_plan_where_the_layout_takes_larger_bins() -> None:
    """A 3-layer model's 12 Muon matrices over 2 ranks: bins of the largest matrix make 9 bins
    in 10 slots (one empty); the default bucket lets the layout take one bin a rank of half the
    matrices each, with no padding. Both ranks' `memory()` and comm after a step are the plan's
    to the byte, and the Muon buffer pads nothing."""
    cfg3 = {**CFG, "n_layer": 3}
    with torch.device("meta"):
        meta = GPT(GPTConfig(**cfg3))
    names = {id(p): n for n, p in meta.named_parameters()}
    groups = [[(names[id(p)], p) for p in g["params"]] for g in _groups(meta)]
    precision = Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    cfg = PlanConfig(world_size=2, precision=precision)
    for stage in (1, 2):
        for r in range(2):
            with fake_group(r, 2):
                model = make_gpt(GPTConfig(**cfg3))
                opt = _muon(model, stage, precision, None, device="cpu")
                (muon,) = [b for b in opt.flat_groups if b.group_index == 0]
                assert muon.layout.padded_numel == muon.layout.param_numel, muon.layout
                assert muon.layout.num_buckets == 1
                x = torch.randint(0, CFG["vocab_size"], (2, CFG["block_size"]))
                model(x, x)[1].backward()
                opt.step()
                plan = plan_groups(groups, cfg, model=meta, rules=opt.group_rules)
                assert_memory_is_plan(opt, plan.stages[stage], f"stage {stage} rank {r}")
                opt.close()


def test_the_plan_lays_out_muon_with_the_bucket_size_the_engine_gets() -> None:
    """The bucket size reaches the plan's owner layout as it reaches FlatBuffer's: GPT-2 124M at
    W = 8 pads 11% with the default bucket (bins of the largest matrix) and nothing with a
    bucket of 100M elements (a bin of an eighth of the Muon params a rank); the plan says from
    which bucket size on that is reached (the Muon params: one bucket), and it is."""
    model = preset_model("gpt2")
    default = plan_muon_model(model, PlanConfig(world_size=8)).muon_layout
    big = PlanConfig(world_size=8, sharding=Sharding(bucket_numel=100_000_000))
    larger = plan_muon_model(model, big).muon_layout
    assert default is not None and larger is not None
    assert default.padding == 4 * 768 * 3072 and larger.padding == 0
    # The plan names the bucket from which the least padding is reached, and it is reached.
    assert default.least_padding == 0 == larger.least_padding
    hint = PlanConfig(
        world_size=8, sharding=Sharding(bucket_numel=default.least_padding_bucket_numel)
    )
    at = plan_muon_model(model, hint).muon_layout
    assert at is not None and at.padding == 0 and at.least_padding_bucket_numel == 84_934_656
    table = plan_muon_model(model, PlanConfig(world_size=8)).table()
    assert "stages 1-2 with --bucket-numel >= 84,934,656 (fewer, larger bins): padding 0" in table
    assert "--bucket-numel >=" not in plan_muon_model(model, hint).table()


@pytest.mark.parametrize("W", [1, 8, 64])
def test_layout_numbers_are_the_owner_layouts(W: int) -> None:
    """On GPT-2 124M the stage 1-2 numbers the plan reports (NS FLOPs per rank: max, mean,
    max/mean; padding) are those of `build_owner_layout` over the model's Muon params, one
    buffer of them (on one rank: no padding, every matrix on rank 0)."""
    model = preset_model("gpt2")
    plan = plan_muon_model(model, PlanConfig(world_size=W))
    muon = {id(p) for g in muon_param_groups(model) if g["use_muon"] for p in g["params"]}
    items = [
        (i, n, tuple(p.shape)) for i, (n, p) in enumerate(model.named_parameters()) if id(p) in muon
    ]
    blocks = {i: MUON.blocks(shape) for i, _, shape in items}
    numel = sum(p.numel() for p in model.parameters() if id(p) in muon)
    if W == 1:
        flops, pad = [sum(b.cost for b in blocks.values())], 0
    else:
        L = build_owner_layout(items, list(blocks.values()), W)
        flops, pad = rank_costs(L, blocks), L.padded_numel - numel
    m = plan.muon_layout
    assert m is not None and m.world_size == W and m.muon_params == numel
    assert (m.ns_flops_max, m.ns_flops_mean) == (max(flops), sum(flops) / W)
    assert m.ns_balance == max(flops) / (sum(flops) / W)
    assert (m.padding, m.padding_fraction) == (pad, pad / numel)
    if W == 8:  # 5 buckets of 8 bins, 4 empty (docs/muon.md, "The owner layout")
        assert pad == 4 * L.shard_numel


def test_cli_muon_table_json_and_refusals(capsys: pytest.CaptureFixture[str]) -> None:
    """The table names both rules' state and the owner layout's numbers at stages 1-2 and 3;
    --json carries them; what the Muon plan cannot take is one line, exit 2."""
    assert main(["plan", "--preset", "gpt2", "-W", "8", "--optimizer", "muon"]) == 0
    table = capsys.readouterr().out
    for want in (
        "momentum_buffer",
        "exp_avg + exp_avg_sq",
        "max/mean",
        "padding",
        "Muon owner layout (fusedzero/_owner_layout.py) at W=8, as ZeroMuon builds it",
        "stages 1-2:",
        "stage 3 (a buffer per unit):",
    ):
        assert want in table, table
    for gone in ("planned", "not yet"):
        assert gone not in table, table
    assert main(["plan", "--preset", "gpt2", "-W", "8", "--optimizer", "muon", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    want = plan_muon_model(preset_model("gpt2"), PlanConfig(world_size=8))
    assert d["muon_layout"] == want.muon_layout._asdict()
    assert d["group_rules"] == ["muon", "adamw", "adamw"]
    assert d["stages"]["2"] == want.stages[2]._asdict()
    for argv, words in (
        (["--params", "1e9"], "use --preset, --shape or --hf-config"),
        (["--preset", "gpt2", "--tp", "2"], "use --tp 1"),
        (["--preset", "gpt2", "--states", "int8"], "not 'int8'"),
        (["--preset", "gpt2", "--emulate"], "drop --emulate"),
    ):
        assert main(["plan", *argv, "-W", "8", "--optimizer", "muon"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err
