"""`muon_param_groups`: which params of a model Muon updates, and which AdamW.

Muon is for the hidden matrices of a network; the embeddings, the output head, norms and biases
go to AdamW (the convention of the Muon reference and of `torch.optim.Muon`'s docs). A 3-D param
[E, M, N] (an expert stack) is E matrices, and goes to Muon with the hidden matrices.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

from torch import nn

__all__ = ["HEAD_NAMES", "muon_param_groups"]

# Modules that map hidden states to the vocabulary (or the labels) in common models: GPT-2,
# Llama, Mistral, Mixtral ("lm_head"), GPT-NeoX ("embed_out"), fusedzero's test models ("head"),
# sequence classifiers ("classifier", "score"), Megatron-style "output".
HEAD_NAMES = ("lm_head", "head", "embed_out", "output", "output_layer", "classifier", "score")


def _default_use_muon(module: nn.Module, param_name: str, ndim: int) -> bool:
    owner = param_name.rsplit(".", 1)[0] if "." in param_name else ""
    owner_module = module.get_submodule(owner)
    if isinstance(owner_module, nn.Embedding) or owner.rsplit(".", 1)[-1] in HEAD_NAMES:
        return False
    return ndim in (2, 3)


def muon_param_groups(
    model: nn.Module,
    *,
    muon: Mapping[str, Any] | None = None,
    adamw: Mapping[str, Any] | None = None,
    use_muon: Mapping[str, bool] | None = None,
) -> list[dict[str, Any]]:
    """`model`'s trainable params as `ZeroMuon` param groups: `{"params": [...], "use_muon":
    True, **muon}` for the hidden 2-D matrices (and 3-D stacks of them), `{"params": [...],
    "use_muon": False, **adamw}` for the rest: embeddings (`nn.Embedding`), the output head (a
    module named as in `HEAD_NAMES`; a head tied to the embedding is the embedding), norms,
    biases and any other param not 2-D or 3-D.

    `use_muon`: overrides by name, `{pattern: True/False}` with fnmatch patterns over
    `named_parameters()` names (e.g. `{"blocks.0.*": False}`); the first pattern that matches
    decides. An empty group is left out.
    """
    overrides = dict(use_muon or {})
    chosen: dict[bool, list[nn.Parameter]] = {True: [], False: []}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        pick = next((v for pat, v in overrides.items() if fnmatch.fnmatchcase(name, pat)), None)
        if pick is None:
            pick = _default_use_muon(model, name, p.ndim)
        elif pick and p.ndim not in (2, 3):
            raise ValueError(
                f"use_muon overrides put {name} (shape {tuple(p.shape)}) in the Muon group: "
                "Muon updates 2-D matrices and 3-D stacks of them"
            )
        chosen[bool(pick)].append(p)
    groups = [
        {"params": chosen[True], "use_muon": True, **(muon or {})},
        {"params": chosen[False], "use_muon": False, **(adamw or {})},
    ]
    return [g for g in groups if g["params"]]
