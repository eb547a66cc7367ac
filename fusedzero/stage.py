"""The ZeRO stage, and what each one shards. Code asks these properties, never `stage ==`."""

from __future__ import annotations

import enum

__all__ = ["Stage"]


class Stage(enum.IntEnum):
    DP = 0  # plain data parallelism: everything replicated, grads all-reduced
    OPTIMIZER = 1  # optimizer state sharded; full grads reduce-scattered in place
    GRADIENTS = 2  # grads sharded too: a bucket lives only while it is reduced
    PARAMETERS = 3  # params sharded per unit as well (fusedzero._zero3)

    @property
    def shards_state(self) -> bool:
        """Master and moments are split over the group (stage 0 keeps a full copy)."""
        return self is not Stage.DP

    @property
    def keeps_full_grads(self) -> bool:
        """A full-size grad buffer per flat buffer (stages 0-1), else only the grad shard."""
        return self <= Stage.OPTIMIZER

    @property
    def shards_params(self) -> bool:
        return self is Stage.PARAMETERS

    @property
    def gathers_after_step(self) -> bool:
        """Updated params are all-gathered into the full param buffer after each step."""
        return self in (Stage.OPTIMIZER, Stage.GRADIENTS)

    def gathers_per_step(self, reshard_after_forward: bool, unit: int) -> int:
        """All-gathers of each param bucket per training step: none at stage 0; one at stages
        1-2 (after the update); at stage 3 one in forward and, where units are resharded after
        forward, one more in backward, except for the root unit (0): it stays gathered from
        its forward into its backward, which comes first (fusedzero/_zero3.py)."""
        if not self.shards_state:
            return 0
        return 2 if self.shards_params and reshard_after_forward and unit != 0 else 1
