"""The Muon rule: `torch.optim.Muon`'s math on the engine's local shards.

Everything Muon lives here and in its kernels (kernels/_muon.py): the state (`momentum_buffer`),
the hyper-parameters (lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps,
adjust_lr_fn) with torch's defaults and validation, and the launches. Muon is per-matrix:
Newton-Schulz needs each matrix whole, so the rule updates the params its local shards hold
whole (`LocalShard.whole_tensors()`); See [Note: whole tensors for per-matrix rules] in
fusedzero/rules/__init__.py for where the engine can give it them.

A step over every Muon matrix of the rank, no host sync:
1. one momentum launch over every matrix (`MuonPlan.momentum`): momentum buffer, Nesterov, the
   grad scale (averaging, clip, loss scale) folded in, the bf16 Newton-Schulz input written into
   a stack per (param group, matrix shape);
2. `newton_schulz` per stack, batched over its matrices, written back into the stack (a stack
   of one matrix runs torch's own 2-D sequence);
3. one update launch (`MuonPlan.update`): decoupled weight decay with the unadjusted lr, the
   step with the lr adjusted by the matrix shape, the low-precision param copy.

A 3-D param [E, M, N] (a stack of expert matrices) is E matrices of M x N, each orthogonalised
on its own, with the lr adjusted by M x N (torch.optim.Muon refuses 3-D params).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fusedzero._owner_layout import Block
from fusedzero._scalars import GroupLr
from fusedzero.kernels import (
    MomentumPiece,
    MuonPlan,
    MuonRow,
    UpdatePiece,
    lr_ratio,
    newton_schulz,
)
from fusedzero.kernels._launch import Hyper
from fusedzero.kernels._muon import ADJUST_LR_FNS, MuonRows
from fusedzero.memory_modes import MemoryModes
from fusedzero.rules import LocalShard, ShardView, StateField, StepTensors

__all__ = ["MUON", "Muon", "matrix_shape", "ns_cost"]

_FP32_MAX = torch.finfo(torch.float32).max

# torch.optim.Muon's defaults (Keller Jordan's NS coefficients and steps).
DEFAULTS: Mapping[str, Any] = dict(
    lr=1e-3,
    weight_decay=0.1,
    momentum=0.95,
    nesterov=True,
    ns_coefficients=(3.4445, -4.7750, 2.0315),
    eps=1e-7,
    ns_steps=5,
    adjust_lr_fn=None,
)


def ns_cost(rows: int, cols: int, ns_steps: int = 5) -> int:
    """Newton-Schulz FLOPs of a rows x cols matrix: ns_steps * (4 s*s*l + 2 s*s*s), s <= l
    (two matmuls of s x s x l and one of s x s x s per step, 2 FLOPs a multiply-add)."""
    s, lg = min(rows, cols), max(rows, cols)
    return ns_steps * (4 * s * s * lg + 2 * s * s * s)


def matrix_shape(shape: Sequence[int]) -> tuple[int, int] | None:
    """The shape of each matrix Muon updates in a param of `shape` ([M, N], or [E, M, N]: E
    matrices of M x N), None for a param Muon cannot update."""
    if len(shape) in (2, 3):
        return int(shape[-2]), int(shape[-1])
    return None


class Muon:
    """The Muon update rule (per-matrix: each matrix whole on the rank that updates it)."""

    name = "muon"
    element_wise = False
    defaults: Mapping[str, Any] = DEFAULTS

    def check_group(self, group: Mapping[str, Any]) -> None:
        """torch.optim.Muon's checks, with ns_steps and ns_coefficients checked here rather
        than at the first step."""
        lr = group["lr"]
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= lr:
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if not 0.0 <= group["momentum"]:
            raise ValueError(f"momentum should be >= 0 but is: {group['momentum']}")
        if not 0.0 <= group["weight_decay"]:
            raise ValueError(f"weight decay should be >= 0 but is: {group['weight_decay']}")
        # Stricter than torch on purpose, as the AdamW rule: the update runs in fp32, where
        # 1e39 or inf is inf (torch's Python-float arithmetic would stay finite, or not).
        for key in ("lr", "momentum", "weight_decay"):
            v = group[key]
            v = float(v.reshape(-1)[0]) if isinstance(v, torch.Tensor) else float(v)
            if not v <= _FP32_MAX:
                raise ValueError(
                    f"{key} should be finite in fp32 (at most {_FP32_MAX:.4g}) but is: {group[key]}"
                )
        fn = group["adjust_lr_fn"]
        if fn is not None and fn not in ADJUST_LR_FNS:
            raise ValueError(f"Adjust learning rate function {fn} is not supported")
        if not 0 < group["ns_steps"] < 100:
            raise ValueError(f"ns_steps should be in [1, 99] but is: {group['ns_steps']}")
        if len(group["ns_coefficients"]) != 3:
            raise ValueError(
                f"ns_coefficients must be 3 values (a, b, c), got {group['ns_coefficients']}"
            )

    def blocks(self, shape: tuple[int, ...]) -> Block:
        """What the owner layout keeps whole: one matrix of `shape` (2-D, or each of a 3-D
        stack), costing its Newton-Schulz FLOPs (`ns_cost`)."""
        ms = matrix_shape(shape)
        if ms is None:
            raise ValueError(f"the muon rule updates matrices, got a param of shape {shape}")
        return Block(ms[0] * ms[1], ns_cost(*ms))

    def scratch_bytes(self, local_numel: int) -> int:
        """The Newton-Schulz stacks: bf16, one element per local-shard element (`MuonUpdate`)."""
        return 2 * local_numel

    def state_fields(self, modes: MemoryModes) -> tuple[StateField, ...]:
        # Refused here, before the engine builds any buffer (which rewrites the model's params).
        if not modes.fp32_master:
            raise ValueError(
                f"the muon rule updates an fp32 master: Precision(master='{modes.master}') is "
                "not supported with Muon groups; use master='fp32'"
            )
        if modes.quantized:
            raise ValueError(
                "the muon rule keeps its momentum in fp32 or bf16: use Precision(states='fp32') "
                "or states='bf16', not 'int8'"
            )
        return (StateField(name="momentum_buffer", dtype=modes.state_dtypes[0]),)

    def build(
        self,
        shards: Sequence[LocalShard],
        *,
        device: torch.device,
        num_groups: int,
        modes: MemoryModes,
        seed: torch.Tensor | None,
    ) -> MuonUpdate:
        return MuonUpdate(shards, device=device, num_groups=num_groups)


MUON = Muon()


def _slice(view: ShardView, s: LocalShard, a: int, b: int) -> torch.Tensor:
    """Local-shard elements [a, b) of `view` as one tensor: a whole matrix lies in one bucket's
    piece (the owner layout), or in adjacent pieces that are one run of memory (one rank, stage
    0: the local shard is the whole buffer)."""
    if isinstance(view, torch.Tensor):
        return view[a:b]
    S = s.shard_numel
    k = a // S
    if (b - 1) // S != k and view.stride != S:
        raise ValueError(f"local elements [{a}, {b}) cross a piece edge of a strided view")
    start = k * view.stride + view.base + a - k * S
    return view.tensor[start : start + b - a]


def _consts(g: Mapping[str, Any]) -> tuple[Any, ...]:
    return (
        g["momentum"],
        bool(g["nesterov"]),
        g["weight_decay"],
        g["adjust_lr_fn"],
        tuple(g["ns_coefficients"]),
        int(g["ns_steps"]),
        g["eps"],
    )


class MuonUpdate:
    """One momentum launch, Newton-Schulz per (group, shape) stack, one update launch over every
    whole matrix of the rank's shards; the lr vector on the device (`GroupLr`)."""

    rows = None  # the rows are computed by the momentum launch's own small ops

    def __init__(
        self, shards: Sequence[LocalShard], *, device: torch.device, num_groups: int
    ) -> None:
        self.device = device
        self.num_groups = num_groups
        self.group_lr = GroupLr(num_groups, device, consts=_consts)
        # Each whole param, or run of whole matrices of a stack the owner layout shares out over
        # ranks: (shard, its WholeTensor, matrix shape), grouped by (group, shape).
        counts: dict[tuple[int, tuple[int, int]], int] = {}
        found = []
        for s in shards:
            for t in s.whole_tensors(stacks=True):
                ms = matrix_shape(t.shape)
                if ms is None:
                    raise ValueError(
                        f"the muon rule updates 2-D matrices and 3-D stacks of them, got a "
                        f"param of shape {t.shape}: put it in an AdamW group"
                    )
                e = math.prod(t.shape) // (ms[0] * ms[1])
                key = (s.group_index, ms)
                found.append((s, t, key, counts.get(key, 0), e))
                counts[key] = counts.get(key, 0) + e
        # One [B, M, N] bf16 stack per (group, shape): the momentum launch writes the NS input
        # there and Newton-Schulz its result back, which the update launch reads. The stacks
        # are carved back to back from one scratch tensor of a local shard's size (`scratch_
        # bytes`: 2 B per local-shard element, the same on every rank, so `plan` counts it
        # exactly; the matrices a rank owns never exceed its local shard).
        local = sum(s.num_buckets * s.shard_numel for s in shards)
        self.scratch = (torch.zeros(local, dtype=torch.bfloat16, device=device),)
        self.stacks: dict[tuple[int, tuple[int, int]], torch.Tensor] = {}
        at = 0
        for key, n in counts.items():
            numel = n * key[1][0] * key[1][1]
            self.stacks[key] = self.scratch[0][at : at + numel].view(n, *key[1])
            at += numel
        self._row_keys: list[tuple[int, tuple[int, int]]] = []  # (group, shape) per row
        mom, upd = [], []
        for s, t, key, first, e in found:
            row = self._row(key)
            a, b = t.local, t.local + math.prod(t.shape)
            grad, buf = _slice(s.grad, s, a, b), s.state["momentum_buffer"][a:b]
            master = _slice(s.master, s, a, b)
            out = None if s.out is None else _slice(s.out, s, a, b)
            ns = self.stacks[key][first : first + e].view(-1)
            mom.append(MomentumPiece(grad, buf, ns, row))
            upd.append(UpdatePiece(master, ns, out, row))
        # The rows' values come from the groups at the first `read_groups`; built here (zeros)
        # so that the piece tables are checked at construction.
        self._consts: list[tuple[Any, ...]] | None = None
        self.plan = MuonPlan(
            mom,
            upd,
            [MuonRow(g, 1.0, 0.0, False, 0.0) for g, _ in self._row_keys],
            num_groups,
            device,
        )

    def _row(self, key: tuple[int, tuple[int, int]]) -> int:
        if key not in self._row_keys:
            self._row_keys.append(key)
        return self._row_keys.index(key)

    def _rows(self, consts: Sequence[tuple[Any, ...]]) -> list[MuonRow]:
        out = []
        for group, (m, n) in self._row_keys:
            momentum, nesterov, wd, fn = consts[group][:4]
            out.append(MuonRow(group, lr_ratio(fn, m, n), momentum, nesterov, wd))
        return out

    def read_groups(self, param_groups: list[dict[str, Any]]) -> Hyper:
        hyper = self.group_lr.update(param_groups)
        consts = list(hyper.consts)
        if consts != self._consts:
            # The rows' constant columns (momentum, nesterov, weight decay, the lr ratio of
            # adjust_lr_fn) changed (or this is the first step): written again, from the host
            # without a sync (MuonRows copies through pinned memory).
            self.plan.rows = MuonRows(self._rows(consts), self.num_groups, self.device)
            self._consts = consts
        return hyper

    def step(self, hyper: Hyper, scalars: StepTensors, *, rows_written: bool) -> None:
        self.plan.momentum(hyper.lr, scalars.grad_scale, scalars.skip)
        for (group, _), stack in self.stacks.items():
            coeffs, steps, eps = hyper.consts[group][4:]
            # A stack of one runs torch's own 2-D sequence.
            x = stack[0] if stack.size(0) == 1 else stack
            newton_schulz(x, coeffs, steps, eps, out=x)
        self.plan.update(scalars.skip)
