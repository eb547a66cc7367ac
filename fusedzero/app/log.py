"""What a rank records of the run, and the named waits around its own collectives.

[Note: host syncs] The step itself has none on CUDA. Losses and grad norms of each step are kept
as device tensors and read, all-reduced over ranks with `torch.distributed` directly (not counted in
`opt.comm`), only at log points (`--log-every`), evals and checkpoints.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from fusedzero._comm import CollectiveTimeout, group_rank, group_timeout, is_timeout


@contextlib.contextmanager
def waiting_for(what: str) -> Iterator[None]:
    """Blocking `torch.distributed` calls outside the optimizer (logging, evals, the end
    barrier) time out after the group's timeout with gloo's own words: name the wait instead."""
    try:
        yield
    except RuntimeError as e:
        if isinstance(e, CollectiveTimeout) or not is_timeout(e):
            raise
        raise CollectiveTimeout(
            f"rank {group_rank(None)}: timed out (limit {group_timeout():g}s) "
            f"waiting for {what} ({' '.join(str(e).split())}); another rank "
            "stalled or crashed (raise --timeout if it is just slow)"
        ) from None


class PendingStep(NamedTuple):
    """One step's values, still on the device until the next flush."""

    step: int
    loss: torch.Tensor
    grad_norm: torch.Tensor
    lr: float
    skipped: torch.Tensor


class RunLog:
    """Per-step records. Device values wait in `pending` until `flush` (a host sync)."""

    def __init__(self, world: int, run_id: str = "") -> None:
        self.world = world  # the logged loss is the mean over ranks
        self.run_id = run_id  # the same on every rank; a resume takes the checkpoint's
        self.pending: list[PendingStep] = []
        self.steps: list[dict[str, Any]] = []
        self.val: list[dict[str, Any]] = []
        self.skipped: dict[int, bool] = {}  # step -> the optimizer skipped it (non-finite grads)

    def flush(self) -> None:
        if not self.pending:
            return
        losses = torch.stack([p.loss for p in self.pending])
        norms = torch.stack([p.grad_norm for p in self.pending]).float()
        skipped = torch.stack([p.skipped for p in self.pending]).bool()
        # The global mean loss: logging only, so through dist directly, not counted in opt.comm.
        with waiting_for("the all-reduce of logged losses"):
            dist.all_reduce(losses)
        losses = (losses / self.world).tolist()  # host sync
        for p, loss, norm, skip in zip(
            self.pending, losses, norms.tolist(), skipped.tolist(), strict=True
        ):
            self.steps.append({"step": p.step, "loss": loss, "grad_norm": norm, "lr": p.lr})
            self.skipped[p.step] = skip  # --log-jsonl only: the --out-json schema stays as is
        self.pending.clear()
