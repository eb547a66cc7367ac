"""Checkpoints and tensor parallelism: what a checkpoint of DTensor params would need.

A checkpoint records one flat layout per rank of the optimizer's (dp) process group. With
tensor-parallel params every tp rank of a dp group holds different local shards under the same
dp ranks, so the files would collide and the manifest could not say which tp shard a file
holds, nor reshard along tp. Until the manifest records the mesh and each param's placement,
save, load and import refuse such an optimizer up front, on every rank alike (before any
collective), instead of writing a checkpoint that cannot be read back.
"""
from __future__ import annotations

from typing import Any


def refuse_tensor_parallel(opt: Any, what: str) -> None:
    """Raise NotImplementedError if `opt` holds DTensor params (its `tp` is set)."""
    tp = getattr(opt, "tp", None)
    if tp is not None:
        raise NotImplementedError(
            f"checkpoint.{what}: this ZeroAdamW holds tensor-parallel DTensor params (tp mesh "
            f"of {tp.size} ranks); sharded checkpoints do not record tp placements yet. Save "
            "the model's full weights instead, e.g. {n: p.full_tensor() for n, p in "
            "model.state_dict().items()} on one rank (see docs/tensor_parallel.md)")
