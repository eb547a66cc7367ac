"""The grouped launches: every buffer of a rank in one launch per dtype combination.

Launch counts are exact (they do not depend on the machine). The numerics of many buffers with
mixed hyper-parameter rows go through the real grouped kernel in the Triton interpreter (and the
torch path) against the float64 reference, buffer by buffer.

About internals: fusedzero._scalars, fusedzero.kernels._sum_of_squares.
"""

from __future__ import annotations

import math

import pytest
import torch

from fusedzero import Precision, ZeroAdamW
from fusedzero.app.model import GPT, GPTConfig, gpt_param_groups
from fusedzero.kernels import (
    LAUNCHES,
    AdamWBuffer,
    GroupedAdamW,
    GroupedSumsq,
    Hyper,
    Strided,
    SumsqView,
    adamw_reference,
)

from _helpers import fast_only

U32 = 2.0**-24
# Per row: lr, beta1, beta2, eps, weight_decay, maximize; every field differs between rows.
ROWS = [
    (3e-3, 0.9, 0.95, 1e-8, 0.1, False),
    (1e-2, 0.8, 0.999, 1e-6, 0.0, True),
    (5e-4, 0.0, 0.5, 1e-3, 0.3, False),
]
STEP, SCALE = 5, float(torch.tensor(0.37))


