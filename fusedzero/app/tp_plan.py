"""`fusedzero train --tp N`: the GPT's tensor-parallel plan and the (dp, tp) mesh.

The usual Megatron plan, written with `torch.distributed.tensor.parallel`:
- attention: the fused q/k/v in-projection column-wise, each tp rank holding whole heads
  (`HeadwiseQkv`); the out-projection row-wise (output all-reduced, replicated);
- MLP: fc column-wise, proj row-wise;
- LayerNorms, the token and position embeddings and the tied head stay plain params,
  replicated over tp (the activations they see and the grads they get are the same on every
  tp rank, so ZeroAdamW counts them once in the grad norm and keeps them identical).

Ranks are laid out dp-major: rank = dp_rank * tp + tp_rank, so a tp group is `tp` consecutive
ranks (on GPUs: one node's NVLink). The tp ranks of one dp replica read the same batches.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fusedzero._comm import Group


class _Styles:
    """The parallel styles, imported on first use (torch.distributed.tensor.parallel)."""

    @staticmethod
    def headwise_qkv() -> Any:
        from torch.distributed.tensor import distribute_tensor
        from torch.distributed.tensor.parallel import ColwiseParallel
        from torch.distributed.tensor.placement_types import _StridedShard

        class HeadwiseQkv(ColwiseParallel):
            """Column-wise over the fused [q; k; v] rows, strided so that tp rank r holds
            [q_r; k_r; v_r] (its heads of each): its local output splits into local q, k, v
            and attention runs on local heads with no communication. The DTensor's full value
            is the weight as the unparallelized model holds it."""

            def _partition_linear_fn(self, name: str, module: nn.Module, mesh: Any) -> None:
                for n, p in module.named_parameters():
                    module.register_parameter(
                        n,
                        nn.Parameter(
                            distribute_tensor(p, mesh, [_StridedShard(0, split_factor=3)]),
                            requires_grad=p.requires_grad,
                        ),
                    )

            @staticmethod
            def _prepare_output_fn(
                output_layouts: Any,
                use_local_output: bool,
                mod: Any,
                outputs: Any,
                device_mesh: Any,
            ) -> Any:
                return outputs.to_local()  # [q_r, k_r, v_r]: no redistribution

        return HeadwiseQkv()


def gpt_plan(model: nn.Module) -> dict[str, Any]:
    """The plan of `fusedzero.app.model.GPT` for `parallelize_module`."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for i in range(len(model.blocks)):
        b = f"blocks.{i}"
        plan[f"{b}.attn.qkv"] = _Styles.headwise_qkv()
        plan[f"{b}.attn.proj"] = RowwiseParallel()
        plan[f"{b}.mlp.fc"] = ColwiseParallel()
        plan[f"{b}.mlp.proj"] = RowwiseParallel()
    return plan


def check_tp(tp: int, n_head: int, n_embd: int) -> str | None:
    """Why the GPT cannot be split over `tp` ranks (None: it can)."""
    if tp < 1:
        return f"--tp must be >= 1, got {tp}"
    if n_head % tp:
        return f"--tp {tp} must divide --n-head {n_head} (each tp rank holds whole heads)"
    if (4 * n_embd) % tp:
        return f"--tp {tp} must divide the MLP width 4 * --n-embd = {4 * n_embd}"
    return None


def local_shape(name: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """A GPT param's local shape on one tp rank under `gpt_plan` (what ZeroAdamW's flat buffers
    hold): column-wise weights and biases split on dim 0, row-wise weights on dim 1."""
    if tp == 1:
        return shape
    if name.endswith(("attn.qkv.weight", "mlp.fc.weight", "mlp.fc.bias")):
        return (shape[0] // tp,) + shape[1:]
    if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
        return (shape[0], shape[1] // tp)
    return shape


@dataclasses.dataclass(frozen=True, kw_only=True)
class Mesh:
    """Where this rank sits: the data-parallel group ZeroAdamW shards over, this rank's place
    in it (which batches it reads), and the tp size."""

    dp_group: Group
    dp_rank: int
    dp_size: int
    tp: int


def parallelize(model: nn.Module, tp: int, device: torch.device) -> Mesh:
    """With tp > 1: build the (dp, tp) mesh over the world and parallelize `model` in place.
    tp == 1: the world is the dp group, the model is left as it is."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if tp == 1:
        return Mesh(dp_group=None, dp_rank=rank, dp_size=world, tp=1)
    if world % tp:
        raise ValueError(f"--tp {tp} must divide the number of ranks {world}")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], gpt_plan(model))
    return Mesh(
        dp_group=mesh["dp"].get_group(),
        dp_rank=mesh["dp"].get_local_rank(),
        dp_size=world // tp,
        tp=tp,
    )


def gather_group(mesh: Mesh) -> Group:
    """A second group over this rank's dp group, for ZeroAdamW's param all-gathers
    (`Groups(gather=)`); None where the dp group is one rank. `new_group` is collective over the
    world: every rank makes every dp group's, in the same order, and keeps its own. The dp
    groups of the (dp, tp) mesh are its columns: ranks j, tp + j, 2 tp + j, ..."""
    if mesh.dp_size == 1:
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    mine: Group = None
    for j in range(mesh.tp):
        ranks = list(range(j, world, mesh.tp))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def local_groups(
    model: nn.Module, tp: int, decay_split: bool = True
) -> list[list[tuple[str, nn.Parameter]]]:
    """`fusedzero plan --tp`: the GPT (on the meta device) with every param replaced by one tp
    rank's local shard, in the param groups ZeroAdamW would get, each split into its tp-sharded
    and its replicated params (ZeroAdamW keeps them in separate flat buffers). The model is
    changed in place (stage-3 units are read from it)."""
    local: dict[str, nn.Parameter] = {}
    for name, p in list(model.named_parameters()):
        shape = local_shape(name, tuple(p.shape), tp)
        if shape != tuple(p.shape):
            mod_name, _, leaf = name.rpartition(".")
            q = nn.Parameter(torch.empty(shape, dtype=p.dtype, device="meta"))
            setattr(model.get_submodule(mod_name), leaf, q)
            local[name] = q
    named = list(model.named_parameters())
    groups = (
        [[(n, p) for n, p in named if p.dim() >= 2], [(n, p) for n, p in named if p.dim() < 2]]
        if decay_split
        else [named]
    )
    return [
        [(n, p) for n, p in g if (n in local) == sharded]
        for g in groups
        for sharded in (True, False)
    ]
