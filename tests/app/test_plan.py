"""`fusedzero plan`: the ZeRO paper's table, and exact agreement with a real optimizer's
`memory()` and `comm` counters.

A real ZeroAdamW at world size W is built in this one process on torch.distributed's "fake"
backend (a real process group whose collectives move no data): its buffers, layouts and byte
counters are those of rank `rank` of W, which is all the plan has to match, and it costs no
spawned ranks. tests/zero/test_zero.py checks the same counters on real gloo ranks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fusedzero import Precision, Sharding, ZeroAdamW
from fusedzero.app.model import GPT, GPTConfig, gpt_param_groups
from fusedzero.app.plan_cli import preset_model
from fusedzero.cli import main
from fusedzero.emulate import meta_model
from fusedzero.plan import PlanConfig, plan_model, plan_params
from fusedzero.testing import fake_group

from _helpers import assert_memory_is_plan

CFG = dict(n_layer=2, n_head=2, n_embd=64, block_size=16, vocab_size=64)


def test_reproduces_the_zero_paper_table_for_7_5b_params_at_64_ranks() -> None:
    # ZeRO (Rajbhandari et al. 2020), Figure 1: Psi = 7.5B, N_d = 64, K = 12, bf16/fp16 params
    # and grads: 120 / 31.4 / 16.6 / 1.88 GB per device for stages 0 / 1 / 2 / 3 (GB = 1e9 B).
    plan = plan_params(7_500_000_000, PlanConfig(world_size=64))
    got = {s: f"{p.total_bytes / 1e9:.3g}" for s, p in plan.stages.items()}
    assert got == {0: "120", 1: "31.4", 2: "16.6", 3: "1.88"}
    psi = 7.5e9
    for s, (params, grads, optim) in {
        0: (2, 2, 12),
        1: (2, 2, 12 / 64),
        2: (2, 2 / 64, 12 / 64),
        3: (2 / 64, 2 / 64, 12 / 64),
    }.items():
        p = plan.stages[s]
        # Bucket padding adds < 1e-3 relative (224 buckets * 64 * 128 elements at most).
        assert p.params_bytes == pytest.approx(params * psi, rel=1e-3), s
        assert p.grads_bytes == pytest.approx(grads * psi, rel=1e-3), s
        assert p.optimizer_bytes == pytest.approx(optim * psi, rel=1e-3), s
    # Comm: 2 Psi (stages 0-2: all-reduce = reduce-scatter + all-gather) and 3 Psi (stage 3)
    # elements of 2 bytes, times (W-1)/W.
    for s, factor in {0: 2, 1: 2, 2: 2, 3: 3}.items():
        assert plan.stages[s].comm_bytes_per_step == pytest.approx(
            factor * 2 * psi * 63 / 64, rel=1e-3
        ), s


def test_cli_json_schema_and_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--params", "7.5e9", "--world-size", "64", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert set(d) == {"stages", "world_size", "params", "comm_model"}
    assert d["world_size"] == 64 and d["params"] == 7_500_000_000
    assert set(d["stages"]) == {"0", "1", "2", "3"}
    for s in d["stages"].values():
        assert set(s) == {
            "params_bytes",
            "grads_bytes",
            "optimizer_bytes",
            "total_bytes",
            "comm_bytes_per_step",
        }
        assert s["total_bytes"] == s["params_bytes"] + s["grads_bytes"] + s["optimizer_bytes"]
    assert main(["plan", "--params", "7.5e9", "-W", "64"]) == 0
    table = capsys.readouterr().out
    for want in ("120 GB", "31.4 GB", "16.6 GB", "1.88 GB", "fp32 master + exp_avg"):
        assert want in table, table
    # Bad input: one line, exit 2, naming the value.
    assert main(["plan", "--params", "0", "-W", "8"]) == 2
    assert "--params must be >= 1, got 0" in capsys.readouterr().err
    assert main(["plan", "--params", "1e6", "-W", "0"]) == 2
    assert "world_size must be >= 1, got 0" in capsys.readouterr().err


CASES = [  # (world size, rank, param dtype, reduce dtype, bucket numel)
    (2, 1, torch.bfloat16, torch.bfloat16, 5000),  # several buckets per flat buffer
    (3, 2, torch.bfloat16, torch.float32, 5000),  # W not a power of two: per-call rounding
    (4, 0, torch.float32, torch.float32, 1 << 25),  # fp32 params: no separate master
    (4, 3, torch.float16, torch.bfloat16, 20000),
]


@pytest.mark.parametrize("W,rank,pdt,rdt,bucket", CASES, ids=str)
def test_plan_equals_memory_and_comm_of_a_real_optimizer(W, rank, pdt, rdt, bucket) -> None:
    with torch.device("meta"):  # the plan's model: shapes only, nothing allocated
        meta = GPT(GPTConfig(**CFG))
    for reshard in (True, False):
        cfg = PlanConfig(
            world_size=W,
            precision=Precision(param_dtype=pdt, reduce_dtype=rdt),
            sharding=Sharding(bucket_numel=bucket, reshard_after_forward=reshard),
        )
        plan = plan_model(meta, cfg)
        assert plan.params == sum(p.numel() for p in meta.parameters())
        for stage in (0, 1, 2, 3) if reshard else (3,):
            with fake_group(rank, W):
                torch.manual_seed(0)
                model = GPT(GPTConfig(**CFG))
                opt = ZeroAdamW(
                    gpt_param_groups(model, 0.1),
                    stage=stage,
                    module=model,
                    max_grad_norm=1.0,
                    precision=Precision(param_dtype=pdt, reduce_dtype=rdt),
                    sharding=Sharding(bucket_numel=bucket, reshard_after_forward=reshard),
                )
                x = torch.randint(0, CFG["vocab_size"], (2, CFG["block_size"]))
                _, loss = model(x, x)
                loss.backward()
                opt.step()
                opt.zero_grad()
                want = plan.stages[stage]
                what = f"W={W} rank={rank} stage={stage} {pdt}/{rdt} reshard={reshard}"
                assert_memory_is_plan(opt, want, what)


MODE_CASES = [("bf16-kahan", "int8"), ("bf16-sr", "bf16"), ("bf16", "fp32"), ("fp32", "int8")]


@pytest.mark.parametrize("master,states", MODE_CASES, ids=str)
def test_plan_equals_memory_in_every_memory_mode(master: str, states: str) -> None:
    """`plan --master --states` agrees with `opt.memory()` to the byte (W=3: padding per rank;
    several buckets per buffer; stage 3 with several units)."""
    W, rank, bucket = 3, 1, 5000
    with torch.device("meta"):
        meta = GPT(GPTConfig(**CFG))
    cfg = PlanConfig(
        world_size=W,
        precision=Precision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, master=master, states=states
        ),
        sharding=Sharding(bucket_numel=bucket),
    )
    plan = plan_model(meta, cfg)
    for stage in (0, 1, 3):
        with fake_group(rank, W):
            model = GPT(GPTConfig(**CFG))
            opt = ZeroAdamW(
                gpt_param_groups(model, 0.1),
                stage=stage,
                module=model,
                precision=Precision(
                    param_dtype=torch.bfloat16,
                    reduce_dtype=torch.bfloat16,
                    master=master,
                    states=states,
                ),
                sharding=Sharding(bucket_numel=bucket),
            )
            mem, want = opt.memory(), plan.stages[stage]
            assert (mem.params, mem.grads, mem.optimizer) == (
                want.params_bytes,
                want.grads_bytes,
                want.optimizer_bytes,
            ), (master, states, stage)


def test_plan_cli_modes(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "plan",
                "--params",
                "1e6",
                "-W",
                "4",
                "--master",
                "bf16-kahan",
                "--states",
                "int8",
                "--json",
            ]
        )
        == 0
    )
    d = json.loads(capsys.readouterr().out)
    # The rank's shard (padding included) from the default plan's 12 bytes per element; kahan +
    # int8 holds comp 2 + exp_avg 1 + exp_avg_sq 1 bytes per element and two fp32 scales per 128.
    opt_bytes = d["stages"]["1"]["optimizer_bytes"]
    local = plan_params(1_000_000, PlanConfig(world_size=4)).stages[1].optimizer_bytes // 12
    assert opt_bytes == local * 4 + 2 * 4 * local // 128
    assert (
        main(["plan", "--params", "1e6", "-W", "4", "--master", "bf16-sr", "--param-dtype", "fp32"])
        == 2
    )
    assert "keeps no fp32 master" in capsys.readouterr().err


def test_presets_build_on_meta_and_count_params() -> None:
    m = preset_model("gpt2-xl")  # 1.5B params: would not be built for real in a test
    assert all(p.is_meta for p in m.parameters())
    assert 1.4e9 < sum(p.numel() for p in m.parameters()) < 1.7e9
    with pytest.raises(ValueError, match="unknown preset 'gpt5'"):
        preset_model("gpt5")


def _tiny_gpt2_config(tmp_path: Path) -> Path:
    transformers = pytest.importorskip("transformers", reason="needs the 'hf' extra")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=16)
    cfg.save_pretrained(tmp_path)
    return tmp_path / "config.json"


@pytest.mark.slow
def test_hf_config_plan_equals_real_hf_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    transformers = pytest.importorskip("transformers", reason="needs the 'hf' extra")
    path = _tiny_gpt2_config(tmp_path)
    assert main(["plan", "--hf-config", str(path), "-W", "2", "--json", "--one-group"]) == 0
    got = json.loads(capsys.readouterr().out)
    real = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(tmp_path)
    )
    # The tied lm_head / wte weight counted once, as the optimizer sees it.
    assert got["params"] == sum(p.numel() for p in real.parameters())
    for stage in (0, 3):
        with fake_group(0, 2):
            opt = ZeroAdamW(
                real.parameters(),
                stage=stage,
                module=real,
                precision=Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16),
            )
            mem = opt.memory()
            assert mem.total == got["stages"][str(stage)]["total_bytes"], stage
            assert mem.params == got["stages"][str(stage)]["params_bytes"], stage
            del opt
        real = transformers.AutoModelForCausalLM.from_config(real.config)


def test_hf_config_without_transformers_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)  # import fails
    assert main(["plan", "--hf-config", str(tmp_path), "-W", "2"]) == 2
    assert "pip install 'fusedzero[hf]'" in capsys.readouterr().err


def test_cli_comm_time_model(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--params", "1e9", "-W", "1024", "--link-gbps", "50", "--link-latency-us", "5"]
    assert main(args + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    m = d["comm_model"]
    assert m["model"] == "alpha-beta ring"
    assert (m["link_bytes_per_s"], m["latency_s"]) == (50e9, pytest.approx(5e-6))
    # One flat buffer of 1e9 bf16 elements at W=1024: 2 buckets of 2**29 (1 MiB per rank),
    # each reduce-scattered and all-gathered ((W-1) ring steps each), plus the norm's
    # all-reduce (2(W-1)): 6 x 1023 steps of 5 us, plus the bytes at 50 GB/s.
    stage1 = d["stages"]["1"]["comm_bytes_per_step"]
    assert m["seconds_per_step"]["1"] == pytest.approx(6 * 1023 * 5e-6 + stage1 / 50e9)
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "alpha-beta ring model (not a measurement" in out and "50 GB/s, 5 us" in out
    assert main(["plan", "--params", "1e6", "-W", "8", "--link-gbps", "0"]) == 2
    assert "bandwidth must be > 0" in capsys.readouterr().err


def test_cli_emulate_equals_plan(capsys: pytest.CaptureFixture[str]) -> None:
    # A real ZeroAdamW as the last of 64 ranks (fake process group, model on meta, only the
    # local shard materialised): its resident and comm bytes are the plan's.
    assert main(["plan", "--shape", "tiny", "-W", "64", "--emulate", "--rank", "63", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    e = d["emulation"]
    assert (e["world_size"], e["rank"], e["stage"], e["materialized"]) == (64, 63, 3, True)
    assert e["resident_bytes"] == d["stages"]["3"]["total_bytes"] == e["plan_bytes"]
    assert e["comm_bytes_per_step"] == d["stages"]["3"]["comm_bytes_per_step"]
    assert main(["plan", "--preset", "tiny", "-W", "8", "--emulate", "--stage", "1"]) == 0
    assert "equal to the plan" in capsys.readouterr().out
    assert main(["plan", "--shape", "tiny", "-W", "8", "--emulate", "--rank", "8"]) == 2
    assert "--rank must be in [0, 8), got 8" in capsys.readouterr().err


def test_cli_emulate_follows_wire_and_refuses_tp(capsys: pytest.CaptureFixture[str]) -> None:
    # --wire / --param-wire reach the emulated optimizer and the plan it is compared with: the
    # emulation equals the very numbers the table prints (int8 both ways: about half of bf16's).
    assert (
        main(
            [
                "plan",
                "--shape",
                "tiny",
                "-W",
                "8",
                "--emulate",
                "--wire",
                "int8",
                "--param-wire",
                "int8",
                "--json",
            ]
        )
        == 0
    )
    d = json.loads(capsys.readouterr().out)
    e, printed = d["emulation"], d["stages"]["3"]
    assert e["comm_bytes_per_step"] == printed["comm_bytes_per_step"] == e["plan_comm_bytes"]
    assert e["resident_bytes"] == printed["total_bytes"] == e["plan_bytes"]
    native = plan_model(meta_model("tiny"), PlanConfig(world_size=8)).stages[3]
    assert printed["comm_bytes_per_step"] < 0.6 * native.comm_bytes_per_step, printed
    assert (
        main(
            [
                "plan",
                "--shape",
                "tiny",
                "-W",
                "8",
                "--emulate",
                "--stage",
                "0",
                "--wire",
                "bf16",
                "--reduce-dtype",
                "fp32",
            ]
        )
        == 0
    )
    assert "equal to the plan" in capsys.readouterr().out
    # Tensor parallelism is not emulated: refused, rather than compared with another plan.
    assert main(["plan", "--preset", "tiny", "-W", "2", "--tp", "2", "--emulate"]) == 2
    assert "--emulate builds a data-parallel ZeroAdamW only" in capsys.readouterr().err
