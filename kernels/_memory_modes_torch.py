"""The torch path (CPU tensors) of the memory-mode variants: the kernel's fp32 ops, vectorised.

Every operation is the one the Triton kernel does, in the same order and precision (fp32 math
from the per-step rows of kernels/_rows.py, the same integer rounding and hash), so this path and
the interpreter agree bit for bit. fp32 master with fp32 states never comes here: it stays
torch's own fused AdamW (_adamw_torch.py).

`ModeCombo` is one grouped launch's pieces (kernels/_table.py, in the memory modes' row layout
`AdamWCol`: master, grad, exp_avg, exp_avg_sq, out, comp, exp_avg's scales, exp_avg_sq's scales;
ints: the bf16-sr index offset). A step is one vectorised pass per hyper-parameter row over all its
pieces,
concatenated (every piece is whole quantization blocks, so the int8 blocks stay the kernel's).
"""

from __future__ import annotations

import torch

from fusedzero.kernels._memory_modes import (
    QBLOCK,
    dequantize_blockwise,
    quantize_blockwise,
    sqrt_rn,
    sr_bits,
    stochastic_round_bf16_torch,
)
from fusedzero.kernels._rows import RowCol
from fusedzero.kernels._table import AdamWCol, Piece

# Stream indices of a piece's tensors.
_MASTER, _GRAD, _M, _V, _OUT, _COMP, _MS, _VS = (
    c.stream
    for c in (
        AdamWCol.MASTER,
        AdamWCol.GRAD,
        AdamWCol.EXP_AVG,
        AdamWCol.EXP_AVG_SQ,
        AdamWCol.OUT,
        AdamWCol.COMP,
        AdamWCol.EXP_AVG_SCALE,
        AdamWCol.EXP_AVG_SQ_SCALE,
    )
)


def _views(p: Piece, j: int) -> torch.Tensor | None:
    t = p.tensors[j]
    n = p.numel // QBLOCK if j in (_MS, _VS) else p.numel
    return None if t is None else t[p.starts[j] : p.starts[j] + n]


def _cat(ts: list[torch.Tensor]) -> torch.Tensor:
    return ts[0] if len(ts) == 1 else torch.cat(ts)


def _scatter(dsts: list[torch.Tensor], x: torch.Tensor) -> None:
    for d, src in zip(dsts, x.split([d.numel() for d in dsts])):
        d.copy_(src)  # bf16 destinations round to nearest-even, as the kernel's round_to_bf16


class ModeCombo:
    """A memory mode's grouped update of one (grad dtype, out dtype) combination on CPU."""

    def __init__(
        self, pieces: list[Piece], master_mode: str, states: str, seed: torch.Tensor | None
    ) -> None:
        self.master_mode, self.states, self.seed = master_mode, states, seed
        self.by_row: dict[int, list[list[torch.Tensor | None]]] = {}
        self.sr_starts: dict[int, list[tuple[int, int]]] = {}
        for p in pieces:
            self.by_row.setdefault(p.row, []).append([_views(p, j) for j in range(_VS + 1)])
            self.sr_starts.setdefault(p.row, []).append((p.ints[0] if p.ints else 0, p.numel))

    def run(self, rows: torch.Tensor, step: torch.Tensor, skip: torch.Tensor) -> None:
        """On CPU, reading `skip` is a memory read, not a device sync."""
        if skip.item() != 0:
            return
        for r, views in self.by_row.items():
            col = lambda j, views=views: [v[j] for v in views]  # noqa: E731
            self._row(rows[r], col, r, step)

    def _row(self, hp: torch.Tensor, col, r: int, step: torch.Tensor) -> None:
        mm, st = self.master_mode, self.states
        p = _cat(col(_MASTER)).float()
        if mm == "bf16-kahan":
            p = p + _cat(col(_COMP)).float()
        m = _load_state(col(_M), col(_MS), st, signed=True)
        v = _load_state(col(_V), col(_VS), st, signed=False)
        p, m, v = _update(p, _cat(col(_GRAD)).float(), m, v, hp)
        if mm == "fp32":
            _scatter(col(_MASTER), p)
            if col(_OUT)[0] is not None:
                _scatter(col(_OUT), p)
        elif mm == "bf16-kahan":
            pb = p.to(torch.bfloat16)
            _scatter(col(_MASTER), pb)
            _scatter(col(_COMP), (p - pb.float()).to(torch.bfloat16))
        elif mm == "bf16-sr":
            idx = torch.cat(
                [torch.arange(s, s + n, dtype=torch.int64) for s, n in self.sr_starts[r]]
            )
            _scatter(col(_MASTER), stochastic_round_bf16_torch(p, sr_bits(self.seed, step, idx)))
        else:
            _scatter(col(_MASTER), p.to(torch.bfloat16))
        _store_state(col(_M), col(_MS), m, st, signed=True)
        _store_state(col(_V), col(_VS), v, st, signed=False)


def _update(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, hp: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # The kernel's order of operations (torch.optim.AdamW's single-tensor path), all fp32, with
    # the row's columns (kernels/_rows.py RowCol): the bias corrections are in step_size, bc2_sqrt.
    step_size, bc2_sqrt, decay = hp[RowCol.STEP_SIZE], hp[RowCol.BC2_SQRT], hp[RowCol.DECAY]
    omb1, beta2, omb2 = hp[RowCol.ONE_MINUS_BETA1], hp[RowCol.BETA2], hp[RowCol.ONE_MINUS_BETA2]
    eps, grad_mult = hp[RowCol.EPS], hp[RowCol.GRAD_MULT]
    g = g * grad_mult
    p = p * decay
    m = m + omb1 * (g - m)
    v = v * beta2 + omb2 * g * g
    denom = sqrt_rn(v) / bc2_sqrt + eps
    return p - step_size * (m / denom), m, v


def _load_state(
    ts: list[torch.Tensor], scales: list[torch.Tensor | None], states: str, *, signed: bool
) -> torch.Tensor:
    if states == "int8":
        return dequantize_blockwise(_cat(ts), _cat(scales), signed=signed)
    return _cat(ts).float()


def _store_state(
    ts: list[torch.Tensor],
    scales: list[torch.Tensor | None],
    x: torch.Tensor,
    states: str,
    *,
    signed: bool,
) -> None:
    if states == "int8":
        q, a = quantize_blockwise(x, signed=signed)
        _scatter(ts, q)
        _scatter(scales, a)
    else:
        _scatter(ts, x)  # fp32, or bf16 rounded to nearest-even by the cast
