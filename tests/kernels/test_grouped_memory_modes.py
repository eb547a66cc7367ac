"""Memory modes through the grouped launch: one AdamW launch per step for every buffer of a
rank, and many buffers in one launch updated bitwise as each alone (the table's mode columns:
Kahan comp, the int8 scales at local offset / QBLOCK, bf16-sr's per-buffer index offset).

About an internal: fusedzero.kernels._memory_modes."""

from __future__ import annotations

import pytest
import torch

from fusedzero import Precision, ZeroAdamW
from fusedzero.app.model import GPT, GPTConfig, gpt_param_groups
from fusedzero.kernels import (
    LAUNCHES,
    QBLOCK,
    AdamWBuffer,
    GroupedAdamW,
    Hyper,
    Strided,
    adamw_step,
)
from fusedzero.kernels._memory_modes import STATE_DTYPES

from _helpers import fast_only

ROWS = [(3e-3, 0.9, 0.95, 1e-8, 0.1, False), (1e-2, 0.8, 0.999, 1e-6, 0.0, True)]


@pytest.fixture(params=["triton", "torch"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("FUSEDZERO_BACKEND", request.param)
    return request.param


# A whole stage-3 model: in the interpreter only in the slow tier.
@pytest.mark.parametrize(
    "backend", fast_only(["triton", "torch"], lambda b: b == "torch"), indirect=True
)
def test_bf16_kahan_int8_stage3_one_adamw_and_one_sumsq_launch_per_step(backend) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_embd=16, n_head=2, block_size=8, vocab_size=32))
    opt = ZeroAdamW(
        gpt_param_groups(model, 0.1),
        lr=1e-3,
        stage=3,
        module=model,
        max_grad_norm=1.0,
        precision=Precision(
            param_dtype=torch.bfloat16,
            reduce_dtype=torch.bfloat16,
            master="bf16-kahan",
            states="int8",
        ),
    )
    assert len(opt.flat_groups) == 10, "2 groups x 4 units + the rest: 10 buffers"
    for step in range(2):
        x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(step))
        model(x, x)[1].backward()
        before = dict(LAUNCHES)
        opt.step()
        got = {k: LAUNCHES[k] - before.get(k, 0) for k in ("adamw", "sumsq")}
        assert got == {"adamw": 1, "sumsq": 1}, f"step {step}: {got}"


