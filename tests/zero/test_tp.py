"""Tensor parallelism x ZeRO on a (dp=2, tp=2) mesh of 4 gloo ranks: DTensor params from
`parallelize_module` train under ZeroAdamW(groups=Groups(shard=<dp group>)) at every stage and
match a single-process torch.optim.AdamW + clip_grad_norm_ on the same global batch.

Two models: "sp" (sequence parallel: LayerNorms under SequenceParallel are Replicate DTensors
whose grads come back Partial) and "mlp" (Colwise then Rowwise, a plain LayerNorm after: plain
params in a tensor-parallel model). One spawn per model runs every stage. Replicate and plain
params stay bitwise identical on every rank after every step; and a sixth step with an inf
planted on tp rank 1 only, in a Replicate param's grad, is skipped by every rank (the
optimizer's default skip_nonfinite=True) with the state unchanged bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fusedzero import Groups, ZeroAdamW
from fusedzero.testing import run_ranks

pytestmark = pytest.mark.slow  # spawns 4 ranks

DP, TP = 2, 2
D, H, T = 12, 20, 4  # model width, hidden, sequence length
BATCH = 4  # global batch: 2 per dp rank at dp=2, 1 at dp=4 (HSDP)
STEPS = 5
LR, WD = 1e-2, 0.1
CLIP = 0.05  # below the grad norm of every step (checked on the reference): clipping acts
# fp32: the ranks sum partial dot products (tp) and per-rank means (dp) in another order than
# the reference (~1e-7 relative per op); Adam's 1/sqrt(v) amplifies that in small-grad
# elements by at most lr times the relative noise per step: 1e-5 relative + 1e-6 absolute.
RTOL, ATOL = 1e-5, 1e-6


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc = nn.Linear(D, H)
        self.proj = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.tanh(self.fc(self.norm(x))))


class SpNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.norm(x)


class MlpNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, H)
        self.proj = nn.Linear(H, D)
        self.norm = nn.LayerNorm(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(torch.tanh(self.fc(x))))


def make(kind: str) -> nn.Module:
    torch.manual_seed(0)
    m = SpNet() if kind == "sp" else MlpNet()
    with torch.no_grad():  # LayerNorm starts at 1/0: perturb so every param is random data
        for n, p in m.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    return m


def parallelize(m: nn.Module, kind: str, tp_mesh) -> None:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if kind == "sp":
        plan = {"norm": SequenceParallel()}
        for i in range(len(m.blocks)):
            plan.update(
                {
                    f"blocks.{i}.norm": SequenceParallel(),
                    f"blocks.{i}.fc": ColwiseParallel(input_layouts=Shard(1)),
                    f"blocks.{i}.proj": RowwiseParallel(output_layouts=Shard(1)),
                }
            )
    else:
        plan = {"fc": ColwiseParallel(), "proj": RowwiseParallel()}
    parallelize_module(m, tp_mesh, plan)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, T, D, generator=g), torch.randn(BATCH, T, D, generator=g)


def reference(kind: str) -> dict:
    m = make(kind)
    opt = torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=WD)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = batch(step)
        loss = ((m(x) - y) ** 2).mean()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {
        "params": {n: p.detach().clone() for n, p in m.named_parameters()},
        "losses": losses,
        "norms": norms,
    }


def _local_loss(
    m: nn.Module, kind: str, step: int, dp_rank: int, dp: int, tp_rank: int
) -> torch.Tensor:
    """This rank's part of its dp replica's mean loss: "sp" feeds and scores this tp rank's
    slice of the sequence (the tp ranks' parts sum to the replica's loss)."""
    x, y = batch(step)
    per = BATCH // dp
    x, y = x[dp_rank * per : (dp_rank + 1) * per], y[dp_rank * per : (dp_rank + 1) * per]
    if kind == "sp":
        s = T // TP
        x, y = x[:, tp_rank * s : (tp_rank + 1) * s], y[:, tp_rank * s : (tp_rank + 1) * s]
        out = m(x)
        out = out.to_local() if hasattr(out, "to_local") else out
        return ((out - y) ** 2).sum() / (per * T * D)
    return ((m(x) - y) ** 2).mean()


# The Replicate param whose grad gets an inf on tp rank 1 only: "mlp": the RowwiseParallel
# bias (a Replicate grad, never reduced over tp: the inf stays on tp rank 1, which counts its
# Replicate buffers with weight 0 in the grad norm, so only 0 * inf = nan tells); "sp": a
# SequenceParallel norm (a Partial grad: its reduction over tp carries the inf to tp rank 0).
PLANT = {"mlp": "proj.bias", "sp": "blocks.0.norm.weight"}


def _state(opt: ZeroAdamW) -> dict[str, torch.Tensor]:
    st = opt.shard_state()
    return {
        f"{k}{b}": t.clone()
        for k in ("master", "exp_avg", "exp_avg_sq")
        for b, t in enumerate(getattr(st, k))
    }


def _nonfinite_step(m: nn.Module, opt: ZeroAdamW, name: str, loss_fn) -> dict:
    """One more step with an inf planted (tp rank 1 only, see PLANT) by a grad hook: what
    changed (nothing may), whether the step was skipped and the hook fired."""
    from torch.distributed.tensor import DTensor

    tp_rank = opt.tp.rank
    state = _state(opt)
    with opt.gathered_params():
        params = {
            n: (p.to_local() if isinstance(p, DTensor) else p.detach()).clone()
            for n, p in m.named_parameters()
        }
    fired = []
    hook = None
    if tp_rank == 1:

        def plant(g: torch.Tensor) -> torch.Tensor:
            fired.append(True)
            return g * float("inf")  # inf where g != 0, nan where it is 0

        hook = m.get_parameter(name).register_hook(plant)
    loss_fn().backward()
    if hook is not None:
        hook.remove()
    opt.step()
    opt.zero_grad()
    changed = [k for k, t in _state(opt).items() if not torch.equal(t, state[k])]
    with opt.gathered_params():
        changed += [
            n
            for n, p in m.named_parameters()
            if not torch.equal(p.to_local() if isinstance(p, DTensor) else p.detach(), params[n])
        ]
    return {
        "skipped": bool(opt.skipped),
        "step_count": float(opt.step_count),
        "changed": changed,
        "fired": bool(fired),
        "tp_rank": tp_rank,
    }


def _train(rank: int, world: int, kind: str, stages: tuple[int, ...], replicas: int = 1) -> dict:
    """(dp=2, tp=2); with `replicas` > 1, HSDP: a (replicate, shard=2, tp=2) mesh, the
    optimizer sharding over "shard" and replicating over "replicate"."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    if replicas == 1:
        mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
        dp_groups = [mesh["dp"].get_group()]
        dp_rank, dp = mesh["dp"].get_local_rank(), DP
    else:
        mesh = init_device_mesh("cpu", (replicas, DP, TP), mesh_dim_names=("rep", "dp", "tp"))
        dp_groups = [mesh["dp"].get_group(), mesh["rep"].get_group()]
        dp_rank = mesh["rep"].get_local_rank() * DP + mesh["dp"].get_local_rank()
        dp = replicas * DP
    tp_rank = mesh["tp"].get_local_rank()
    out: dict = {}
    for stage in stages:
        m = make(kind)
        parallelize(m, kind, mesh["tp"])
        opt = ZeroAdamW(
            m.parameters(),
            lr=LR,
            weight_decay=WD,
            stage=stage,
            module=m,
            max_grad_norm=CLIP,
            groups=Groups(shard=dp_groups[0], replicate=dp_groups[1] if replicas > 1 else None),
        )
        losses, norms, replicated = [], [], []
        for step in range(STEPS):
            loss = _local_loss(m, kind, step, dp_rank, dp, tp_rank)
            loss.backward()
            opt.step()
            opt.zero_grad()
            # The replica's loss: its tp parts summed ("sp"), then the mean over dp.
            t = loss.detach().clone()
            if kind == "sp":
                dist.all_reduce(t, group=mesh["tp"].get_group())
            for g in dp_groups:
                dist.all_reduce(t, group=g)
            losses.append(float(t) / dp)
            norms.append(float(opt.grad_norm))
            with opt.gathered_params():  # Replicate DTensors and plain params
                replicated.append(
                    {
                        n: (p.to_local() if isinstance(p, DTensor) else p.detach()).clone()
                        for n, p in m.named_parameters()
                        if not isinstance(p, DTensor)
                        or all(isinstance(x, Replicate) for x in p.placements)
                    }
                )
        with opt.gathered_params():
            full = {
                n: (p.full_tensor() if isinstance(p, DTensor) else p.detach()).clone()
                for n, p in m.named_parameters()
            }
            kinds = {n: type(p).__name__ for n, p in m.named_parameters()}
        nonfinite = _nonfinite_step(
            m, opt, PLANT[kind], lambda m=m: _local_loss(m, kind, STEPS, dp_rank, dp, tp_rank)
        )
        opt.close()
        out[stage] = {
            "params": full,
            "losses": losses,
            "norms": norms,
            "replicated": replicated,
            "kinds": kinds,
            "nonfinite": nonfinite,
        }
    return out


