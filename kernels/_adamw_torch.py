"""The grouped AdamW update on CPU tensors, through torch's own fused AdamW (vectorised C++).

One `Combo` is every piece of one (grad dtype, out dtype) combination, as tensor lists built
once. fp32 grads without an output: one `torch._fused_adamw_` per hyper-parameter row (param
group) over all its pieces, one pass. bf16/fp16 grads or a low-precision output: the pieces are
cut into cache-sized chunks, and each chunk is cast into a small fp32 workspace, updated and
copied into the output while it is still in cache (see [Note: cache-blocked update]).

[Note: cache-blocked update] A chunk touches 20 bytes per element with bf16 grads and a bf16 output
(master, workspace, exp_avg, exp_avg_sq in fp32; grad and output in bf16): 2**15 elements are 640
KiB, well inside a core's L2 (2 MiB on the machine this was measured on; 1-2 MiB on current x86
server cores). Whole-buffer passes instead write the fp32 workspace to memory, read it back, and
read the master a second time for the output copy (bench/README.md, "Where the overhead goes").
Each chunk costs three small foreach calls on the host: at 2**15 elements that is a few
microseconds per 100 KiB of grads.
"""

from __future__ import annotations

import dataclasses

import torch

from fusedzero.kernels._launch import Hyper
from fusedzero.kernels._table import AdamWCol, Piece

# Elements per chunk: see [Note: cache-blocked update].
CHUNK = 1 << 15


@dataclasses.dataclass
class _Chunk:
    """At most CHUNK elements of one row's pieces: the lists of one `_fused_adamw_` call."""

    row: int
    masters: list[torch.Tensor] = dataclasses.field(default_factory=list)
    grads: list[torch.Tensor] = dataclasses.field(default_factory=list)  # fp32: what adamw reads
    exp_avgs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    exp_avg_sqs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    grad_src: list[torch.Tensor] = dataclasses.field(default_factory=list)  # cast into `grads`
    outs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    numel: int = 0


class Combo:
    """The torch path's lists for one combination's pieces (see the module docstring)."""

    def __init__(self, pieces: list[Piece], num_rows: int, chunk: int | None = None) -> None:
        self._chunk = CHUNK if chunk is None else chunk
        self._pieces = pieces
        first = pieces[0].tensors
        self.cast = first[AdamWCol.GRAD.stream].dtype != torch.float32
        self.has_out = len(first) > AdamWCol.OUT.stream
        self.total = sum(p.numel for p in pieces)
        # One workspace for every chunk: it stays in cache.
        self._ws = (
            torch.empty(min(self._chunk, self.total), dtype=torch.float32, device=first[0].device)
            if self.cast
            else None
        )
        self._chunks: list[_Chunk] | None = None

    @property
    def chunks(self) -> list[_Chunk]:
        """The tensor lists, built at the first use (a few seconds for billions of elements:
        an optimizer built only to be measured or saved, as `fusedzero.emulate` builds W of
        them, never pays it)."""
        if self._chunks is None:
            self._chunks = self._build()
        return self._chunks

    def _build(self) -> list[_Chunk]:
        chunk, pieces = self._chunk, self._pieces
        views = [[t[s : s + p.numel] for t, s in zip(p.tensors, p.starts)] for p in pieces]
        blocked = self.cast or self.has_out
        chunks: list[_Chunk] = []
        for row in sorted({p.row for p in pieces}):
            cur = _Chunk(row)
            for p, v in zip(pieces, views):
                if p.row != row:
                    continue
                lo = 0
                while lo < p.numel:
                    if blocked and cur.numel == chunk:
                        chunks.append(cur)
                        cur = _Chunk(row)
                    n = p.numel - lo if not blocked else min(p.numel - lo, chunk - cur.numel)
                    self._add(cur, [t[lo : lo + n] for t in v], n)
                    lo += n
            if cur.numel:
                chunks.append(cur)
        return chunks

    def _add(self, c: _Chunk, v: list[torch.Tensor], n: int) -> None:
        c.masters.append(v[AdamWCol.MASTER.stream])
        grad = v[AdamWCol.GRAD.stream]
        if self.cast:
            assert self._ws is not None
            c.grad_src.append(grad)
            c.grads.append(self._ws[c.numel : c.numel + n])
        else:
            c.grads.append(grad)
        c.exp_avgs.append(v[AdamWCol.EXP_AVG.stream])
        c.exp_avg_sqs.append(v[AdamWCol.EXP_AVG_SQ.stream])
        if self.has_out:
            c.outs.append(v[AdamWCol.OUT.stream])
        c.numel += n

    def run(
        self, hyper: Hyper, step: torch.Tensor, grad_scale: torch.Tensor, skip: torch.Tensor
    ) -> None:
        """On CPU, reading `skip` is a memory read, not a device sync. torch's kernel divides
        the grad by `grad_scale` in place: the grads are consumed by the step."""
        if skip.item() != 0:
            return
        inv = grad_scale.reciprocal()
        for c in self.chunks:
            beta1, beta2, eps, wd, maximize = hyper.consts[c.row]
            if c.grad_src:
                torch._foreach_copy_(c.grads, c.grad_src)
            torch._fused_adamw_(
                c.masters,
                c.grads,
                c.exp_avgs,
                c.exp_avg_sqs,
                [],
                [step] * len(c.masters),
                lr=hyper.lr[c.row : c.row + 1],
                beta1=beta1,
                beta2=beta2,
                weight_decay=wd,
                eps=eps,
                amsgrad=False,
                maximize=maximize,
                grad_scale=inv,
                found_inf=None,
            )
            if c.outs:
                torch._foreach_copy_(c.outs, c.masters)
