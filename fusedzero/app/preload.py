"""Constants the `fusedzero` entry point and the train launcher share, in a module that imports
only the standard library (the entry point reads them before torch is imported)."""

import os

# What the fork server of `fusedzero train` imports once for all its CPU ranks.
RANK_PRELOAD = ["fusedzero.app.loop", "torch._dynamo"]
# Present under torchrun: `fusedzero train` then joins its group and starts no ranks.
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def under_torchrun() -> bool:
    """Whether this process is a rank torchrun started (its variables are set)."""
    return all(k in os.environ for k in TORCHRUN_ENV)
