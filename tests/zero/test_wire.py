"""The compressed wire (fusedzero/wire.py): quantize, all-to-all, dequantize and sum in fp32.

Error bounds, per element i of this rank's shard, with x_r the input of rank r, W ranks, the
result scaled by 1/W (the average), u = 2^-24 (fp32) and deq_r the value rank r's bytes decode to:

- quantization: |deq_r - x_r| <= q_r, where q_r = 0 for fp32, |x_r| * 2^-8 for bf16 (round to
  nearest, 8 significant bits; bf16's normal range), and for int8 absmax_r / 254 * (1 + 2^-14)
  with absmax_r the largest |x_r| in i's block of WBLOCK elements (code = round(x / d) with
  d = absmax / 127 leaves at most d / 2; the fp32 roundings of d, 1/d, x/d and code * d add at
  most 6 u relative, under 2^-14);
- the fp32 sum in rank order: |sum_fp32 - sum deq_r| <= (W - 1) u sum |deq_r|, and the 1/W
  scale rounds once more (exact for W a power of two): u |result|.

So |result - mean(x)| <= (sum_r q_r + W u sum_r |deq_r|) / W, and |result - mean(deq)| <=
W u sum_r |deq_r| / W: the tests assert both, on data whose magnitudes span six decades.

About internals: fusedzero._comm, fusedzero.kernels._quant.
"""

from __future__ import annotations

import contextlib
import functools
import json

import pytest
import torch
import torch.distributed as dist

from fusedzero import Groups, Precision, Sharding, Wire, ZeroAdamW, _comm as comm, wire
from fusedzero._comm import CommContext, CommCounter
from fusedzero.app.model import GPT, GPTConfig, gpt_param_groups
from fusedzero.kernels._quant import WBLOCK, WireFormat, dequantize_into, new_packed
from fusedzero.plan import PlanConfig, plan_model, plan_params
from fusedzero.testing import fake_group, run_ranks

U32 = 2.0**-24
S = 3 * WBLOCK + WBLOCK  # 4 blocks per chunk: one block holds a lone outlier (see _data)
CFG = dict(vocab_size=61, block_size=12, n_layer=2, n_head=2, n_embd=22)


def _data(rank: int, n: int) -> torch.Tensor:
    """Mixed magnitudes: each element's scale is 10^U(-4, 2); one block per chunk holds a lone
    outlier 10^4 larger than its neighbours (int8's worst case: the rest round to few codes)."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    x *= 10.0 ** (torch.rand(n, generator=g, dtype=torch.float64) * 6 - 4)
    x[::S] *= 1e4
    return x.float()


def _quant_bound(fmt: WireFormat, x: torch.Tensor) -> torch.Tensor:
    """q_r of the module docstring, per element, float64."""
    x = x.double()
    if fmt is WireFormat.FP32:
        return torch.zeros_like(x)
    if fmt is WireFormat.BF16:
        return x.abs() * 2.0**-8
    a = x.view(-1, WBLOCK).abs().amax(dim=1, keepdim=True).expand(-1, WBLOCK).reshape(-1)
    return a / 254 * (1 + 2.0**-14)


def _rs_worker(rank: int, world: int) -> dict:
    """Per wire format: this rank's input, what its bytes decode to, the reduced shard (the
    average), and the bytes counted; plus today's bf16 reduce-scatter (summing in bf16)."""
    x = _data(rank, world * S)
    out: dict = {"x": x}
    for fmt in WireFormat:
        counter = CommCounter()
        ctx = CommContext.of(None, counter)
        red = wire.reduce_scatter_start(x, fmt, ctx)
        assert red.send is not None
        deq = torch.empty(world * S)
        dequantize_into(deq, red.send, fmt, world, S)
        comm.wait(red.handle)
        shard = torch.empty(S)
        red.finish(shard, scale=1.0 / world)
        shard16 = torch.empty(S, dtype=torch.bfloat16)  # bf16 reduce dtype: cast at the store
        red16 = wire.reduce_scatter_start(x.bfloat16(), fmt, ctx)
        comm.wait(red16.handle)
        red16.finish(shard16, scale=1.0 / world)
        out[fmt.value] = {
            "deq": deq,
            "shard": shard,
            "shard_bf16": shard16,
            "bytes": counter.snapshot(),
        }
    # Today's reduce_dtype=bf16 path: a reduce-scatter of bf16 grads, summed in bf16.
    native = torch.empty(S, dtype=torch.bfloat16)
    dist.reduce_scatter_tensor(native, x.bfloat16())
    out["native_bf16"] = native * (1.0 / world)
    return out


