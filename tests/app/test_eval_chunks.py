"""Validation in training-sized forwards (fusedzero/app/loop.py `evaluate`): the loss over
chunks of `rows` windows equals the loss over all of a rank's windows at once (to fp32
rounding of the per-chunk sums), and every rank runs as many forwards as the rank with the
most windows (ZeRO-3 and tp meet in every forward). Before: one forward over all of a rank's
windows, whose logits were 16x a training step's at --grad-accum 16. And `check_batch`
divides the batch by the data-parallel ranks, not every rank (with --tp, a replica's tp ranks
share its rows)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fusedzero.app.config import UsageError, parse_args
from fusedzero.app.loop import evaluate
from fusedzero.app.model import GPT, GPTConfig
from fusedzero.app.preflight import check_batch


class Counting(GPT):
    forwards = 0

    def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        Counting.forwards += 1
        return super().forward(*args, **kwargs)


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


def test_chunks_give_the_loss_of_one_forward_and_every_rank_the_same_count(one_rank) -> None:
    torch.manual_seed(0)
    m = Counting(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16))
    g = torch.Generator().manual_seed(1)
    val = (
        torch.randint(0, 256, (11, 16), generator=g),
        torch.randint(0, 256, (11, 16), generator=g),
    )
    whole = evaluate(m, val, 0, 1)
    Counting.forwards = 0
    chunked = evaluate(m, val, 0, 1, rows=4)
    assert Counting.forwards == 3  # 11 windows, 4 a forward
    assert abs(chunked - whole) <= 1e-6 * whole
    # As rank 2 of 3 it holds windows 2, 5, 8, rank 0 holds 0, 3, 6, 9: one a forward, both
    # run 4, rank 2's last on a window whose loss is not counted.
    for rank in (0, 2):
        Counting.forwards = 0
        evaluate(m, val, rank, 3, rows=1)
        assert Counting.forwards == 4, rank


def test_batch_divides_over_the_data_parallel_ranks() -> None:
    check_batch(parse_args(["--batch-size", "6", "--tp", "2"]), 4)  # 2 dp ranks x 3 rows
    with pytest.raises(UsageError, match="data-parallel ranks\\*grad_accum = 2\\*2 = 4"):
        check_batch(parse_args(["--batch-size", "6", "--tp", "2", "--grad-accum", "2"]), 4)