def _buffers(master_mode: str, states: str, gen: torch.Generator) -> list[dict]:
    """6 buffers: local or strided (a rank's pieces of a bucketed buffer), 1-3 buckets of
    multiples of QBLOCK, both rows, bf16 and fp32 grads."""
    m_dt, v_dt = STATE_DTYPES[states]
    bufs = []
    for i in range(6):
        nb, S = 1 + i % 3, QBLOCK * (1 + i % 2)
        stride, base = (2 * S + 128, S + 64) if i % 2 else (S, 0)
        n_full, n = (nb - 1) * stride + base + S, nb * S
        master = torch.randn(n_full, generator=gen)
        m = torch.randn(n, generator=gen) * 0.1
        v = torch.rand(n, generator=gen) * 0.02 + 1e-4
        b = dict(
            master=master if master_mode == "fp32" else master.bfloat16(),
            grad=torch.randn(n_full, generator=gen).to((torch.bfloat16, torch.float32)[i % 2]),
            exp_avg=m.to(m_dt) if states != "int8" else torch.zeros(n, dtype=m_dt),
            exp_avg_sq=v.to(v_dt) if states != "int8" else torch.zeros(n, dtype=v_dt),
            kahan=(torch.randn(n, generator=gen) * 1e-4).bfloat16()
            if master_mode == "bf16-kahan"
            else None,
            exp_avg_scale=torch.zeros(n // QBLOCK) if states == "int8" else None,
            exp_avg_sq_scale=torch.zeros(n // QBLOCK) if states == "int8" else None,
            nb=nb,
            S=S,
            stride=stride,
            base=base,
            row=i % 2,
            sr_offset=1000 * i,
        )
        bufs.append(b)
    return bufs


def _args(b: dict) -> dict:
    return dict(
        master=Strided(b["master"], b["stride"], b["base"]),
        grad=Strided(b["grad"], b["stride"], b["base"]),
    )


# The fast tier: the torch path of the mode with every extra stream; the interpreter (the same
# launch code with the kernel's table) in the slow tier, and in tests/zero/test_memory_modes.py.
@pytest.mark.parametrize(
    "backend", fast_only(["triton", "torch"], lambda b: b == "torch"), indirect=True
)
@pytest.mark.parametrize(
    "master_mode,states",
    fast_only(
        [("bf16-kahan", "int8"), ("bf16-sr", "int8"), ("fp32", "bf16")],
        lambda c: c == ("bf16-kahan", "int8"),
    ),
)
def test_grouped_modes_bitwise_each_buffer_alone(backend, master_mode, states) -> None:
    gen = torch.Generator().manual_seed(3)
    grouped = _buffers(master_mode, states, gen)
    alone = [
        {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in grouped
    ]
    seed = torch.tensor([77], dtype=torch.int64) if master_mode == "bf16-sr" else None
    step, scale = torch.tensor([3.0]), torch.tensor([0.5])
    skip = torch.zeros(1)
    lrs = torch.tensor([r[0] for r in ROWS])
    for _ in range(2):  # the second step reads the first's scales and comp
        plan = GroupedAdamW(
            [
                AdamWBuffer(
                    **_args(b),
                    exp_avg=b["exp_avg"],
                    exp_avg_sq=b["exp_avg_sq"],
                    out=None,
                    num_buckets=b["nb"],
                    shard_numel=b["S"],
                    row=b["row"],
                    comp=b["kahan"],
                    exp_avg_scale=b["exp_avg_scale"],
                    exp_avg_sq_scale=b["exp_avg_sq_scale"],
                    sr_offset=b["sr_offset"],
                )
                for b in grouped
            ],
            torch.device("cpu"),
            2,
            master_mode=master_mode,
            states=states,
            seed=seed,
        )
        before = LAUNCHES["adamw"]
        plan.step(Hyper(lrs, tuple(r[1:] for r in ROWS)), step, scale, skip)
        assert LAUNCHES["adamw"] - before == 2, "one launch per grad dtype (bf16, fp32)"
        for b in alone:
            lr, beta1, beta2, eps, wd, mx = ROWS[b["row"]]
            adamw_step(
                **_args(b),
                exp_avg=b["exp_avg"],
                exp_avg_sq=b["exp_avg_sq"],
                lr=lrs[b["row"] : b["row"] + 1],
                step=step,
                grad_scale=scale,
                skip=skip,
                beta1=beta1,
                beta2=beta2,
                eps=eps,
                weight_decay=wd,
                maximize=mx,
                num_buckets=b["nb"],
                shard_numel=b["S"],
                master_mode=master_mode,
                states=states,
                exp_avg_scale=b["exp_avg_scale"],
                exp_avg_sq_scale=b["exp_avg_sq_scale"],
                kahan=b["kahan"],
                seed=seed,
                sr_offset=b["sr_offset"],
            )
        step += 1
    for i, (g, a) in enumerate(zip(grouped, alone)):
        for k in ("master", "exp_avg", "exp_avg_sq", "kahan", "exp_avg_scale", "exp_avg_sq_scale"):
            if g[k] is not None:
                assert torch.equal(
                    g[k].view(torch.uint8) if g[k].dtype == torch.bfloat16 else g[k],
                    a[k].view(torch.uint8) if a[k].dtype == torch.bfloat16 else a[k],
                ), f"buffer {i} {k}"
        assert not torch.equal(
            g["master"],
            _buffers(master_mode, states, torch.Generator().manual_seed(3))[i]["master"],
        ), "updated"