def _check_rank_results(results: list[dict], W: int) -> None:
    xs = torch.stack([r["x"].double() for r in results])  # (W, W*S)
    for fmt in WireFormat:
        deq = torch.stack([r[fmt.value]["deq"].double() for r in results])
        q = torch.stack([_quant_bound(fmt, r["x"]) for r in results])
        assert ((deq - xs).abs() <= q).all(), (fmt, ((deq - xs).abs() - q).max())
        for rank, r in enumerate(results):
            sl = slice(rank * S, (rank + 1) * S)
            got = r[fmt.value]["shard"].double()
            sum_abs = deq[:, sl].abs().sum(0)
            fp32_err = W * U32 * sum_abs / W
            err_deq = (got - deq[:, sl].sum(0) / W).abs()
            assert (err_deq <= fp32_err).all(), (fmt, rank, (err_deq - fp32_err).max())
            err_x = (got - xs[:, sl].sum(0) / W).abs()
            bound = q[:, sl].sum(0) / W + fp32_err
            assert (err_x <= bound).all(), (fmt, rank, (err_x - bound).max())
            # Bytes: W-1 chunks of this rank's packed bucket, int8 scales included.
            want = (W - 1) * wire.chunk_bytes(fmt, S)
            assert r[fmt.value]["bytes"]["bytes"]["all_to_all"] == 2 * want, fmt


@functools.cache
def _results(W: int) -> list[dict]:
    """One spawn per world size, shared by the tests that read it."""
    return run_ranks(_rs_worker, W)


@pytest.mark.slow
@pytest.mark.parametrize("W", [4, 8])
def test_reduced_shard_is_the_fp32_sum_of_the_dequantized_inputs_within_the_bound(W) -> None:
    _check_rank_results(_results(W), W)


@pytest.mark.slow
def test_bf16_wire_with_fp32_sum_is_closer_to_fp32_than_a_bf16_reduce_scatter() -> None:
    """W=8 on mixed magnitudes: both read the same bf16 grads and store bf16; the bf16 reduce-
    scatter rounds at every one of its W-1 additions, the wire sums in fp32 and rounds once."""
    W = 8
    results = _results(W)
    xs = torch.stack([r["x"].bfloat16().double() for r in results])
    wire_err, native_err, bound, mag = [], [], [], []
    for rank, r in enumerate(results):
        x = xs[:, rank * S : (rank + 1) * S]
        exact = x.sum(0) / W
        wire_err.append((r["bf16"]["shard_bf16"].double() - exact).abs())
        native_err.append((r["native_bf16"].double() - exact).abs())
        # The wire's fp32 sum is within W u of the exact one, then rounded once to bf16.
        bound.append(exact.abs() * 2.0**-8 + W * U32 * x.abs().sum(0))
        mag.append(exact.abs())
    w, n, b, m = (torch.cat(t) for t in (wire_err, native_err, bound, mag))
    assert (w <= b).all(), (w - b).max()
    # Relative to the exact mean (mixed magnitudes: absolute errors follow the outliers).
    # Measured here: 0.0014 (wire) against 0.0036 (bf16 reduce-scatter), worst 0.0039 / 0.57.
    assert (w / m).mean() < 0.6 * (n / m).mean(), ((w / m).mean(), (n / m).mean())
    assert (w <= n).float().mean() > 0.99, (w > n).float().mean()
    assert ((n / m) > 2.0**-8).any(), "the bf16 sum should exceed one bf16 rounding somewhere"


