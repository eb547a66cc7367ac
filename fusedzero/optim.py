"""The optimizers: `ZeroAdamW` (the engine with the AdamW rule) and `ZeroMuon` (Muon groups and
AdamW groups, a rule per group), both `ZeroOptimizer` (fusedzero/_engine.py), the sharding engine
that runs any update rule (fusedzero/rules) with ZeRO stages 0 to 3.

    opt = ZeroAdamW(model.parameters(), lr=3e-4, stage=2, module=model, max_grad_norm=1.0,
                    precision=Precision(param_dtype=torch.bfloat16))
    loss = model(x).loss; loss.backward(); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from fusedzero._engine import ZeroOptimizer
from fusedzero._flat import MemoryReport
from fusedzero.policy import Groups, Precision, Sharding, Wire, moved_keywords
from fusedzero.rules import ByGroup
from fusedzero.rules._adamw import ADAMW
from fusedzero.rules._muon import MUON, matrix_shape
from fusedzero.stage import Stage

__all__ = ["MemoryReport", "Stage", "ZeroAdamW", "ZeroMuon", "ZeroOptimizer"]


class ZeroAdamW(ZeroOptimizer):
    """AdamW with ZeRO sharding over a process group: the engine (`ZeroOptimizer`) with the
    AdamW rule (fusedzero/rules/_adamw.py); one fused update launch per dtype combination.

    Args:
        params: parameters or param-group dicts, as for `torch.optim.AdamW`. Params with
            `requires_grad=False` are left out (frozen).
        lr, betas, eps, weight_decay, maximize: as `torch.optim.AdamW` (decoupled weight decay),
            but eps must be > 0 and lr, eps, weight_decay finite in fp32
            (`rules._adamw.check_hyper`).
        stage, module, max_grad_norm, precision, wire, groups, sharding, device, trace: the
            engine's (`ZeroOptimizer`).

    The records are described in docs/api.md. A keyword of the old flat signature
    (`param_dtype=`, `process_group=`, ...) raises a TypeError naming its record.
    """

    @moved_keywords
    def __init__(
        self,
        params: Iterable[nn.Parameter] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        maximize: bool = False,
        *,
        stage: int | Stage = 1,
        module: nn.Module | None = None,
        max_grad_norm: float | None = None,
        precision: Precision = Precision(),
        wire: Wire = Wire(),
        groups: Groups = Groups(),
        sharding: Sharding = Sharding(),
        device: torch.device | str | None = None,
        trace: bool = False,
    ) -> None:
        super().__init__(
            params,
            ADAMW,
            dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize),
            stage=stage,
            module=module,
            max_grad_norm=max_grad_norm,
            precision=precision,
            wire=wire,
            groups=groups,
            sharding=sharding,
            device=device,
            trace=trace,
        )


class ZeroMuon(ZeroOptimizer):
    """Muon for the hidden matrices and AdamW for the rest, in one optimizer with ZeRO sharding:
    the engine (`ZeroOptimizer`) with the Muon rule (fusedzero/rules/_muon.py) on the groups
    that say `use_muon=True` and the AdamW rule on those that say False (the convention of
    `MuonWithAuxAdam` in the Muon reference repository). `fusedzero.muon_param_groups(model)`
    makes the groups.

    Args:
        param_groups: param-group dicts, each with `use_muon`. A Muon group takes
            `torch.optim.Muon`'s hyper-parameters (lr, weight_decay, momentum, nesterov,
            ns_coefficients, eps, ns_steps, adjust_lr_fn) with its defaults; an AdamW group
            `torch.optim.AdamW`'s (lr, betas, eps, weight_decay, maximize) with its defaults.
            A Muon group's params are 2-D, or 3-D stacks [E, M, N] of E matrices.
        muon_defaults, adamw_defaults: defaults over torch's for the groups of each kind.
        stage, module, max_grad_norm, precision, wire, groups, sharding, device, trace: the
            engine's (`ZeroOptimizer`). Muon needs the fp32 master mode and fp32 or bf16 state.

    Semantics: `torch.optim.Muon` on the Muon groups plus `torch.optim.AdamW` on the rest, under
    DDP. Newton-Schulz needs each matrix whole on the rank that updates it: at stage 0 every
    rank updates every matrix (as DDP + Muon); at stages 1-3 the Muon groups' buffers take the
    owner layout (fusedzero/_owner_layout.py): each matrix whole in one rank's shard, so the
    reduce-scatter and all-gather the stage runs anyway carry it, and Newton-Schulz runs once
    per matrix, on its owner (docs/muon.md).
    """

    @moved_keywords
    def __init__(
        self,
        param_groups: Iterable[dict[str, Any]],
        *,
        muon_defaults: dict[str, Any] | None = None,
        adamw_defaults: dict[str, Any] | None = None,
        stage: int | Stage = 1,
        module: nn.Module | None = None,
        max_grad_norm: float | None = None,
        precision: Precision = Precision(),
        wire: Wire = Wire(),
        groups: Groups = Groups(),
        sharding: Sharding = Sharding(),
        device: torch.device | str | None = None,
        trace: bool = False,
    ) -> None:
        param_groups = list(param_groups)
        names = {} if module is None else {id(p): n for n, p in module.named_parameters()}
        for i, g in enumerate(param_groups):
            if not isinstance(g, dict):
                raise TypeError(
                    f"ZeroMuon takes param-group dicts with use_muon=True/False, got "
                    f"{type(g).__name__} at {i}: use fusedzero.muon_param_groups(model)"
                )
            ps = g.get("params", [])
            for p in [ps] if isinstance(ps, torch.Tensor) else ps:
                if g.get("use_muon") and matrix_shape(p.shape) is None:
                    raise ValueError(
                        f"param_groups[{i}] (use_muon=True) holds "
                        f"{names.get(id(p), 'a param')} of shape {tuple(p.shape)}: Muon "
                        "updates 2-D matrices and 3-D stacks of them; put it in a use_muon="
                        "False group"
                    )
        super().__init__(
            param_groups,
            ByGroup(
                "use_muon",
                {True: MUON, False: ADAMW},
                {True: dict(muon_defaults or {}), False: dict(adamw_defaults or {})},
            ),
            stage=stage,
            module=module,
            max_grad_norm=max_grad_norm,
            precision=precision,
            wire=wire,
            groups=groups,
            sharding=sharding,
            device=device,
            trace=trace,
        )
