"""Hand a checkpoint to Hugging Face transformers, and take HF weights back.

    fusedzero ckpt export CKPT OUT_DIR --hf-config config.json [--dtype bf16] [--max-shard-size 5GB]
    # then: transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)

    from fusedzero import checkpoint
    from fusedzero.checkpoint import hf
    hf.export_hf("ckpt", "out", hf_config="config.json")      # model.safetensors + config.json
    checkpoint.import_weights(opt, "some_hf_dir")              # model.safetensors or the index

The optimizer must have been built with `module=` an HF model (e.g.
`AutoModelForCausalLM.from_config(cfg)`): the checkpoint then holds the model's own parameter
names, which are the names `from_pretrained` reads. Tied weights (GPT-2's `lm_head.weight` /
`transformer.wte.weight`) are written under every name; HF ties them again on load.

transformers is optional (`pip install 'fusedzero[hf]'`): the export itself needs only
safetensors; with transformers installed the config is also checked against the checkpoint's
parameter names and shapes before anything is written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from fusedzero import _dtypes as dtypes
from fusedzero.checkpoint._format import check_replaceable, open_regular, write_text_atomic
from fusedzero.checkpoint._manifest import snippet
from fusedzero.checkpoint._tp_export import export, saved_params
from fusedzero.checkpoint._weights import Exported

__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "check_against_config", "export_hf", "read_hf_config"]

WEIGHTS_NAME = "model.safetensors"  # transformers' SAFE_WEIGHTS_NAME; shards add -0000k-of-n
CONFIG_NAME = "config.json"
# A Hugging Face config.json is a few KB; 16 MiB bounds what a wrong path makes us read.
_MAX_CONFIG = 16 << 20


def read_hf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A config.json (or the folder holding one) as a dict; must name its `model_type`."""
    p = Path(path)
    f = p / CONFIG_NAME if p.is_dir() else p
    fd = open_regular(f, "--hf-config", follow=True)  # a FIFO or device: refused, not read
    try:
        with os.fdopen(fd, "rb") as fh:
            raw = fh.read(_MAX_CONFIG + 1)
        if len(raw) > _MAX_CONFIG:
            raise ValueError(f"larger than {_MAX_CONFIG} bytes")
        d = json.loads(raw.decode())
    except (OSError, ValueError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else snippet(str(e), 120)
        raise ValueError(f"{f}: not a readable Hugging Face config.json ({why})") from None
    if not isinstance(d, dict) or "model_type" not in d:
        raise ValueError(f"{f}: no 'model_type' key; is it a Hugging Face config.json?")
    return d


def check_against_config(src: str | os.PathLike[str], config: dict[str, Any]) -> None:
    """Raise ValueError when the checkpoint's params are not the params of the model `config`
    describes (names and shapes). Needs transformers; builds the model on the meta device."""
    import transformers

    cfg = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    want = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    have: dict[str, tuple[int, ...]] = {}
    for p in saved_params(src):  # a tensor-parallel root: full shapes from its record
        for name in [p["name"], *p.get("aliases", [])]:
            have[name] = tuple(p["shape"])
    diffs = [
        f"{n}: shape {list(have[n])} in the checkpoint, {list(s)} in the config"
        for n, s in want.items()
        if n in have and have[n] != s
    ]
    # A tied weight may be saved under one of its names only: HF ties it again on load.
    tied = {
        n
        for n in want
        if n not in have and any(want[o] == want[n] and o in have for o in _tied_names(model, n))
    }
    missing = [n for n in want if n not in have and n not in tied]
    extra = [n for n in have if n not in want]
    if missing:
        diffs.append(f"missing from the checkpoint: {missing}")
    if extra:
        diffs.append(
            f"not params of {cfg.model_type} {type(model).__name__}: {extra} (was the "
            "optimizer built with module= the HF model?)"
        )
    if diffs:
        raise ValueError(f"checkpoint {src} does not match the HF config:\n  " + "\n  ".join(diffs))


def _tied_names(model: torch.nn.Module, name: str) -> list[str]:
    by_id: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(n)
    return next((ns for ns in by_id.values() if name in ns), [])


def export_hf(
    src: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    hf_config: str | os.PathLike[str] | dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int | None = None,
    verify: bool = True,
) -> Exported:
    """Write checkpoint `src` as a folder `AutoModelForCausalLM.from_pretrained` loads:
    `model.safetensors` (or `model-0000k-of-0000n.safetensors` + `model.safetensors.index.json`
    above `max_shard_bytes`) and, with `hf_config` (a config.json path or dict), `config.json`
    with its dtype set to `dtype`. Streams one param at a time (see `checkpoint.export`); a
    tensor-parallel root is assembled in memory (`tp_export.export_tp`)."""
    config = None
    if hf_config is not None:
        config = dict(hf_config) if isinstance(hf_config, dict) else read_hf_config(hf_config)
        try:
            import transformers  # noqa: F401
        except ImportError:
            pass  # the export needs only safetensors; without transformers, no name check
        else:
            check_against_config(src, config)
    out = Path(out_dir)
    if out.suffix == ".safetensors":
        raise ValueError(
            f"{out} looks like a file: export_hf writes a folder (model.safetensors "
            "and config.json inside it)"
        )
    if config is not None:
        check_replaceable(out / CONFIG_NAME, "export output")
    out.mkdir(parents=True, exist_ok=True)
    r = export(src, out / WEIGHTS_NAME, dtype=dtype, max_shard_bytes=max_shard_bytes, verify=verify)
    if config is not None:
        # transformers 4.x reads `torch_dtype`, 5.x `dtype`: set the ones the config has.
        keys = [k for k in ("torch_dtype", "dtype") if k in config] or ["torch_dtype"]
        for k in keys:
            config[k] = dtypes.name(dtype)
        # A fresh temporary and a rename: never written through a planted link.
        write_text_atomic(out / CONFIG_NAME, json.dumps(config, indent=2, sort_keys=True) + "\n")
    return r