# -- bytes per step: plan == counter for every stage x wire -------------------------------------
def test_plan_wire_bytes_follow_the_formulas() -> None:
    """One flat buffer of B-element buckets: grads (W-1)/W of the packed bucket, int8 with one
    fp32 scale per WBLOCK; stage 0 twice (all-to-all + all-gather); params likewise."""
    W, n = 8, 10 * 8 * 128 * 5  # 5 buckets of 8*128*10 elements exactly
    B, nb = 8 * 128 * 10, 5
    Sh = B // W
    per = {None: Sh * 2, "fp32": Sh * 4, "bf16": Sh * 2, "int8": Sh + 4 * Sh // 128}
    for w in per:
        for pw in (None, "int8"):
            cfg = PlanConfig(
                world_size=W,
                wire=Wire(grads=w, params=pw),
                sharding=Sharding(bucket_numel=B),
                grad_norm=False,
            )
            st = plan_params(n, cfg).stages
            gather = (W - 1) * (per["int8"] if pw else Sh * 2)
            assert st[0].comm_bytes_per_step == nb * 2 * (W - 1) * per[w], w
            assert st[1].comm_bytes_per_step == nb * ((W - 1) * per[w] + gather), (w, pw)
            assert st[3].comm_bytes_per_step == nb * ((W - 1) * per[w] + 2 * gather), (w, pw)
    # int8 sends 1 + 4/128 bytes per element against bf16's 2.
    assert per["int8"] / per["bf16"] == pytest.approx(33 / 64)
    with pytest.raises(TypeError, match=r"use wire=Wire\(grads='fp8'\)"):
        PlanConfig(world_size=2, wire="fp8")  # type: ignore[arg-type]


@pytest.mark.slow  # ~1 s per optimizer under load
@pytest.mark.parametrize("W,rank", [(8, 3), (3, 1)])
def test_counter_equals_plan_for_every_stage_and_wire(W, rank) -> None:
    with torch.device("meta"):
        meta = GPT(GPTConfig(**CFG))
    for stage in (0, 1, 2, 3):
        for w, pw, rdt in (
            (None, None, torch.bfloat16),
            ("fp32", None, torch.float32),
            ("fp32", "int8", torch.bfloat16),
            ("bf16", None, torch.float32),
            ("int8", "int8", torch.float32),
            ("int8", "bf16", torch.bfloat16),
        ):
            cfg = PlanConfig(
                world_size=W,
                precision=Precision(param_dtype=torch.float32, reduce_dtype=rdt),
                wire=Wire(grads=w, params=pw),
                sharding=Sharding(bucket_numel=5000),
            )
            want = plan_model(meta, cfg).stages[stage].comm_bytes_per_step
            with fake_group(rank, W):
                torch.manual_seed(0)
                model = GPT(GPTConfig(**CFG))
                opt = ZeroAdamW(
                    gpt_param_groups(model, 0.1),
                    stage=stage,
                    module=model,
                    max_grad_norm=1.0,
                    precision=Precision(reduce_dtype=rdt),
                    wire=Wire(grads=w, params=pw),
                    sharding=Sharding(bucket_numel=5000),
                )
                x = torch.randint(0, CFG["vocab_size"], (2, CFG["block_size"]))
                model(x, x)[1].backward()
                opt.step()
                opt.zero_grad()
                assert opt.comm.total_bytes == want, (stage, w, pw, rdt, opt.comm.snapshot())
                opt.close()


def test_bad_wire_is_refused_with_the_choices() -> None:
    p = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match=r"Wire\(grads='int4'\): expected None or one of \['fp32'"):
        ZeroAdamW([p], wire=Wire(grads="int4"))
    with pytest.raises(ValueError, match=r"Wire\(params='x'\)"):
        ZeroAdamW([p], wire=Wire(params="x"))
    assert wire.uses_wire(WireFormat.INT8, torch.float32, 1) is False  # nothing on a wire
    assert wire.uses_wire(WireFormat.FP32, torch.float32, 4) is False  # fp32 RS sums in fp32
    assert wire.uses_wire(WireFormat.FP32, torch.bfloat16, 4) is True
    assert new_packed(WireFormat.INT8, 2, 256, torch.device("cpu")).numel() == 2 * (256 + 8)


