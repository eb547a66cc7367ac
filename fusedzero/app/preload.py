"""Constants the `fusedzero` entry point and the train launcher share, in a module that imports
nothing (the entry point reads them before torch is imported)."""

# What the fork server of `fusedzero train` imports once for all its CPU ranks.
RANK_PRELOAD = ["fusedzero.app.loop", "torch._dynamo"]
# Present under torchrun: `fusedzero train` then joins its group and starts no ranks.
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
