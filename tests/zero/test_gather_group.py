"""`gather_group=`: the param all-gathers of stages 1-3 on a second group over the same ranks
(on NCCL its own communicator and stream, so a prefetch all-gather never queues behind a
reduce-scatter). Every all-gather goes there, nothing else does, and the values are the ones of
a run on one group, bit for bit.

About an internal: fusedzero._comm."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fusedzero._comm as comm
from fusedzero import Groups, Sharding, ZeroAdamW
from fusedzero.testing import fake_group, run_ranks

from _helpers import Stack


def _train(
    stage: int, gather_group: dist.ProcessGroup | None, rank: int
) -> tuple[list[torch.Tensor], list[str]]:
    """Params after 3 steps, and which group each all-gather / reduce-scatter went to."""
    seen: list[str] = []
    real_ag, real_rs = comm._all_gather, comm._reduce_scatter

    def tag(g: object) -> str:
        return "gather_group" if g is gather_group and g is not None else "process_group"

    def ag(out, inp, group=None, async_op=False):  # noqa: ANN001, ANN202
        seen.append("all_gather on " + tag(group))
        return real_ag(out, inp, group=group, async_op=async_op)

    def rs(out, inp, group=None, async_op=False):  # noqa: ANN001, ANN202
        seen.append("reduce_scatter on " + tag(group))
        return real_rs(out, inp, group=group, async_op=async_op)

    comm._all_gather, comm._reduce_scatter = ag, rs
    try:
        torch.manual_seed(0)
        model = Stack()
        opt = ZeroAdamW(
            model.parameters(),
            lr=1e-2,
            stage=stage,
            module=model,
            max_grad_norm=1.0,
            groups=Groups(gather=gather_group),
            sharding=Sharding(bucket_numel=256),
        )
        for step in range(3):
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        with opt.gathered_params():
            params = [p.detach().clone() for p in model.parameters()]
        opt.close()
    finally:
        comm._all_gather, comm._reduce_scatter = real_ag, real_rs
    return params, seen


def _both(rank: int, world: int) -> dict[int, tuple[bool, set[str]]]:
    second = dist.new_group(list(range(world)))
    out = {}
    for stage in (1, 2, 3):
        one, _ = _train(stage, None, rank)
        two, seen = _train(stage, second, rank)
        out[stage] = (all(torch.equal(a, b) for a, b in zip(one, two)), set(seen))
    dist.destroy_process_group(second)
    return out


@pytest.mark.slow  # spawns ranks
def test_all_gathers_go_to_the_gather_group_and_change_no_value_stages_1_to_3() -> None:
    for out in run_ranks(_both, 2):
        for stage, (same, seen) in out.items():
            assert same, f"stage {stage}: the values differ from a run on one group"
            assert seen == {"all_gather on gather_group", "reduce_scatter on process_group"}, (
                stage,
                seen,
            )


def test_a_gather_group_over_other_ranks_is_refused() -> None:
    with fake_group(0, 4):
        other = dist.new_group([0, 1])
        model = nn.Linear(4, 4)
        with pytest.raises(
            ValueError, match=r"Groups\(gather=...\) must span the ranks of Groups\(shard="
        ):
            ZeroAdamW(model.parameters(), stage=2, module=model, groups=Groups(gather=other))


def _train_mesh_groups(rank: int, world: int) -> list[int]:
    from fusedzero.app import tp_plan

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16))
    mesh = tp_plan.Mesh(dp_group=None, dp_rank=rank, dp_size=world, tp=1)
    if world == 4:  # the (dp, tp) = (2, 2) mesh `fusedzero train --tp 2` builds
        from torch.distributed.device_mesh import init_device_mesh

        dm = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        mesh = tp_plan.Mesh(
            dp_group=dm["dp"].get_group(), dp_rank=dm["dp"].get_local_rank(), dp_size=2, tp=2
        )
    group = tp_plan.gather_group(mesh)
    # ZeroAdamW checks it spans the dp group's ranks in order; a collective over it works.
    opt = ZeroAdamW(
        model.parameters(), stage=2, module=model, groups=Groups(shard=mesh.dp_group, gather=group)
    )
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=group)
    opt.close()
    return dist.get_process_group_ranks(group) + [int(t.item())]


@pytest.mark.slow  # spawns ranks
def test_train_makes_a_gather_group_per_dp_group_at_tp_1_and_2() -> None:
    assert run_ranks(_train_mesh_groups, 2) == [[0, 1, 1]] * 2
    assert run_ranks(_train_mesh_groups, 4) == [[0, 2, 2], [1, 3, 4], [0, 2, 2], [1, 3, 4]]
