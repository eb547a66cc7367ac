"""`fusedzero plan` on the command line: the parser, the model presets and Hugging Face configs
on the meta device. The planning itself (no torch.distributed, nothing allocated) is
`fusedzero.plan`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fusedzero import _dtypes as dtypes, plan
from fusedzero._safe_paths import read_json
from fusedzero.app import tp_plan
from fusedzero.app.config import (
    DEFAULT_BLOCK,
    DEFAULT_N_EMBD,
    DEFAULT_N_HEAD,
    DEFAULT_N_LAYER,
    UsageError,
)
from fusedzero.app.model import GPT, GPTConfig
from fusedzero.emulate import SHAPES, Emulation, emulate, meta_model
from fusedzero.memory_modes import MASTER_MODES, STATE_MODES
from fusedzero.plan import (
    STAGES,
    LinkModel,
    PlanConfig,
    plan_model,
    plan_muon_model,
    plan_params,
)
from fusedzero.policy import Precision, Sharding, Wire
from fusedzero.wire import WIRES


def _gpt_presets() -> dict[str, dict[str, int]]:
    gpt2 = dict(vocab_size=50257, block_size=1024)
    return {
        # `fusedzero train`'s default model (byte-level, runs on a laptop CPU)
        "train": dict(
            n_layer=DEFAULT_N_LAYER,
            n_head=DEFAULT_N_HEAD,
            n_embd=DEFAULT_N_EMBD,
            block_size=DEFAULT_BLOCK,
        ),
        # GPTConfig's defaults: the model the tests train
        "tiny": {},
        # GPT-2 shapes in fusedzero.app.model.GPT (tied head, no qkv bias: a few params fewer)
        "gpt2": dict(n_layer=12, n_head=12, n_embd=768, **gpt2),
        "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, **gpt2),
        "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280, **gpt2),
        "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, **gpt2),
    }


PRESETS = ("train", "tiny", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
# --params's largest value: one flat fp32 buffer of it is 4e18 bytes, within the int64 byte
# counts of torch's storage (9.2e18); 1e30 failed inside torch with C++ frames in the message.
PARAMS_MAX = 10**18
# A Hugging Face config.json is kilobytes (megabytes with a large label map): a bigger file is
# not one, and is refused before it is read into memory.
HF_CONFIG_MAX_BYTES = 64 << 20


# -- models on the meta device ----------------------------------------------------------------
def preset_model(name: str) -> nn.Module:
    """One of PRESETS as a fusedzero.app.model.GPT on the meta device (nothing allocated)."""
    presets = _gpt_presets()
    if name not in presets:
        raise ValueError(f"unknown preset {name!r}; choose one of {PRESETS}")
    with torch.device("meta"):
        return GPT(GPTConfig(**presets[name]))


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """`--hf-config`: a config.json, or the folder holding one, as a dict that names its
    `model_type`. A FIFO or a device there is refused, not read (See [Note: no read from a
    FIFO or device]); so is a file over HF_CONFIG_MAX_BYTES."""
    p = Path(path)
    f = p / "config.json" if p.is_dir() else p
    if not f.exists():
        raise FileNotFoundError(f"{path}: no config.json there")
    d = read_json(f, "--hf-config", HF_CONFIG_MAX_BYTES)
    if not isinstance(d, dict) or "model_type" not in d:
        raise ValueError(f"{f}: no 'model_type' key; is it a Hugging Face config.json?")
    return d


def hf_model_from_config(path: str | Path) -> nn.Module:
    """A transformers causal LM built from a config.json (or a folder holding one) on the meta
    device: shapes only, nothing downloaded, no weights allocated."""
    d = read_hf_config(path)  # a bad path fails before the seconds of this import
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "--hf-config needs the transformers package: pip install 'fusedzero[hf]'"
        ) from None
    config = transformers.AutoConfig.for_model(**d)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


# -- CLI ----------------------------------------------------------------------------------------
def add_plan_subparser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan",
        help="memory and communication per rank, every stage",
        description=plan.__doc__.split("\n\n")[0],
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--params", type=float, metavar="N", help="parameter count, e.g. 7.5e9 (one flat buffer)"
    )
    src.add_argument("--preset", choices=PRESETS, help="a fusedzero.app.model.GPT shape")
    src.add_argument(
        "--hf-config",
        metavar="PATH",
        help="a Hugging Face config.json or its folder (needs transformers)",
    )
    src.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        help="a Llama-shaped model of plain nn modules (fusedzero.emulate)",
    )
    p.add_argument("--world-size", "-W", type=int, required=True, help="ranks sharding the state")
    p.add_argument(
        "--param-dtype",
        choices=sorted(dtypes.SHORT_NAMES),
        default="bf16",
        help="model param dtype (default bf16; fp32: no separate master)",
    )
    p.add_argument(
        "--reduce-dtype",
        choices=sorted(dtypes.SHORT_NAMES),
        default="bf16",
        help="grad reduction dtype (default bf16, the ZeRO paper's; ZeroAdamW's "
        "own default is fp32)",
    )
    p.add_argument(
        "--master",
        choices=MASTER_MODES,
        default="fp32",
        help="master weights (Precision(master=); bf16 modes need bf16 params)",
    )
    p.add_argument(
        "--states",
        choices=STATE_MODES,
        default="fp32",
        help="the update rule's state storage (Precision(states=))",
    )
    p.add_argument(
        "--wire",
        choices=(*WIRES, "all"),
        default=None,
        help="what grads cross the network as (Wire(grads=)), summed in fp32; "
        "all: the main table native, plus comm/step of every stage by wire",
    )
    p.add_argument(
        "--param-wire",
        choices=WIRES,
        default=None,
        help="what the param all-gathers send (Wire(params=))",
    )
    p.add_argument(
        "--bucket-numel",
        type=int,
        default=None,
        help="elements per bucket, all ranks together (default: chosen per rank, "
        "as ZeroAdamW's; see docs/scale.md)",
    )
    p.add_argument(
        "--no-reshard-after-forward",
        dest="reshard",
        action="store_false",
        help="stage 3 keeps units gathered from forward to backward (2 Psi comm)",
    )
    p.add_argument(
        "--one-group",
        action="store_true",
        help="one param group (default: decay / no-decay groups, as `train`)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="--preset only: tensor-parallel ranks per replica (fusedzero train's "
        "plan); -W is then the data-parallel size, nproc = W * N",
    )
    p.add_argument(
        "--optimizer",
        choices=("adamw", "muon"),
        default="adamw",
        help="muon: ZeroMuon with `fusedzero train --optimizer muon`'s groups (the Muon "
        "groups keep a momentum buffer, in the owner layout at stages 1-3), plus those buffers' "
        "Newton-Schulz FLOPs per rank and padding at -W (default %(default)s)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    m = p.add_argument_group("communication time (an alpha-beta ring model, see docs/scale.md)")
    m.add_argument(
        "--link-gbps",
        type=float,
        default=LinkModel().bandwidth / 1e9,
        metavar="GB/s",
        help="bytes per second one rank's link sends, in GB/s (default %(default)g)",
    )
    m.add_argument(
        "--link-latency-us",
        type=float,
        default=LinkModel().latency * 1e6,
        metavar="US",
        help="latency of one ring step in microseconds (default %(default)g)",
    )
    e = p.add_argument_group("emulation (a real ZeroAdamW as one rank, fake process group)")
    e.add_argument(
        "--emulate",
        action="store_true",
        help="also build the optimizer as --rank of W (model on the meta device, "
        "stage 3: only the local shard in memory) and compare with the plan",
    )
    e.add_argument("--rank", type=int, default=0, help="the emulated rank (default 0)")
    e.add_argument(
        "--stage", type=int, choices=STAGES, default=3, help="the emulated stage (default 3)"
    )
    e.add_argument(
        "--meta",
        action="store_true",
        help="build everything on the meta device (stages 0-2 always are)",
    )
    p.set_defaults(func=_cli_plan)
    return p


def _cli_plan(args: argparse.Namespace) -> int:
    try:
        if args.emulate and args.tp > 1:
            raise ValueError(
                "--emulate builds a data-parallel ZeroAdamW only, not a tensor-"
                f"parallel one: drop --tp {args.tp} or --emulate"
            )
        if args.optimizer == "muon":
            _check_muon_args(args)
        link = LinkModel(bandwidth=args.link_gbps * 1e9, latency=args.link_latency_us * 1e-6)
        cfg = PlanConfig(
            world_size=args.world_size,
            tp=args.tp,
            precision=Precision(
                param_dtype=dtypes.SHORT_NAMES[args.param_dtype],
                reduce_dtype=dtypes.SHORT_NAMES[args.reduce_dtype],
                master=args.master,
                states=args.states,
            ),
            wire=Wire(grads=None if args.wire == "all" else args.wire, params=args.param_wire),
            sharding=Sharding(bucket_numel=args.bucket_numel, reshard_after_forward=args.reshard),
        )
        by_wire = args.wire == "all"
        if args.optimizer == "muon":
            result = plan_muon_model(_meta_model(args), cfg, source=_source(args), by_wire=by_wire)
        elif args.tp > 1:
            result = _plan_tp(args, cfg)
        elif args.params is not None:
            if not (math.isfinite(args.params) and args.params == int(args.params)):
                raise ValueError(f"--params must be a whole number, got {args.params}")
            if args.params > PARAMS_MAX:
                raise ValueError(
                    f"--params must be at most {PARAMS_MAX:.0e} (its bytes must "
                    f"fit the int64 sizes torch counts in), got {args.params:g}"
                )
            result = plan_params(int(args.params), cfg, by_wire=by_wire)
        elif args.preset is not None:
            result = plan_model(
                preset_model(args.preset),
                cfg,
                decay_split=not args.one_group,
                source=f"preset {args.preset}",
                by_wire=by_wire,
            )
        elif args.shape is not None:
            result = plan_model(
                meta_model(args.shape),
                cfg,
                decay_split=not args.one_group,
                source=f"shape {args.shape}",
                by_wire=by_wire,
            )
        else:
            result = plan_model(
                hf_model_from_config(args.hf_config),
                cfg,
                decay_split=not args.one_group,
                source=str(args.hf_config),
                by_wire=by_wire,
            )
        emulated = _emulate(args, result) if args.emulate else None
    except (ValueError, ImportError, OSError) as e:
        raise UsageError(str(e)) from None
    seconds = result.comm_seconds(link)
    if args.json:
        d = result.to_json()
        d["comm_model"] = {
            "model": "alpha-beta ring",
            "link_bytes_per_s": link.bandwidth,
            "latency_s": link.latency,
            "seconds_per_step": {str(k): v for k, v in seconds.items()},
        }
        if emulated is not None:
            d["emulation"] = dataclasses.asdict(emulated)
        print(json.dumps(d, indent=1))
        return 0
    print(result.table())
    print(
        f"\ncomm time/step, an alpha-beta ring model (not a measurement; docs/scale.md): "
        f"link {link.bandwidth / 1e9:g} GB/s, {link.latency * 1e6:g} us per ring step, "
        "no overlap with compute"
    )
    print("  " + "   ".join(f"stage {k}: {_seconds(v)}" for k, v in seconds.items()))
    if emulated is not None:
        print(_emulation_lines(emulated))
    return 0


def _check_muon_args(args: argparse.Namespace) -> None:
    for bad, why in (
        (
            args.params is not None,
            "--params: Muon needs the model's shapes; use --preset, --shape or --hf-config",
        ),
        (args.tp > 1, f"--tp {args.tp}: Newton-Schulz needs each matrix whole; use --tp 1"),
        (args.emulate, "--emulate: the emulation builds a ZeroAdamW; drop --emulate"),
        (
            args.one_group,
            "--one-group: Muon's groups are fixed (Muon, AdamW decayed, AdamW "
            "not); drop --one-group",
        ),
    ):
        if bad:
            raise ValueError(f"--optimizer muon with {why}")


def _meta_model(args: argparse.Namespace) -> nn.Module:
    if args.preset is not None:
        return preset_model(args.preset)
    if args.shape is not None:
        return meta_model(args.shape)
    return hf_model_from_config(args.hf_config)


def _source(args: argparse.Namespace) -> str:
    if args.preset is not None:
        return f"preset {args.preset}"
    if args.shape is not None:
        return f"shape {args.shape}"
    return str(args.hf_config)


def _plan_tp(args: argparse.Namespace, cfg: PlanConfig) -> plan.Plan:
    """A GPT preset split over --tp ranks as `fusedzero train --tp` splits it."""
    if args.preset is None:
        raise ValueError(
            "--tp needs --preset: the tensor-parallel plan is the GPT's (fusedzero/app/tp_plan.py)"
        )
    model = preset_model(args.preset)
    why = tp_plan.check_tp(args.tp, model.config.n_head, model.config.n_embd)
    if why is not None:
        raise ValueError(why.replace("--n-head", "n_head").replace("--n-embd", "n_embd"))
    groups = tp_plan.local_groups(model, args.tp, decay_split=not args.one_group)
    return plan.plan_groups(
        groups, cfg, model=model, source=f"preset {args.preset}, tp={args.tp} (one tp rank)"
    )


def _model_source(args: argparse.Namespace) -> Any:
    """What `fusedzero.emulate.emulate` builds: a shape name or a meta-model factory."""
    if args.shape is not None:
        return args.shape
    if args.preset is not None:
        return lambda: preset_model(args.preset)
    if args.hf_config is not None:
        return lambda: hf_model_from_config(args.hf_config)

    def params() -> nn.Module:
        m = nn.Module()
        m.params = nn.Parameter(torch.empty(int(args.params), device="meta"))
        return m

    return params


def _emulate(args: argparse.Namespace, printed: plan.Plan) -> Emulation:
    """The emulated rank, compared with `printed`: the plan the table shows."""
    if not 0 <= args.rank < args.world_size:
        raise ValueError(f"--rank must be in [0, {args.world_size}), got {args.rank}")
    cfg = printed.config
    return emulate(
        _model_source(args),
        world_size=args.world_size,
        rank=args.rank,
        stage=args.stage,
        precision=cfg.precision,
        wire=cfg.wire,
        sharding=cfg.sharding,
        decay_split=not args.one_group,
        materialize=args.stage == 3 and not args.meta,
        plan=printed,
    )


def _emulation_lines(e: Emulation) -> str:
    where = "local shard in CPU memory" if e.materialized else "meta device, nothing allocated"
    return "\n".join(
        [
            f"\nemulated: ZeroAdamW as rank {e.rank} of {e.world_size}, stage {e.stage} "
            f"(fake process group; {where})",
            f"  resident bytes {e.resident_bytes:,} (params {e.params_bytes:,}, grads "
            f"{e.grads_bytes:,}, optimizer {e.optimizer_bytes:,}); plan {e.plan_bytes:,}",
            f"  comm bytes/step {e.comm_bytes_per_step:,}; plan {e.plan_comm_bytes:,}"
            f"  -> {'equal to the plan' if e.equals_plan else 'DIFFERENT from the plan'}",
            f"  padding {e.padding_elements:,} elements ({100 * e.padding_fraction:.4f}% of Psi)",
            f"  construction {e.construct_s:.2f} s, RSS +{e.rss_delta_bytes / 1e9:.3g} GB",
        ]
    )


def _seconds(v: float) -> str:
    """A time in the unit that keeps it readable: 253 us, 4.1 ms, 2.35 s."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3)):
        if v >= scale:
            return f"{v / scale:.3g} {unit}"
    return f"{v / 1e-6:.3g} us"
