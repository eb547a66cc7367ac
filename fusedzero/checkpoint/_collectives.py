"""The collectives a checkpoint needs: gather every rank's record on the first, and agree on
success (raise the same error on every rank) so that no rank is left in a later collective."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from fusedzero.checkpoint._manifest import CheckpointError


def gather_to_first(
    obj: Any, group: dist.ProcessGroup | None, W: int, rank: int
) -> list[Any] | None:
    """Every rank's `obj` on group rank 0 (None elsewhere)."""
    if W == 1:
        return [obj]
    out: list[Any] | None = [None] * W if rank == 0 else None
    dst = dist.get_global_rank(group, 0) if group is not None else 0
    dist.gather_object(obj, out, dst=dst, group=group)
    return out


def agree(err: BaseException | None, group: dist.ProcessGroup | None, W: int, what: str) -> None:
    """Collective: raise on every rank if any rank failed (so none hangs in a later collective).
    The exception type is the failing ranks' (ValueError stays ValueError)."""
    if W == 1:
        if err is not None:
            raise err
        return
    mine = None if err is None else (type(err).__name__, str(err))
    allerr: list[Any] = [None] * W
    dist.all_gather_object(allerr, mine, group=group)
    bad = [(r, e) for r, e in enumerate(allerr) if e is not None]
    if not bad:
        return
    kinds = {e[0] for _, e in bad}
    msgs = {}
    for r, (_, m) in bad:
        msgs.setdefault(m, []).append(r)
    text = "\n".join(
        f"ranks {rs}: {m}" if len(rs) > 1 else f"rank {rs[0]}: {m}" for m, rs in msgs.items()
    )
    cls: type[Exception] = ValueError if kinds == {"ValueError"} else CheckpointError
    # The same error on every rank, failing or not: callers may compare or log any rank's.
    raise cls(f"{what} failed:\n{text}") from err
