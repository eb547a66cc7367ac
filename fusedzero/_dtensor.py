"""Tensor parallelism: params that are DTensors on a tensor-parallel mesh.

A model parallelized with `torch.distributed.tensor.parallel.parallelize_module` holds DTensor
params whose placements on the tp mesh are `Shard(d)` or `Replicate()`. ZeroAdamW treats each
one through its *local* tensor (`p.to_local()`): the flat buffers hold the local tensors, sharded
again over the data-parallel group, and each DTensor's local tensor becomes a view of its flat
buffer (stage 3: of the unit's gathered buffer). The model keeps its DTensor params; nothing
above this module knows a param is a DTensor except through the helpers here.

- Grads arrive as DTensors; one with a `Partial` placement (a sequence-parallel LayerNorm
  weight's) is all-reduced over tp to the param's own placement (`local_grad`) before it lands in
  a bucket, so every tp rank of a Replicate param holds the same grad, bit for bit.
- Replicate params go into flat buffers of their own (`TpInfo.replicated`): their layout is the
  same on every tp rank, so their update is too and they stay bitwise identical across tp.
- The global grad norm sums every buffer's squares over dp and tp, each Replicate param counted
  once: tp rank 0 contributes its Replicate buffers, the other tp ranks weigh them 0
  (`TpInfo.replica_weight`).

The data-parallel group (`Groups(shard=)`) and the tp mesh must be orthogonal: every dp group
holds one rank of each tp group. See docs/tensor_parallel.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from fusedzero._comm import Group
from fusedzero.kernels import GroupedSumsq, SumsqView


def is_dtensor(t: object) -> bool:
    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local tensor, any other tensor itself. (The
    attribute, not `to_local()`: no autograd node, and the very tensor the DTensor wraps.)"""
    return t._local_tensor if isinstance(t, DTensor) else t


def set_local(p: torch.Tensor, t: torch.Tensor) -> None:
    """Point param `p` at `t` (its local values): a DTensor's local tensor is replaced, any
    other param's `.data` (both keep the Python object the module and autograd hold)."""
    if isinstance(p, DTensor):
        p._local_tensor = t
    else:
        p.data = t


def local_grad(p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """`grad` as this rank's local tensor in `p`'s placements. A Partial grad (e.g. a Replicate
    LayerNorm weight under SequenceParallel) is reduced over tp here: a collective on the tp
    group, issued in autograd's grad order, which is the same on every tp rank."""
    if not isinstance(grad, DTensor):
        return grad
    assert isinstance(p, DTensor)
    if tuple(grad.placements) != tuple(p.placements):
        grad = grad.redistribute(p.device_mesh, p.placements)
    return grad._local_tensor


@dataclasses.dataclass(frozen=True, kw_only=True)
class TpInfo:
    """The tensor-parallel mesh the params live on, and where this rank sits in it."""

    mesh: DeviceMesh
    group: dist.ProcessGroup
    size: int
    rank: int
    # id(param) -> placements on the tp mesh (DTensor params only)
    placements: dict[int, tuple[Placement, ...]]

    def replicated(self, p: torch.Tensor) -> bool:
        """Identical on every tp rank: a plain param, or a DTensor replicated over tp."""
        pl = self.placements.get(id(p))
        return pl is None or all(isinstance(x, Replicate) for x in pl)

    @property
    def replica_weight(self) -> float:
        """How much this rank's Replicate buffers count in the global sum of squares: tp
        rank 0 counts them, the others hold copies (0 * inf is nan: a non-finite value there
        is still seen)."""
        return 1.0 if self.rank == 0 else 0.0


def tp_info(
    params: Iterable[torch.Tensor], names: list[str], dp_group: Group, replicate_group: Group = None
) -> TpInfo | None:
    """The tp mesh of the DTensor params (None: no DTensor params, a plain model). Checks that
    they share one 1-D mesh, hold no Partial placement, and that the mesh's group and the dp
    group (and the replicate group) are orthogonal."""
    params = list(params)
    found = [(p, n) for p, n in zip(params, names) if isinstance(p, DTensor)]
    if not found:
        return None
    mesh = found[0][0].device_mesh
    for p, n in found:
        if p.device_mesh != mesh:
            raise ValueError(
                f"param {n} is a DTensor on mesh {p.device_mesh}, param {found[0][1]} on "
                f"{mesh}: ZeroAdamW supports params on one tensor-parallel mesh; parallelize "
                "every module with the same mesh['tp']"
            )
        if p.device_mesh.ndim != 1:
            raise ValueError(
                f"param {n} is a DTensor on a {p.device_mesh.ndim}-D mesh {p.device_mesh}: "
                "parallelize the model on the 1-D tensor-parallel sub-mesh (mesh['tp']) and "
                "pass the data-parallel group as groups=Groups(shard=mesh['dp'].get_group())"
            )
        for pl in p.placements:
            # _StridedShard: a strided split of one dim (e.g. a fused qkv split by heads).
            if not isinstance(pl, (Shard, _StridedShard, Replicate)) or isinstance(pl, Partial):
                raise ValueError(
                    f"param {n} has placement {pl} on the tp mesh; params must "
                    "be Shard(d) or Replicate()"
                )
        if p.is_meta:
            raise ValueError(
                f"param {n} is a DTensor on the meta device: with tensor "
                "parallelism, materialise the model before parallelize_module"
            )
    group = mesh.get_group()
    _check_orthogonal(group, dp_group, "Groups(shard=)")
    if replicate_group is not None:
        _check_orthogonal(group, replicate_group, "Groups(replicate=)")
    return TpInfo(
        mesh=mesh,
        group=group,
        size=mesh.size(),
        rank=mesh.get_local_rank(),
        placements={id(p): tuple(p.placements) for p, _ in found},
    )


def _check_orthogonal(tp_group: dist.ProcessGroup, other: Group, what: str) -> None:
    """The tp group and a data-parallel group share exactly this rank."""
    other_ranks = set(
        dist.get_process_group_ranks(other if other is not None else dist.group.WORLD)
    )
    shared = other_ranks & set(dist.get_process_group_ranks(tp_group))
    if shared != {dist.get_rank()}:
        raise ValueError(
            f"the tp mesh's group and {what} share ranks {sorted(shared)}: {what} must be the "
            "data-parallel group, one rank of each tp group (e.g. mesh['dp'].get_group() of "
            "init_device_mesh(..., mesh_dim_names=('dp', 'tp'))), not the world"
        )


class _Buffer(Protocol):
    """What the sum of squares reads of a `fusedzero._flat.FlatBuffer`."""

    tp_replicated: bool
    layout: Any

    def grad_view(self) -> Any: ...


def grouped_sumsq(
    buffers: Sequence[_Buffer], device: torch.device, tp: TpInfo | None
) -> Callable[[], torch.Tensor]:
    """This rank's share of the global grad sum of squares, as one device scalar. A plain
    model: one grouped launch over every buffer. With tp: its tp-shard buffers in full plus its
    replicated buffers weighted by `tp.replica_weight` (counted on tp rank 0 only): two grouped
    launches."""

    def launch(bufs: Sequence[_Buffer]) -> GroupedSumsq:
        return GroupedSumsq(
            [SumsqView(b.grad_view(), b.layout.num_buckets, b.layout.shard_numel) for b in bufs],
            device,
            require_aligned=True,
        )

    if tp is None:
        return launch(buffers)
    shards = launch([b for b in buffers if not b.tp_replicated])
    reps = launch([b for b in buffers if b.tp_replicated])
    w = tp.replica_weight

    def total() -> torch.Tensor:
        return shards() + reps() * w

    return total
