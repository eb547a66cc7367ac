"""The ZeRO stage, and what each one shards. Code asks these properties, never `stage ==`."""
from __future__ import annotations

import enum


class Stage(enum.IntEnum):
    DP = 0  # plain data parallelism: everything replicated, grads all-reduced
    OPTIMIZER = 1  # optimizer state sharded; full grads reduce-scattered in place
    GRADIENTS = 2  # grads sharded too: a bucket lives only while it is reduced
    PARAMETERS = 3  # params sharded per unit as well (fusedzero.zero3)

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
