"""The grouped AdamW update on CPU tensors, through torch's own fused AdamW (vectorised C++).

One `Combo` is every piece of one (grad dtype, out dtype) combination, as tensor lists built
once; a step is one `torch._fused_adamw_` per hyper-parameter row (param group) over all its
pieces, plus one cast of bf16/fp16 grads into a reused fp32 workspace and one copy of the new
params into the low-precision output, each a single foreach op over all pieces.
"""
from __future__ import annotations

import torch

from fusedzero.kernels._launch import Hyper
from fusedzero.kernels.table import Piece


class Combo:
    """The torch path's lists for one combination's pieces (see the module docstring)."""

    def __init__(self, pieces: list[Piece], num_rows: int) -> None:
        views = [[t[s:s + p.numel] for t, s in zip(p.tensors, p.starts)] for p in pieces]
        self.grad_src = [v[1] for v in views]
        self.cast = self.grad_src[0].dtype != torch.float32
        self.total = sum(p.numel for p in pieces)
        self._ws: torch.Tensor | None = None
        grads = self.grad_src
        if self.cast:
            self._ws = torch.empty(self.total, dtype=torch.float32,
                                   device=self.grad_src[0].device)
            grads = list(self._ws.split([p.numel for p in pieces]))
        self.ws_views = grads if self.cast else []
        self.rows: dict[int, tuple[list[torch.Tensor], ...]] = {}
        for p, v, g in zip(pieces, views, grads):
            lists = self.rows.setdefault(p.row, ([], [], [], []))
            for lst, t in zip(lists, (v[0], g, v[2], v[3])):
                lst.append(t)
        self.outs = [v[4] for v in views if len(v) > 4]
        self.out_src = [v[0] for v in views if len(v) > 4]

    def run(self, hyper: Hyper, step: torch.Tensor, grad_scale: torch.Tensor,
            skip: torch.Tensor) -> None:
        """On CPU, reading `skip` is a memory read, not a device sync. torch's kernel divides
        the grad by `grad_scale` in place: the grads are consumed by the step."""
        if skip.item() != 0:
            return
        if self.cast:
            torch._foreach_copy_(self.ws_views, self.grad_src)
        inv = grad_scale.reciprocal()
        for row, (masters, grads, ms, vs) in self.rows.items():
            beta1, beta2, eps, wd, maximize = hyper.consts[row]
            torch._fused_adamw_(masters, grads, ms, vs, [], [step] * len(masters),
                                lr=hyper.lr[row:row + 1], beta1=beta1, beta2=beta2,
                                weight_decay=wd, eps=eps, amsgrad=False, maximize=maximize,
                                grad_scale=inv, found_inf=None)
        if self.outs:
            torch._foreach_copy_(self.outs, self.out_src)
