"""`fusedzero plan` on the command line: the parser, the model presets and Hugging Face configs
on the meta device. The planning itself (no torch.distributed, nothing allocated) is
`fusedzero.plan`."""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fusedzero import dtypes, plan
from fusedzero.app.config import (DEFAULT_BLOCK, DEFAULT_N_EMBD, DEFAULT_N_HEAD, DEFAULT_N_LAYER,
                                  UsageError)
from fusedzero.app.model import GPT, GPTConfig
from fusedzero.layout import DEFAULT_BUCKET_NUMEL
from fusedzero.memory_modes import MASTER_MODES, STATE_MODES, MemoryModes
from fusedzero.plan import PlanConfig, plan_model, plan_params
from fusedzero.wire import WIRES


def _gpt_presets() -> dict[str, dict[str, int]]:
    gpt2 = dict(vocab_size=50257, block_size=1024)
    return {
        # `fusedzero train`'s default model (byte-level, runs on a laptop CPU)
        "train": dict(n_layer=DEFAULT_N_LAYER, n_head=DEFAULT_N_HEAD, n_embd=DEFAULT_N_EMBD,
                      block_size=DEFAULT_BLOCK),
        # GPTConfig's defaults: the model the tests train
        "tiny": {},
        # GPT-2 shapes in fusedzero.app.model.GPT (tied head, no qkv bias: a few params fewer)
        "gpt2": dict(n_layer=12, n_head=12, n_embd=768, **gpt2),
        "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, **gpt2),
        "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280, **gpt2),
        "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, **gpt2),
    }


PRESETS = ("train", "tiny", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")


# -- models on the meta device ----------------------------------------------------------------
def preset_model(name: str) -> nn.Module:
    """One of PRESETS as a fusedzero.app.model.GPT on the meta device (nothing allocated)."""
    presets = _gpt_presets()
    if name not in presets:
        raise ValueError(f"unknown preset {name!r}; choose one of {PRESETS}")
    with torch.device("meta"):
        return GPT(GPTConfig(**presets[name]))


def hf_model_from_config(path: str | Path) -> nn.Module:
    """A transformers causal LM built from a config.json (or a folder holding one) on the meta
    device: shapes only, nothing downloaded, no weights allocated."""
    try:
        import transformers
    except ImportError:
        raise ImportError("--hf-config needs the transformers package: "
                          "pip install 'fusedzero[hf]'") from None
    p = Path(path)
    f = p / "config.json" if p.is_dir() else p
    if not f.is_file():
        raise FileNotFoundError(f"{path}: no config.json there")
    d = json.loads(f.read_text())
    if "model_type" not in d:
        raise ValueError(f"{f}: no 'model_type' key; is it a Hugging Face config.json?")
    config = transformers.AutoConfig.for_model(**d)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


# -- CLI ----------------------------------------------------------------------------------------
def add_plan_subparser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="memory and communication per rank, every stage",
                              description=plan.__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", type=float, metavar="N",
                     help="parameter count, e.g. 7.5e9 (one flat buffer)")
    src.add_argument("--preset", choices=PRESETS, help="a fusedzero.app.model.GPT shape")
    src.add_argument("--hf-config", metavar="PATH",
                     help="a Hugging Face config.json or its folder (needs transformers)")
    p.add_argument("--world-size", "-W", type=int, required=True, help="ranks sharding the state")
    p.add_argument("--param-dtype", choices=sorted(dtypes.SHORT_NAMES), default="bf16",
                   help="model param dtype (default bf16; fp32: no separate master)")
    p.add_argument("--reduce-dtype", choices=sorted(dtypes.SHORT_NAMES), default="bf16",
                   help="grad reduction dtype (default bf16, the ZeRO paper's; ZeroAdamW's "
                        "own default is fp32)")
    p.add_argument("--master", choices=MASTER_MODES, default="fp32",
                   help="master weights (ZeroAdamW's master=; bf16 modes need bf16 params)")
    p.add_argument("--states", choices=STATE_MODES, default="fp32",
                   help="exp_avg / exp_avg_sq storage (ZeroAdamW's states=)")
    p.add_argument("--wire", choices=(*WIRES, "all"), default=None,
                   help="what grads cross the network as (ZeroAdamW's wire=), summed in fp32; "
                        "all: the main table native, plus comm/step of every stage by wire")
    p.add_argument("--param-wire", choices=WIRES, default=None,
                   help="what the param all-gathers send (ZeroAdamW's param_wire=)")
    p.add_argument("--bucket-numel", type=int, default=DEFAULT_BUCKET_NUMEL,
                   help="elements per bucket (default %(default)s)")
    p.add_argument("--no-reshard-after-forward", dest="reshard", action="store_false",
                   help="stage 3 keeps units gathered from forward to backward (2 Psi comm)")
    p.add_argument("--one-group", action="store_true",
                   help="one param group (default: decay / no-decay groups, as `train`)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.set_defaults(func=_cli_plan)
    return p


def _cli_plan(args: argparse.Namespace) -> int:
    try:
        cfg = PlanConfig(world_size=args.world_size,
                         param_dtype=dtypes.SHORT_NAMES[args.param_dtype],
                         reduce_dtype=dtypes.SHORT_NAMES[args.reduce_dtype],
                         bucket_numel=args.bucket_numel,
                         reshard_after_forward=args.reshard,
                         modes=MemoryModes(args.master, args.states),
                         wire=None if args.wire == "all" else args.wire,
                         param_wire=args.param_wire)
        by_wire = args.wire == "all"
        if args.params is not None:
            if not (math.isfinite(args.params) and args.params == int(args.params)):
                raise ValueError(f"--params must be a whole number, got {args.params}")
            result = plan_params(int(args.params), cfg, by_wire=by_wire)
        elif args.preset is not None:
            result = plan_model(preset_model(args.preset), cfg, decay_split=not args.one_group,
                              source=f"preset {args.preset}", by_wire=by_wire)
        else:
            result = plan_model(hf_model_from_config(args.hf_config), cfg,
                              decay_split=not args.one_group, source=str(args.hf_config),
                              by_wire=by_wire)
    except (ValueError, ImportError, OSError) as e:
        raise UsageError(str(e)) from None
    print(json.dumps(result.to_json(), indent=1) if args.json else result.table())
    return 0
