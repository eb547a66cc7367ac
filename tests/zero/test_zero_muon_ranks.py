"""ZeroMuon over several gloo ranks against the single-process torch.optim.Muon + AdamW.

Each rank takes its slice of every batch (grads averaged as DDP), so the grads differ from the
reference's by the summation order of the batch mean: exactly the noise control of
tests/zero/test_zero_muon.py (the reference against itself with each loss over two half
batches), and the params must match within 2x of it. At stage 0 every rank runs Newton-Schulz
on every matrix; at stages 1-3 the owner layout (fusedzero/_owner_layout.py) puts each matrix
whole on one rank, an expert stack [E, M, N] streaming its matrices over consecutive owners.
Checkpoints save momentum per param, so a run moves between world sizes and stages (owners
change) and resumes as the reference would.

About internals: `FlatBuffer.layout` segments and `LocalShard.whole_tensors` (which matrix a
rank owns), `ZeroOptimizer.shard_infos`/`shard_state` (the momentum buffers by segment).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_zero_muon import (
    CFG,
    MUON_HP,
    _assert_within,
    _first_diff,
    _params,
    _reference_and_noise,
    _zero,
)
from torch import nn

from fusedzero import Sharding, ZeroMuon, checkpoint, muon_param_groups
from fusedzero.testing import fake_group, run_ranks

from _helpers import gpt_batch, make_gpt

ADAMW = dict(lr=1e-3, weight_decay=0.01)
CLIP = 0.5  # below the grad norm of every step here: the clip coefficient is live
BATCH = 8  # sequences a step: a quarter each at W = 4, in two micro-batches of one
STEPS = 4
MICRO = (1, 3)  # the steps taken as two accumulated micro-batches on every rank


@functools.cache
def _gpt_reference() -> tuple[dict[str, torch.Tensor], float]:
    return _reference_and_noise(ADAMW, CLIP, STEPS, BATCH)


def _train(model: nn.Module, opt: ZeroMuon, rank: int, world: int, steps: range) -> None:
    """`steps` of the small GPT, this rank on its slice of every batch (two micro-batches at the
    steps of MICRO)."""
    h = BATCH // world
    for step in steps:
        x, y = gpt_batch(CFG, BATCH, step)
        x, y = x[rank * h : (rank + 1) * h], y[rank * h : (rank + 1) * h]
        micro = 2 if step in MICRO else 1
        for k in range(micro):
            sl = slice(k * h // micro, (k + 1) * h // micro)
            (model(x[sl], y[sl])[1] / micro).backward()
        opt.step()
        opt.zero_grad()


def _momentum_pieces(opt: ZeroMuon) -> dict[str, list[tuple[int, torch.Tensor]]]:
    """This rank's Muon momentum by param name: (first element in the flattened param, values)
    for every segment its shards hold."""
    st, out = opt.shard_state(), {}
    for info, buf in zip(opt.shard_infos(), st.momentum_buffer, strict=True):
        for seg in info.segments() if buf is not None else ():
            piece = buf[seg.local : seg.local + seg.length].clone()
            out.setdefault(opt.param_names[seg.param], []).append((seg.start, piece))
    return out


def _merged_momenta(
    per_rank: list[dict[str, list[tuple[int, torch.Tensor]]]], numels: dict[str, int]
) -> dict[str, torch.Tensor]:
    """Every Muon param's momentum, whole, from the ranks' pieces (stages 1-3): each element
    held by exactly one rank."""
    out: dict[str, torch.Tensor] = {}
    held: dict[str, torch.Tensor] = {}
    for pieces in per_rank:
        for name, runs in pieces.items():
            full = out.setdefault(name, torch.zeros(numels[name]))
            count = held.setdefault(name, torch.zeros(numels[name], dtype=torch.int64))
            for start, t in runs:
                full[start : start + len(t)] = t
                count[start : start + len(t)] += 1
    for name, count in held.items():
        assert bool((count == 1).all()), f"{name}: elements held by {count.unique().tolist()}"
    return out


# -- 1. the small GPT at stages 0-3 -----------------------------------------------------------


def _gpt_stages(rank: int, world: int) -> dict[int, dict[str, torch.Tensor]]:
    out = {}
    for stage in range(4):
        model = make_gpt(CFG)
        opt = _zero(model, ADAMW, stage, max_grad_norm=CLIP)
        _train(model, opt, rank, world, range(STEPS))
        out[stage] = _params(model, opt)
        opt.close()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_stages_0_to_3_match_muon_plus_adamw(world: int) -> None:
    """W gloo ranks, each with its slice of every batch, at stages 0-3 (one spawned run builds
    each stage in turn on a fresh model), clipping by global norm and two accumulated
    micro-batches at some steps: every rank holds the same params, which match
    torch.optim.Muon + torch.optim.AdamW after `clip_grad_norm_` on the whole batch within 2x
    the noise control."""
    outs = run_ranks(_gpt_stages, world)
    want, noise = _gpt_reference()
    for stage in range(4):
        for r in range(1, world):
            for n, w in outs[0][stage].items():
                got = outs[r][stage][n]
                assert torch.equal(got, w), f"stage {stage} rank {r} {n}: {_first_diff(got, w)}"
        _assert_within(outs[0][stage], want, 2 * noise, f"W={world} stage {stage}")


# -- 2. a Mixtral-shaped mixture of experts ---------------------------------------------------

E, D, VOCAB, SEQ = 4, 16, 32, 8
# An expert matrix of ffn = 32 is 32 * D = 512 elements, an ALIGN multiple and the largest block:
# the owner layout's shard size, so each stack streams one matrix a shard over consecutive
# owners. At ffn = 8 it is 128 elements and a q projection (256) sets the shard size: two
# matrices a shard, a rank's run of a stack a [2, ffn, D] piece.
FFN = 32
MOE_BATCH = 8  # sequences a step
MOE_STEPS = 3


class Moe(nn.Module):
    """One Mixtral-shaped layer: single-head causal attention (q, k, v, o projections), a router
    Linear, top-k routing to E SiLU experts held as stacks `w1` [E, ffn, D] and `w2` [E, D, ffn]
    (or, `stacked=False`, as 2-D params `w1s.e`, `w2s.e`: the same math), a norm and a head."""

    def __init__(self, top_k: int, stacked: bool = True, ffn: int = FFN) -> None:
        super().__init__()
        self.top_k, self.ffn = top_k, ffn
        self.embed = nn.Embedding(VOCAB, D)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(D, D, bias=False) for _ in range(4)
        )
        self.norm = nn.LayerNorm(D)
        self.router = nn.Linear(D, E, bias=False)
        w1, w2 = torch.randn(E, ffn, D) * D**-0.5, torch.randn(E, D, ffn) * ffn**-0.5
        if stacked:
            self.w1, self.w2 = nn.Parameter(w1), nn.Parameter(w2)
        else:
            self.w1s = nn.ParameterList(nn.Parameter(m) for m in w1)
            self.w2s = nn.ParameterList(nn.Parameter(m) for m in w2)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        h = h + self.o_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        t = self.norm(h).reshape(-1, D)
        probs = torch.softmax(self.router(t), dim=-1)
        gate, idx = probs.topk(self.top_k, dim=-1)
        if self.top_k > 1:  # Mixtral renormalises its top-k; top-1 keeps the router's grad
            gate = gate / gate.sum(-1, keepdim=True)
        w1 = self.w1.unbind(0) if hasattr(self, "w1") else list(self.w1s)
        w2 = self.w2.unbind(0) if hasattr(self, "w2") else list(self.w2s)
        out = torch.zeros_like(t)
        for e in range(E):  # an expert with no token still gets a (zero) grad
            tok, slot = (idx == e).nonzero(as_tuple=True)
            ye = F.silu(t[tok] @ w1[e].T) @ w2[e].T
            out = out.index_add(0, tok, ye * gate[tok, slot, None])
        h = h + out.view_as(h)
        return F.cross_entropy(self.lm_head(h).reshape(-1, VOCAB), y.reshape(-1))


# Buckets of one bin per rank (a bucket holds as many as bucket_numel allows: with the default
# a stack's consecutive matrices would share a rank), so each expert stack streams one matrix
# (or `per`) a rank over consecutive ranks: the stacks are cut between owners.
ONE_BIN = Sharding(bucket_numel=1)


def _moe(top_k: int, ffn: int = FFN) -> Moe:
    torch.manual_seed(0)
    return Moe(top_k, ffn=ffn)


def _moe_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    x = torch.randint(0, VOCAB, (MOE_BATCH, SEQ + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _split_twin(model: Moe) -> Moe:
    """`model` with each expert matrix a 2-D param of the same values."""
    twin = Moe(model.top_k, stacked=False, ffn=model.ffn)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in ("w1", "w2"):
                for e in range(E):
                    twin.get_parameter(f"{n}s.{e}").copy_(p[e])
            else:
                twin.get_parameter(n).copy_(p)
    return twin


def _moe_reference(top_k: int, ffn: int) -> tuple[dict[str, torch.Tensor], float]:
    """torch.optim.Muon (on each expert matrix as a 2-D param: it refuses 3-D) + AdamW on the
    whole batch, clipped: the params by the stacked model's names after MOE_STEPS steps, and
    the noise control: how far the same reference moves them when each loss is the mean of 2, 4
    or 8 partial-batch losses (the most of the three). One ordering is not enough here: in a
    model this small an ulp of another order flips a bf16 rounding of Newton-Schulz's input
    (about 2e-4 on the params) for some orders and for none of others, by chance."""
    runs = {}
    for parts in (1, 2, 4, 8):
        twin = _split_twin(_moe(top_k, ffn))
        groups = muon_param_groups(twin)
        opts = (
            torch.optim.Muon(groups[0]["params"], **MUON_HP),
            torch.optim.AdamW(groups[1]["params"], **ADAMW),
        )
        h = MOE_BATCH // parts
        for step in range(MOE_STEPS):
            x, y = _moe_batch(step)
            sum(twin(x[i : i + h], y[i : i + h]) / parts for i in range(0, MOE_BATCH, h)).backward()
            torch.nn.utils.clip_grad_norm_(twin.parameters(), CLIP)
            for o in opts:
                o.step()
                o.zero_grad()
        p = {n: q.detach() for n, q in twin.named_parameters() if n[:4] not in ("w1s.", "w2s.")}
        for n in ("w1", "w2"):
            p[n] = torch.stack([twin.get_parameter(f"{n}s.{e}").detach() for e in range(E)])
        runs[parts] = p
    want = runs.pop(1)
    noise = max((r[n] - w).abs().max().item() for r in runs.values() for n, w in want.items())
    assert 0.0 < noise < 5e-3, f"noise control moved the params by {noise}"
    return want, noise


def test_the_owner_layout_cuts_an_expert_stack_between_matrices_only() -> None:
    """Over 2 ranks (a fake group) at stage 1, each expert stack is streamed one matrix a shard:
    rank r holds matrices of it, not all, and the Muon rule takes each run of whole matrices
    (`whole_tensors(stacks=True)`, a [k, M, N] piece) where a whole-param view refuses it."""
    held: dict[str, list[int]] = {}
    for r in range(2):
        with fake_group(r, 2):
            model = _moe(2)
            opt = ZeroMuon(
                muon_param_groups(model), stage=1, module=model, device="cpu", sharding=ONE_BIN
            )
            (shard,) = [
                b.local_shard()
                for b in opt.flat_groups
                if opt.group_rules[b.group_index].name == "muon"
            ]
            with pytest.raises(ValueError, match="is not whole in this local shard"):
                shard.whole_tensors()
            for t in shard.whole_tensors(stacks=True):
                name = opt.param_names[t.param]
                if name in ("w1", "w2"):
                    assert t.shape[1:] == model.get_parameter(name).shape[1:], t
                    held.setdefault(name, []).extend([r] * t.shape[0])
            opt.close()
    assert sorted(held["w1"]) == sorted(held["w2"]) == [0, 0, 1, 1], held


def _moe_stages(rank: int, world: int, top_k: int, ffn: int) -> dict[int, dict[str, Any]]:
    out = {}
    h = MOE_BATCH // world
    for stage in (1, 2, 3):
        model = _moe(top_k, ffn)
        opt = ZeroMuon(
            muon_param_groups(model, muon=MUON_HP, adamw=ADAMW),
            stage=stage,
            module=model,
            max_grad_norm=CLIP,
            sharding=ONE_BIN,
        )
        owned = []  # (name, first element, elements) of every Muon segment this rank holds
        for buf in opt.flat_groups:
            if opt.group_rules[buf.group_index].name == "muon":
                owned += [
                    (opt.param_names[s.param], s.start, s.length)
                    for s in buf.local_shard().segments
                ]
        for step in range(MOE_STEPS):
            x, y = _moe_batch(step)
            model(x[rank * h : (rank + 1) * h], y[rank * h : (rank + 1) * h]).backward()
            opt.step()
            opt.zero_grad()
        out[stage] = {"params": _params(model, opt), "owned": owned}
        opt.close()
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("world", "top_k", "ffn"), [(2, 2, 32), (4, 1, 32), (4, 2, 8)])
def test_a_mixtral_shaped_moe_with_expert_stacks_cut_between_owners(
    world: int, top_k: int, ffn: int
) -> None:
    """A Mixtral-shaped layer whose experts are 3-D stacks [E, ffn, D] and [E, D, ffn] in the
    Muon group (with the attention projections and the router), top-k routing, clipping, at
    stages 1-3 over W gloo ranks: each expert matrix is owned whole by one rank and each stack's
    matrices by several (the stack is cut between owners, at matrix edges only); the params
    match torch.optim.Muon over the E matrices as 2-D params + AdamW within 2x the noise
    control, on every rank alike."""
    outs = run_ranks(_moe_stages, world, top_k, ffn)
    want, noise = _moe_reference(top_k, ffn)
    m = ffn * D  # elements of one expert matrix
    per = max(D * D, m) // m  # matrices a shard: the shard size is the largest block's
    for stage in (1, 2, 3):
        owners: dict[str, dict[int, int]] = {}  # stack name: its matrix -> its owner
        for r in range(world):
            for name, start, length in outs[r][stage]["owned"]:
                if name in ("w1", "w2"):
                    assert start % m == 0 and length == per * m, (name, start, length)
                    for j in range(start // m, (start + length) // m):
                        assert j not in owners.setdefault(name, {}), (stage, name, j)
                        owners[name][j] = r
        for name in ("w1", "w2"):
            assert sorted(owners[name]) == list(range(E)), (stage, name, owners)
            assert len(set(owners[name].values())) > 1, f"stage {stage}: {name} on one rank"
        for r in range(1, world):
            for n, w in outs[0][stage]["params"].items():
                assert torch.equal(outs[r][stage]["params"][n], w), f"stage {stage} rank {r} {n}"
        _assert_within(outs[0][stage]["params"], want, 2 * noise, f"W={world} stage {stage}")


# -- 3. checkpoints ---------------------------------------------------------------------------


def _save_w4_stage3(rank: int, world: int, path: str) -> dict[str, Any]:
    model = make_gpt(CFG)
    opt = _zero(model, ADAMW, 3, max_grad_norm=CLIP)
    _train(model, opt, rank, world, range(2))
    checkpoint.save(opt, path, step=2).wait()
    out = {"params": _params(model, opt), "momenta": _momentum_pieces(opt)}
    opt.close()
    return out


def _load_w2_stage1(rank: int, world: int, path: str) -> dict[str, Any]:
    model = make_gpt(CFG, seed=1)
    opt = _zero(model, ADAMW, 1, max_grad_norm=CLIP)
    checkpoint.load(opt, path)
    out = {"params": _params(model, opt), "momenta": _momentum_pieces(opt)}
    _train(model, opt, rank, world, range(2, STEPS))
    out["final"] = _params(model, opt)
    opt.close()
    return out


@pytest.mark.slow
def test_a_checkpoint_of_4_ranks_at_stage_3_resumes_on_2_ranks_at_stage_1(tmp_path) -> None:
    """Saved by 4 gloo ranks at stage 3 after two steps, loaded by 2 ranks at stage 1 (other
    owners for most matrices): every param and every Muon momentum buffer is the saved one bit
    for bit; two more steps then match the single-process reference run of four steps within
    2x the noise control."""
    saved = run_ranks(_save_w4_stage3, 4, str(tmp_path))
    loaded = run_ranks(_load_w2_stage1, 2, str(tmp_path))
    numels = {n: p.numel() for n, p in make_gpt(CFG).named_parameters()}
    want_m = _merged_momenta([o["momenta"] for o in saved], numels)
    got_m = _merged_momenta([o["momenta"] for o in loaded], numels)
    assert sorted(got_m) == sorted(want_m) and len(want_m) == 8
    for n, w in want_m.items():
        assert torch.equal(got_m[n], w), f"momentum {n}: {_first_diff(got_m[n], w)}"
    for o in loaded:
        for n, w in saved[0]["params"].items():
            assert torch.equal(o["params"][n], w), f"param {n}: {_first_diff(o['params'][n], w)}"
    want, noise = _gpt_reference()
    _assert_within(loaded[0]["final"], want, 2 * noise, "resumed at W=2 stage 1")
    for n, w in loaded[0]["final"].items():
        assert torch.equal(loaded[1]["final"][n], w), f"ranks differ: {n}"


def _resume_same_layout(rank: int, world: int, path: str) -> dict[str, Any]:
    model = make_gpt(CFG)
    opt = _zero(model, ADAMW, 2, max_grad_norm=CLIP)
    _train(model, opt, rank, world, range(STEPS))
    straight = {"params": _params(model, opt), "momenta": _momentum_pieces(opt)}
    opt.close()
    model = make_gpt(CFG)
    opt = _zero(model, ADAMW, 2, max_grad_norm=CLIP)
    _train(model, opt, rank, world, range(2))
    checkpoint.save(opt, path, step=2).wait()
    opt.close()
    model = make_gpt(CFG, seed=1)
    opt = _zero(model, ADAMW, 2, max_grad_norm=CLIP)
    checkpoint.load(opt, path)
    _train(model, opt, rank, world, range(2, STEPS))
    resumed = {"params": _params(model, opt), "momenta": _momentum_pieces(opt)}
    opt.close()
    return {"straight": straight, "resumed": resumed}


@pytest.mark.slow
def test_a_checkpoint_resumes_bit_exactly_at_the_same_world_size_and_stage(tmp_path) -> None:
    """Two gloo ranks at stage 2: two steps, save, load into a fresh model and ZeroMuon, two
    more steps equal four straight steps bit for bit, every param and every rank's Muon
    momentum."""
    outs = run_ranks(_resume_same_layout, 2, str(tmp_path))
    for r, o in enumerate(outs):
        a, b = o["straight"], o["resumed"]
        for n, w in a["params"].items():
            assert torch.equal(b["params"][n], w), f"rank {r} {n}: {_first_diff(b['params'][n], w)}"
        assert sorted(b["momenta"]) == sorted(a["momenta"]) and a["momenta"], r
        for n, runs in a["momenta"].items():
            for (s0, w), (s1, g) in zip(runs, b["momenta"][n], strict=True):
                assert s0 == s1 and torch.equal(g, w), f"rank {r} momentum {n}"


def _moe_save_or_load(rank: int, world: int, path: str, stage: int, load: bool) -> dict[str, Any]:
    model = _moe(2)
    opt = ZeroMuon(
        muon_param_groups(model, muon=MUON_HP, adamw=ADAMW),
        stage=stage,
        module=model,
        sharding=ONE_BIN,
    )
    if load:
        checkpoint.load(opt, path)
    else:
        h = MOE_BATCH // world
        for step in range(2):
            x, y = _moe_batch(step)
            model(x[rank * h : (rank + 1) * h], y[rank * h : (rank + 1) * h]).backward()
            opt.step()
            opt.zero_grad()
        checkpoint.save(opt, path, step=2).wait()
    out = {"params": _params(model, opt), "momenta": _momentum_pieces(opt)}
    opt.close()
    return out


@pytest.mark.slow
def test_expert_stacks_cut_between_owners_reshard_through_a_checkpoint(tmp_path) -> None:
    """The Mixtral-shaped layer saved by 4 gloo ranks at stage 3 (each stack's matrices on all
    four) and loaded by 2 ranks at stage 1 (two matrices of each stack a rank): every param and
    every element of every Muon momentum buffer, the stacks' included, is the saved one."""
    saved = run_ranks(_moe_save_or_load, 4, str(tmp_path), 3, False)
    loaded = run_ranks(_moe_save_or_load, 2, str(tmp_path), 1, True)
    numels = {n: p.numel() for n, p in _moe(2).named_parameters()}
    want = _merged_momenta([o["momenta"] for o in saved], numels)
    got = _merged_momenta([o["momenta"] for o in loaded], numels)
    assert sorted(got) == sorted(want) and {"w1", "w2", "router.weight"} <= set(want)
    for n, w in want.items():
        assert torch.equal(got[n], w), f"momentum {n}: {_first_diff(got[n], w)}"
        assert bool(w.abs().gt(0).any()), n
    for o in loaded:
        for n, w in saved[0]["params"].items():
            assert torch.equal(o["params"][n], w), f"param {n}: {_first_diff(o['params'][n], w)}"
