"""Sharded safetensors checkpoints: atomic, verified, reshardable, exportable (docs/checkpoints.md).

    h = checkpoint.save(opt, "ckpt", step=step, caller_state={"sched": sched.state_dict()},
                        keep_last=3, async_=True)      # collective; h.wait() when you must know
    got = checkpoint.load(opt, "ckpt")                 # collective; any world size or stage
    sched.load_state_dict(got.caller_state["sched"])
    checkpoint.export("ckpt", "model.safetensors", dtype=torch.bfloat16)   # offline
    checkpoint.import_weights(opt, "model.safetensors")                    # collective

The package, bottom up (each module imports only those above it):

    _manifest.py    the manifest's schema, validated before use; CheckpointError
    _format.py      the on-disk format (described there), file names, the safetensors writer,
                    slice readers, exclusive temporaries, fsync, sha256
    _collectives.py gather to the first rank; agree on success across ranks
    _rank_state.py  each rank's caller and RNG state, packed and safely unpacked
    _optview.py     the optimizer as a checkpoint sees it (fusedzero/state.py + public attributes)
    _shardfile.py   one shard read through one descriptor: header, sha256 and slices together
    _catalog.py     find (`latest` decides), read and verify checkpoints on disk
    _saving.py      save (sync and async), rotation
    _reshard.py     which saved slices fill which new local shard
    _loading.py     load: plan, read into staging, agree, commit
    _weights.py     export to one model's safetensors; import full weights
    dcp.py, hf.py   converters: FSDP2 / torch.distributed.checkpoint in; Hugging Face out

The optimizer is reached only through `opt.shard_infos()`, `opt.param_infos()`,
`opt.shard_state()` and `opt.load_shard_state()` (fusedzero/state.py) and public attributes.
"""

from fusedzero.checkpoint._catalog import (
    Latest,
    find_latest,
    inspect,
    list_checkpoints,
    problems,
    read_manifest,
    resolve,
    save_root,
    verify,
)
from fusedzero.checkpoint._format import (
    KINDS,
    LATEST,
    MANIFEST,
    SafetensorsWriter,
    shard_file_name,
    step_dir_name,
)
from fusedzero.checkpoint._loading import Loaded, load
from fusedzero.checkpoint._manifest import CheckpointError
from fusedzero.checkpoint._saving import SaveHandle, save, wait_pending
from fusedzero.checkpoint._tp_export import export, export_tp  # export: plain and tp roots
from fusedzero.checkpoint._weights import Exported, import_weights

__all__ = [
    "KINDS",
    "LATEST",
    "MANIFEST",
    "CheckpointError",
    "Exported",
    "Latest",
    "Loaded",
    "SafetensorsWriter",
    "SaveHandle",
    "export",
    "export_tp",
    "find_latest",
    "import_weights",
    "inspect",
    "list_checkpoints",
    "load",
    "problems",
    "read_manifest",
    "resolve",
    "save",
    "save_root",
    "shard_file_name",
    "step_dir_name",
    "verify",
    "wait_pending",
]
