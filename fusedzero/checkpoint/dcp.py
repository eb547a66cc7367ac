"""Move in from FSDP2: a `torch.distributed.checkpoint` folder -> a fusedzero checkpoint.

    fusedzero ckpt import-dcp DCP_DIR OUT          # then: checkpoint.load(opt, OUT), any W/stage

The DCP folder is what FSDP2 (`fully_shard`) + `torch.optim.AdamW` write with the distributed
state-dict API (the usual torchtitan / recipe layout):

    model_sd, optim_sd = torch.distributed.checkpoint.state_dict.get_state_dict(model, optim)
    torch.distributed.checkpoint.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=DIR)

Parameters and optimizer state are keyed by the model's parameter names, so the converter needs
no model class: it builds a stand-in module with those names and shapes, puts the params into a
one-rank `ZeroAdamW` as its fp32 master, the AdamW moments into exp_avg / exp_avg_sq and the step
into its step count, and writes it with `fusedzero.checkpoint.save`. Our checkpoints reshard on
load, so the run resumes at any world size and stage with its moments and step intact. The param
groups (their params and lr / betas / eps / weight_decay) are kept: build the resuming ZeroAdamW
with the same groups and `checkpoint.load` restores the hyper-parameters too.

Offline, one process, no process group. Memory: the whole model's params and two moments in
fp32 (DCP's `dcp_to_torch_save` consolidates them), plus the optimizer's copy.
"""
from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fusedzero.checkpoint.catalog import read_manifest
from fusedzero.checkpoint.saving import save
from fusedzero.state import ShardState

# The AdamW hyper-parameters ZeroAdamW has; other keys of torch's param groups (foreach, fused,
# capturable, differentiable, initial_lr) only choose torch's implementation.
HYPER = ("lr", "betas", "eps", "weight_decay", "maximize")


def read_dcp(dcp_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The full (unsharded) state dict of a DCP folder, in this process (no process group)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    d = Path(dcp_dir)
    if not (d / ".metadata").is_file():
        raise ValueError(f"{d}: no .metadata file; not a torch.distributed.checkpoint folder")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "full.pt"
        dcp_to_torch_save(d, out)
        return torch.load(out, map_location="cpu", weights_only=True)


def _standin(shapes: dict[str, tuple[int, ...]]) -> nn.Module:
    """A module whose named_parameters() are exactly `shapes` (dotted names make submodules)."""
    root = nn.Module()
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, nn.Parameter(torch.zeros(shape, dtype=torch.float32)))
    return root


def _full(t: Any) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def import_dcp(dcp_dir: str | os.PathLike[str], out: str | os.PathLike[str], *,
               model_key: str = "model", optim_key: str = "optim") -> Path:
    """Convert an FSDP2 + torch.optim.AdamW DCP folder into a fusedzero checkpoint at `out`
    (a checkpoint root: `out/step-N` and `out/latest`, N the AdamW step). Returns the step folder.

    Raises ValueError naming what does not fit: a missing key, amsgrad, params whose AdamW steps
    differ, optimizer state for a name the model state lacks, shapes that disagree."""
    from fusedzero.optim import ZeroAdamW

    sd = read_dcp(dcp_dir)
    for k in (model_key, optim_key):
        if k not in sd:
            raise ValueError(f"{dcp_dir}: no {k!r} entry (found {sorted(sd)}); save "
                             f"{{'{model_key}': model_sd, '{optim_key}': optim_sd}} from "
                             "get_state_dict(model, optim), or pass model_key/optim_key")
    model_sd = {k: _full(v) for k, v in sd[model_key].items()}
    osd = sd[optim_key]
    groups, state = osd["param_groups"], osd["state"]
    names = [n for g in groups for n in g["params"]]
    missing = [n for n in names if n not in model_sd]
    if missing:
        raise ValueError(f"{dcp_dir}: the optimizer has params the model state lacks: {missing} "
                         "(was optim_sd made by get_state_dict, which keys state by name?)")
    for g in groups:
        if g.get("amsgrad"):
            raise ValueError(f"{dcp_dir}: a param group has amsgrad=True; ZeroAdamW has no "
                             "amsgrad: the max of exp_avg_sq would be lost")
    steps = {float(_full(state[n]["step"])) for n in names if n in state}
    if len(steps) > 1:
        raise ValueError(f"{dcp_dir}: AdamW steps differ between params ({sorted(steps)}); "
                         "ZeroAdamW keeps one step count")
    step = steps.pop() if steps else 0.0

    module = _standin({n: tuple(model_sd[n].shape) for n in names})
    params = dict(module.named_parameters())
    opt_groups = [{"params": [params[n] for n in g["params"]],
                   **{k: (tuple(g[k]) if k == "betas" else g[k]) for k in HYPER if k in g}}
                  for g in groups]
    # One rank, stage 1: its local shard is every param; checkpoint.save writes the manifest.
    opt = ZeroAdamW(opt_groups, stage=1, module=module, process_group=None)
    if opt.world_size != 1:
        raise RuntimeError("import_dcp runs offline: call it with no process group initialised")
    index = {n: i for i, n in enumerate(names)}
    full = ShardState(master=[], exp_avg=[], exp_avg_sq=[], step_count=step)
    with torch.no_grad():
        for info in opt.shard_infos():
            # A param AdamW never stepped has no state: its moments stay zero, as torch's.
            master, exp_avg, exp_avg_sq = (torch.zeros(info.local_numel, dtype=torch.float32)
                                           for _ in range(3))
            for s in info.segments():
                n = names[s.param]
                assert index[n] == s.param
                ranges = [(master, model_sd[n])]
                if n in state:
                    ranges += [(exp_avg, _full(state[n]["exp_avg"])),
                               (exp_avg_sq, _full(state[n]["exp_avg_sq"]))]
                for dst, src in ranges:
                    if math.prod(src.shape) != math.prod(model_sd[n].shape):
                        raise ValueError(f"{dcp_dir}: {n} has {src.numel()} optimizer elements "
                                         f"for {model_sd[n].numel()} params")
                    dst[s.local:s.local + s.length].copy_(
                        src.detach().reshape(-1)[s.start:s.start + s.length].float())
            for bufs, t in zip((full.master, full.exp_avg, full.exp_avg_sq),
                               (master, exp_avg, exp_avg_sq)):
                assert bufs is not None
                bufs.append(t)
    opt.load_shard_state(full)
    return save(opt, out, step=int(step)).wait()


def run_import_dcp(args: argparse.Namespace) -> int:
    """`fusedzero ckpt import-dcp DCP_DIR OUT`."""
    d = import_dcp(args.dcp_dir, args.out)
    print(f"wrote {d} (step {read_manifest(d)['step']}); resume with "
          "fusedzero.checkpoint.load(opt, OUT) at any world size and stage")
    return 0