# -- the optimizer over the wire on gloo ranks ---------------------------------------------------
def _grads_worker(rank: int, world: int, configs: dict[str, dict]) -> dict:
    """Per configuration: the grad shard after two micro-batches (the second reduced after the
    first at stages 2-3, and after `no_sync` at 0-1), the gathered params and masters after a
    step, and the largest |local grad| of any rank (the int8 bound's absmax, at its largest)."""
    out = {}
    for name, c in configs.items():
        pg = rep = None
        r = rank
        if c.get("hsdp"):  # shard over {0,1} / {2,3}, replicate over {0,2} / {1,3}
            pgs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            reps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
            pg, rep = pgs[rank // 2], reps[rank % 2]
        torch.manual_seed(0)
        model = GPT(GPTConfig(**CFG))
        opt = ZeroAdamW(
            gpt_param_groups(model, 0.1),
            lr=1e-2,
            stage=c["stage"],
            module=model,
            wire=Wire(grads=c.get("wire"), params=c.get("param_wire")),
            groups=Groups(shard=pg, replicate=rep),
            sharding=Sharding(bucket_numel=1500),
        )
        g = torch.Generator().manual_seed(7)
        x = torch.randint(0, CFG["vocab_size"], (2 * world * 2, CFG["block_size"] + 1), generator=g)
        local_max = torch.zeros(1)
        for m in range(2):
            xs = x[(2 * r + m) * 2 : (2 * r + m + 1) * 2]
            ctx = opt.no_sync() if m == 0 else contextlib.nullcontext()
            with ctx:
                _, loss = model(xs[:, :-1], xs[:, 1:])
                loss.backward()
        opt.buckets.wait_all()
        opt.buckets.before_step()
        opt.buckets.finish_replicas()  # replica all-reduces (started per bucket) complete
        grads = [torch.cat(b.pieces(b.grad_view())).double().clone() for b in opt.flat_groups]
        # A second, plain fp32 model gives this rank's local grads (for the bound's absmax).
        torch.manual_seed(0)
        ref = GPT(GPTConfig(**CFG))
        for m in range(2):
            xs = x[(2 * r + m) * 2 : (2 * r + m + 1) * 2]
            ref(xs[:, :-1], xs[:, 1:])[1].backward()
        local_max = torch.tensor([max(p.grad.abs().max().item() for p in ref.parameters())])
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX)
        # Skip the reductions already done: step() waits (nothing in flight) and reduces the
        # replicas again only when there are some; compare grads, then params after a step.
        opt.step()
        with opt.gathered_params():
            params = {n: p.detach().double().clone() for n, p in model.named_parameters()}
        out[name] = {
            "grads": grads,
            "absmax": local_max.item(),
            "params": params,
            "masters": [opt.shards.master(b).double().clone() for b in opt.flat_groups],
            "bytes": opt.comm.snapshot()["bytes"],
        }
        opt.close()
    return out


GRAD_CONFIGS = {
    **{f"s{s}-{w}": {"stage": s, "wire": w} for s in range(4) for w in (None, "bf16", "int8")},
    "s1-int8-pint8": {"stage": 1, "wire": "int8", "param_wire": "int8"},
    "s3-int8-pint8": {"stage": 3, "wire": "int8", "param_wire": "int8"},
}