@pytest.fixture(params=["triton", "torch"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("FUSEDZERO_BACKEND", request.param)
    return request.param


def _buffers(gen: torch.Generator) -> list[dict]:
    """20 buffers of odd sizes: local or strided (a rank's pieces of a bucketed buffer), 1-3
    buckets, every grad dtype and every output (none, bf16, fp16, fp32), all three rows."""
    grads = (torch.float32, torch.bfloat16, torch.float16)
    outs = (None, torch.bfloat16, torch.float16, torch.float32)
    bufs = []
    for i in range(20):
        nb, S = 1 + i % 3, 16 * (1 + i % 5) + (i % 2) * 3  # some not 16-aligned
        strided = i % 4 != 0
        stride, base = (2 * S + 5, S + 3) if strided else (S, 0)
        n_full = (nb - 1) * stride + base + S
        g_dt, o_dt = grads[i % 3], outs[(i // 3) % 4]
        bufs.append(
            dict(
                master=torch.randn(n_full, generator=gen),
                grad=(torch.randn(n_full, generator=gen) * 2).to(g_dt),
                exp_avg=torch.randn(nb * S, generator=gen) * 0.1,
                exp_avg_sq=torch.rand(nb * S, generator=gen) * 0.02 + 1e-4,
                out=None if o_dt is None else torch.full((n_full,), float("nan"), dtype=o_dt),
                nb=nb,
                S=S,
                stride=stride,
                base=base,
                row=i % len(ROWS),
            )
        )
    return bufs


def _local(b: dict, t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t[k * b["stride"] + b["base"] :][: b["S"]] for k in range(b["nb"])])


def _plan(bufs: list[dict]) -> GroupedAdamW:
    def view(t: torch.Tensor | None, b: dict):
        return None if t is None else Strided(t, b["stride"], b["base"])

    return GroupedAdamW(
        [
            AdamWBuffer(
                view(b["master"], b),
                view(b["grad"], b),
                b["exp_avg"],
                b["exp_avg_sq"],
                view(b["out"], b),
                b["nb"],
                b["S"],
                b["row"],
            )
            for b in bufs
        ],
        torch.device("cpu"),
        len(ROWS),
    )


def _hyper() -> Hyper:
    return Hyper(torch.tensor([r[0] for r in ROWS]), tuple(r[1:] for r in ROWS))


def _scalars(skip: int = 0) -> dict[str, torch.Tensor]:
    return dict(
        step=torch.tensor([float(STEP)]),
        grad_scale=torch.tensor([SCALE]),
        skip=torch.tensor([float(skip)]),
    )


def test_grouped_adamw_many_buffers_mixed_rows_match_float64(backend: str) -> None:
    gen = torch.Generator().manual_seed(0)
    bufs = _buffers(gen)
    before = [
        {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in bufs
    ]
    plan = _plan(bufs)
    combos = {(b["grad"].dtype, None if b["out"] is None else b["out"].dtype) for b in bufs}
    n0 = LAUNCHES["adamw"]
    plan.step(_hyper(), **_scalars())
    assert LAUNCHES["adamw"] - n0 == len(combos) == 12
    lr32 = _hyper().lr.tolist()
    for i, (b, b0) in enumerate(zip(bufs, before)):
        lr, beta1, beta2, eps, wd, maximize = ROWS[b["row"]]
        p_ref, m_ref, v_ref = adamw_reference(
            _local(b0, b0["master"]),
            _local(b0, b0["grad"]),
            b0["exp_avg"],
            b0["exp_avg_sq"],
            lr=lr32[b["row"]],
            step=STEP,
            grad_scale=SCALE,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=wd,
            maximize=maximize,
        )
        # Magnitudes the fp32 roundings are relative to (see tests/kernels/test_kernels.py): 16 ulps
        # covers both paths (each within 8 of the exact update).
        g = _local(b0, b0["grad"]).double().abs() * SCALE
        m_mag = b0["exp_avg"].double().abs() + g
        denom = v_ref.sqrt() / math.sqrt(1 - beta2**STEP) + eps
        p_mag = (
            _local(b0, b0["master"]).double().abs()
            + lr32[b["row"]] / (1 - beta1**STEP) * m_mag / denom
        )
        for name, got, want, mag in (
            ("master", _local(b, b["master"]), p_ref, p_mag),
            ("exp_avg", b["exp_avg"], m_ref, m_mag),
            ("exp_avg_sq", b["exp_avg_sq"], v_ref, v_ref),
        ):
            err = (got.double() - want).abs() - 16 * U32 * mag
            assert (err <= 0).all(), f"buffer {i} ({b['grad'].dtype}) {name}: off by {err.max()}"
        if b["out"] is not None:
            assert torch.equal(_local(b, b["out"]), _local(b, b["master"]).to(b["out"].dtype))
            # Outside this rank's pieces nothing is written (still the NaN poison).
            mine = torch.zeros_like(b["out"], dtype=torch.bool)
            for k in range(b["nb"]):
                mine[k * b["stride"] + b["base"] :][: b["S"]] = True
            assert b["out"][~mine].isnan().all(), f"buffer {i}: wrote outside its pieces"
        other = torch.ones_like(b["master"], dtype=torch.bool)
        for k in range(b["nb"]):
            other[k * b["stride"] + b["base"] :][: b["S"]] = False
        assert torch.equal(b["master"][other], b0["master"][other]), f"buffer {i}: other rank"


@pytest.mark.parametrize(
    "backend", fast_only(["triton", "torch"], lambda b: b == "torch"), indirect=True
)
def test_grouped_adamw_skip_leaves_every_buffer_bitwise_unchanged(backend: str) -> None:
    bufs = _buffers(torch.Generator().manual_seed(1))
    before = [[t.clone() for t in (b["master"], b["exp_avg"], b["exp_avg_sq"])] for b in bufs]
    _plan(bufs).step(_hyper(), **_scalars(skip=1))
    for b, b0 in zip(bufs, before):
        for t, t0 in zip((b["master"], b["exp_avg"], b["exp_avg_sq"]), b0):
            assert torch.equal(t, t0)
        assert b["out"] is None or b["out"].isnan().all()


def test_grouped_sumsq_one_launch_per_dtype_matches_float64(backend: str) -> None:
    bufs = _buffers(torch.Generator().manual_seed(2))
    views = [SumsqView(Strided(b["grad"], b["stride"], b["base"]), b["nb"], b["S"]) for b in bufs]
    n0 = LAUNCHES["sumsq"]
    got = GroupedSumsq(views, torch.device("cpu"))()
    assert LAUNCHES["sumsq"] - n0 == 3, "three grad dtypes: three launches, one sum"
    want = sum(float(_local(b, b["grad"]).double().square().sum()) for b in bufs)
    assert got.shape == (1,) and abs(float(got) - want) <= 1e-6 * want


def test_sumsq_torch_path_splits_and_joins_pieces_across_chunks(monkeypatch) -> None:
    """The CPU path squares the pieces chunk by chunk through one small scratch: pieces that
    span, end on or fall inside a chunk boundary are all counted once (float64 reference)."""
    from fusedzero.kernels import _sum_of_squares as sum_of_squares

    monkeypatch.setattr(sum_of_squares, "_CHUNK", 1000)
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16):
        xs = [torch.randn(n, generator=g).to(dtype) for n in (1, 17, 999, 1001, 2503, 1000)]
        plan = GroupedSumsq([SumsqView(x) for x in xs], torch.device("cpu"))
        assert len(plan.chunks) == -(-sum(x.numel() for x in xs) // 1000)
        want = sum(float(x.double().square().sum()) for x in xs)
        got = float(plan())
        assert abs(got - want) <= 1e-6 * want, (dtype, got, want)


# --------------------------------------------------------------------------- the optimizer


def _gpt(seed: int = 0, n_layer: int = 8) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=n_layer, n_embd=16, n_head=2, block_size=8, vocab_size=32))


def _backward(model: GPT, seed: int) -> None:
    x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(seed))
    model(x, x)[1].backward()


@pytest.mark.parametrize(
    "dtypes", [(None, torch.float32), (torch.bfloat16, torch.bfloat16)], ids=["fp32", "bf16"]
)
@pytest.mark.parametrize("stage", fast_only([0, 1, 2, 3], lambda s: s in (1, 3)))
def test_launches_per_step_for_a_2_group_8_block_gpt(stage: int, dtypes: tuple) -> None:
    model = _gpt()
    opt = ZeroAdamW(
        gpt_param_groups(model, 0.1),
        lr=1e-3,
        stage=stage,
        module=model,
        max_grad_norm=1.0,
        precision=Precision(param_dtype=dtypes[0], reduce_dtype=dtypes[1]),
    )
    if stage == 3:
        assert len(opt.flat_groups) == 18, "2 groups x 8 units + the rest: 18 buffers"
    _backward(model, 0)
    before = dict(LAUNCHES)
    opt.step()
    got = {k: LAUNCHES[k] - before.get(k, 0) for k in ("adamw", "sumsq")}
    assert got == {"adamw": 1, "sumsq": 1}, f"stage {stage}: {got}"


@pytest.mark.parametrize("stage", [1, 3])
def test_load_state_dict_then_step_updates_the_loaded_memory(stage: int) -> None:
    """The grouped tables hold the buffers' addresses: a load must write them in place. A
    second optimizer loads the first's state; the same step then gives the same params."""
    a, b = _gpt(0, 2), _gpt(1, 2)
    opt_a = ZeroAdamW(gpt_param_groups(a, 0.1), lr=1e-3, stage=stage, module=a)
    opt_b = ZeroAdamW(gpt_param_groups(b, 0.1), lr=1e-3, stage=stage, module=b)
    for i in range(2):
        _backward(a, i)
        opt_a.step()
    opt_b.load_state_dict(opt_a.state_dict())
    _backward(a, 7)
    _backward(b, 7)
    opt_a.step()
    opt_b.step()
    with opt_a.gathered_params(), opt_b.gathered_params():
        for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(pa, pb), f"{n} differs after load + step"


def test_group_lr_follows_float_and_tensor_lrs_and_sends_floats_only_when_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fusedzero import _scalars as scalars

    sent: list[list] = []
    real = scalars.copy_from_host
    monkeypatch.setattr(scalars, "copy_from_host", lambda dst, v: (sent.append(v), real(dst, v)))
    lr_t = torch.tensor(2e-3)
    groups = [
        dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, maximize=False),
        dict(lr=lr_t, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.0, maximize=True),
    ]
    g = scalars.GroupLr(2, torch.device("cpu"))
    h = g.update(groups)
    assert h.lr.tolist() == [float(torch.tensor(1e-3)), float(lr_t)] and len(sent) == 1
    assert h.consts == ((0.9, 0.99, 1e-8, 0.1, False), (0.8, 0.9, 1e-6, 0.0, True))
    lr_t.fill_(5e-4)  # a tensor lr is read on the device every step, no host send
    assert g.update(groups).lr[1].item() == float(torch.tensor(5e-4)) and len(sent) == 1
    groups[0]["lr"] = 3e-4  # what a scheduler writes: sent once
    assert g.update(groups).lr[0].item() == float(torch.tensor(3e-4)) and len(sent) == 2
    g.update(groups)
    assert len(sent) == 2, "an unchanged float lr is not sent again"


def test_group_lr_reads_a_cpu_tensor_lr_on_the_host_for_a_device_vector(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A CPU tensor lr (`lr=torch.tensor(1e-3)`, which schedulers fill) for an lr vector on
    another device (meta stands in for CUDA here) is read with `.item()` and sent as a float
    lr is, when it changes. Before: copied into the device vector every step, which on CUDA is
    a pageable host-to-device copy: the host waits for the device, a sync in every step()."""
    from fusedzero import _scalars as scalars

    sent: list[list] = []
    real = scalars.copy_from_host
    monkeypatch.setattr(scalars, "copy_from_host", lambda dst, v: (sent.append(v), real(dst, v)))
    lr_t = torch.tensor(2e-3)
    groups = [dict(lr=lr_t, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, maximize=False)]
    g = scalars.GroupLr(1, torch.device("meta"))
    g.update(groups)
    g.update(groups)
    assert sent == [[float(lr_t)]]
    lr_t.fill_(5e-4)
    g.update(groups)
    assert sent == [[float(torch.tensor(2e-3))], [float(torch.tensor(5e-4))]]