# The params identical on every rank (Replicate DTensors over tp, plain params), by kind.
REPLICATED = {
    "sp": {
        **{
            f"blocks.{i}.{n}": "Replicate"
            for i in range(2)
            for n in ("norm.weight", "norm.bias", "proj.bias")
        },
        "norm.weight": "Replicate",
        "norm.bias": "Replicate",
    },
    "mlp": {"proj.bias": "Replicate", "norm.weight": "plain", "norm.bias": "plain"},
}


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=RTOL, atol=ATOL)


def check(kind: str, stages: tuple[int, ...], results: list[dict]) -> None:
    ref = reference(kind)
    assert min(ref["norms"]) > CLIP, ref["norms"]  # clipping acts on every step
    for stage in stages:
        for rank, res in enumerate(results):
            r = res[stage]
            where = f"stage {stage} rank {rank} ({kind})"
            if kind == "sp":
                assert r["kinds"]["blocks.0.norm.weight"] == "DTensor", where
            for i, (a, b) in enumerate(zip(r["losses"], ref["losses"])):
                assert abs(a - b) <= RTOL * abs(b) + ATOL, f"{where} step {i}: loss {a} vs {b}"
            for i, (a, b) in enumerate(zip(r["norms"], ref["norms"])):
                assert abs(a - b) <= RTOL * b, f"{where} step {i}: grad norm {a} vs {b}"
            for n, p in ref["params"].items():
                got = r["params"][n]
                err = ((got - p).abs() / (p.abs() + ATOL / RTOL)).max()
                assert _close(got, p), f"{where}: param {n} differs, max rel err {err:.2e}"
        # Replicate and plain params: bitwise identical on every rank after every step.
        for step in range(STEPS):
            first = results[0][stage]["replicated"][step]
            # "sp": the norms (Replicate); "mlp": the Rowwise bias and the plain LayerNorm
            assert set(first) == set(REPLICATED[kind]), sorted(first)
            for rank in range(1, len(results)):
                other = results[rank][stage]["replicated"][step]
                for n, t in first.items():
                    assert torch.equal(t, other[n]), (
                        f"stage {stage} step {step}: {REPLICATED[kind][n]} param {n} differs "
                        f"between rank 0 and rank {rank}"
                    )
        # An inf on tp rank 1 only: every rank skips the step, nothing changes.
        for rank, res in enumerate(results):
            nf = res[stage]["nonfinite"]
            where = f"stage {stage} rank {rank} ({kind}), inf in {PLANT[kind]} on tp rank 1"
            assert nf["fired"] == (nf["tp_rank"] == 1), where
            assert nf["skipped"] and nf["step_count"] == STEPS, (where, nf)
            assert nf["changed"] == [], f"{where}: the skipped step changed {nf['changed']}"


@pytest.mark.parametrize("kind", ["sp", "mlp"])
def test_tp_zero_matches_adamw(kind: str) -> None:
    stages = (0, 1, 2, 3)
    check(kind, stages, run_ranks(_train, DP * TP, kind, stages, timeout=600))


def test_tp_hsdp_3d_mesh() -> None:
    """HSDP composes: (replicate=2, shard=2, tp=2) on 8 ranks, replicate_group given."""
    stages = (2,)
    check("sp", stages, run_ranks(_train, 2 * DP * TP, "sp", stages, 2, timeout=900))