@pytest.mark.slow
def test_every_stage_reduces_over_the_wire_within_the_bound_at_w4() -> None:
    """Grad shards after two micro-batches (no_sync at stages 0-1) against the same run over a
    plain fp32 reduce-scatter: the difference is within the quantization bound of the module
    docstring with absmax taken as the largest local |grad| of any rank (a weaker, per-run
    bound: the shard's error is at most the mean over ranks of each rank's block bound)."""
    W = 4
    res = run_ranks(_grads_worker, W, GRAD_CONFIGS, timeout=600)
    for rank, r in enumerate(res):
        for name, c in GRAD_CONFIGS.items():
            if c.get("wire") is None:
                continue
            if c.get("param_wire") and c["stage"] == 3:
                continue  # its forward already ran on int8-gathered params: checked below
            base = r[f"s{c['stage']}-None"]
            a = r[name]["absmax"] * 2  # two micro-batches summed before the reduction (0-1)
            q = a / 254 * (1 + 2.0**-14) if c["wire"] == "int8" else a * 2.0**-8
            worst = 0.0
            for got, want in zip(r[name]["grads"], base["grads"]):
                err = (got - want).abs().max().item()
                assert err <= q + 16 * U32 * a, (rank, name, err, q)
                worst = max(worst, err)
            # (A shard of only padding, or of grads exact in bf16, may match exactly.)
            assert worst > 0, (rank, name, "nothing was quantized?")
            # Masters are exact: updated from the same-bounded grads, never from wire values.
            if c.get("param_wire"):
                same = r[f"s{c['stage']}-int8"]
                for m1, m2 in zip(r[name]["masters"], same["masters"]):
                    assert torch.equal(m1, m2), name
                for n, p in r[name]["params"].items():
                    d = (p - same["params"][n]).abs().max().item()
                    assert d <= p.abs().max().item() / 254 * (1 + 2.0**-14), (name, n, d)
    # Stage 3 with int8 params: each rank's view has its own piece exact and the others'
    # quantized, so two ranks' views differ, by at most one int8 rounding of the block.
    v0, v1 = res[0]["s3-int8-pint8"]["params"], res[1]["s3-int8-pint8"]["params"]
    worst = 0.0
    for n, p in v0.items():
        d = (p - v1[n]).abs().max().item()
        assert d <= p.abs().max().item() / 254 * (1 + 2.0**-14), (n, d)
        worst = max(worst, d)
    assert worst > 0
    # Replicas of stage 0 stay bitwise equal: every rank dequantizes the same bytes.
    for name in ("s0-bf16", "s0-int8"):
        for r in res[1:]:
            for n, p in r[name]["params"].items():
                assert torch.equal(p, res[0][name]["params"][n]), (name, n)


@pytest.mark.slow
def test_hsdp_replica_all_reduce_over_the_wire_keeps_replicas_equal() -> None:
    configs = {
        "ref": {"stage": 2, "hsdp": True},
        "int8": {"stage": 2, "hsdp": True, "wire": "int8"},
    }
    res = run_ranks(_grads_worker, 4, configs, timeout=600)
    for rank, r in enumerate(res):
        twin = res[(rank + 2) % 4]  # the replica holding the same shard
        for g1, g2 in zip(r["int8"]["grads"], twin["int8"]["grads"]):
            assert torch.equal(g1, g2), rank
        a = r["int8"]["absmax"] * 2
        for got, want in zip(r["int8"]["grads"], r["ref"]["grads"]):
            # Two quantizations: the shard reduce-scatter, then the replica all-reduce (its
            # all-to-all and its all-gather of the averaged chunk).
            assert (got - want).abs().max().item() <= 3 * a / 254 * (1 + 2.0**-14), rank
        assert r["int8"]["bytes"]["all_to_all"] > 0 and r["int8"]["bytes"]["all_reduce"] == 4


def test_cli_wire_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from fusedzero.app.config import parse_args
    from fusedzero.cli import main

    assert parse_args(["--wire", "int8", "--param-wire", "bf16"]).wire == "int8"
    assert main(["train", "--wire", "fp8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fusedzero: error:") and "fp8" in err and err.count("\n") == 1, err
    assert main(["plan", "--params", "1e6", "-W", "8", "--wire", "all", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    by = d["comm_bytes_per_step_by_wire"]
    assert set(by) == {"native", "fp32", "bf16", "int8"}
    assert by["int8"]["2"] < by["bf16"]["2"] < by["fp32"]["2"]
