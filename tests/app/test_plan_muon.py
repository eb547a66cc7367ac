"""`fusedzero plan --optimizer muon`: the bytes of ZeroMuon, and the owner layout's Newton-Schulz
FLOPs per rank and padding from its planner.

About an internal: fusedzero._muon_layout (the planner the plan's numbers must equal)."""

from __future__ import annotations

import json

import pytest
import torch

from fusedzero import Precision, Sharding, ZeroMuon, muon_param_groups
from fusedzero._muon_layout import MuonParamSpec, plan_muon_layout
from fusedzero.app.model import GPT, GPTConfig, gpt_muon_param_groups
from fusedzero.app.plan_cli import preset_model
from fusedzero.cli import main
from fusedzero.plan import PlanConfig, plan_model, plan_muon_model
from fusedzero.testing import fake_group

CFG = dict(n_layer=2, n_head=2, n_embd=64, block_size=16, vocab_size=64)


def _muon(model: torch.nn.Module, stage: int, precision: Precision, bucket: int) -> ZeroMuon:
    groups = gpt_muon_param_groups(model, 0.1, muon_lr=0.02, lr=3e-3, betas=(0.9, 0.95))
    return ZeroMuon(
        groups,
        stage=stage,
        module=model,
        max_grad_norm=1.0,
        precision=precision,
        sharding=Sharding(bucket_numel=bucket),
    )


@pytest.mark.parametrize("states", ["fp32", "bf16"])
@pytest.mark.parametrize("pdt", [torch.float32, torch.bfloat16], ids=str)
def test_plan_equals_zero_muon_memory_and_comm(states: str, pdt: torch.dtype) -> None:
    """At one rank (every stage) and at stage 0 on two ranks, the plan's resident bytes and
    comm bytes are ZeroMuon's `memory()` and `opt.comm` after a step, to the byte: the Muon
    groups keep one state field, the AdamW groups two."""
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
                mem, want = opt.memory(), plan.stages[stage]
                what = f"W={W} stage={stage} {pdt} states={states}"
                assert (mem.params, mem.grads, mem.optimizer, mem.total) == (
                    want.params_bytes,
                    want.grads_bytes,
                    want.optimizer_bytes,
                    want.total_bytes,
                ), what
                assert opt.comm.total_bytes == want.comm_bytes_per_step, what
                opt.close()
            # one state field fewer than AdamW's on the Muon params
            assert want.optimizer_bytes < adamw_only.stages[stage].optimizer_bytes, what


@pytest.mark.parametrize("W", [1, 8, 64])
def test_layout_numbers_are_the_planners(W: int) -> None:
    """The NS FLOPs per rank (max, mean, max/mean) and padding the plan reports are those of
    `plan_muon_layout` over the model's params, Muon's marked per-matrix."""
    model = preset_model("gpt2")
    plan = plan_muon_model(model, PlanConfig(world_size=W))
    muon = {id(p) for g in muon_param_groups(model) if g["use_muon"] for p in g["params"]}
    layout = plan_muon_layout(
        [MuonParamSpec(n, tuple(p.shape), id(p) in muon) for n, p in model.named_parameters()],
        W,
    )
    flops = layout.ns_flops()
    m = plan.muon_layout
    assert m is not None and m.world_size == W
    assert (
        m.muon_params
        == layout.muon_numel
        == sum(p.numel() for p in model.parameters() if id(p) in muon)
    )
    assert (m.ns_flops_max, m.ns_flops_mean) == (max(flops), sum(flops) / W)
    assert m.ns_balance == layout.balance() == max(flops) / (sum(flops) / W)
    assert m.padding == layout.padding
    assert m.padding_fraction == layout.padding / layout.muon_numel


def test_cli_muon_table_json_and_refusals(capsys: pytest.CaptureFixture[str]) -> None:
    """The table names both rules' state and says the owner layout is planned, not yet run at
    stages 1-3 over several ranks; --json carries the layout's numbers; what the Muon plan
    cannot take is one line, exit 2."""
    assert main(["plan", "--preset", "gpt2", "-W", "8", "--optimizer", "muon"]) == 0
    table = capsys.readouterr().out
    for want in (
        "momentum_buffer",
        "exp_avg + exp_avg_sq",
        "max/mean",
        "padding",
        "planned, not yet what ZeroMuon runs",
    ):
        assert want in table, table
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
