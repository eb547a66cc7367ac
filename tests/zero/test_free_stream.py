"""A transient buffer freed on another stream than it was allocated on makes its allocating
stream wait for the current one first, and nothing of it runs off CUDA (see [Note: freeing on
another stream] in fusedzero/_streams.py).

No GPU here: a fake stream object stands in for `torch.cuda.Stream`, `torch.cuda.current_stream`
is replaced by one that returns the stream a test sets, and the allocation side
(`allocating_stream`, as _reduce.py and _flat.py imported it) is replaced by one that returns
the stream the buffer was "allocated on", over CPU tensors.

About internals: fusedzero._streams, fusedzero._reduce, fusedzero._flat.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import fusedzero._flat as flat
import fusedzero._reduce as reduce
from fusedzero import ZeroAdamW
from fusedzero._streams import free_storage


class FakeStream:
    """Stands in for a `torch.cuda.Stream`: records what it was made to wait for."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.waited: list[FakeStream] = []

    def wait_stream(self, other: FakeStream) -> None:
        self.waited.append(other)


class Streams:
    """The fake current stream, set by the test."""

    def __init__(self, current: FakeStream) -> None:
        self.current = current
        self.calls = 0

    def current_stream(self, device: Any = None) -> FakeStream:
        self.calls += 1
        return self.current


@pytest.fixture
def streams(monkeypatch: pytest.MonkeyPatch) -> Streams:
    s = Streams(FakeStream("alloc"))
    monkeypatch.setattr(torch.cuda, "current_stream", s.current_stream)
    return s


def test_free_waits_only_when_the_stream_differs(streams: Streams) -> None:
    alloc = streams.current
    t = torch.ones(8)
    free_storage(t, alloc)  # freed on the allocating stream: nothing to order
    assert alloc.waited == [] and t.untyped_storage().nbytes() == 0
    other = streams.current = FakeStream("other")
    t = torch.ones(8)
    free_storage(t, alloc)
    assert alloc.waited == [other] and t.untyped_storage().nbytes() == 0


def test_free_off_cuda_asks_no_stream(streams: Streams) -> None:
    t = torch.ones(8)
    free_storage(t, None)
    assert streams.calls == 0 and t.untyped_storage().nbytes() == 0


def _steps(stage: int, steps: int = 2) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    opt = ZeroAdamW(model.parameters(), lr=1e-3, module=model, stage=stage)
    x = torch.randn(2, 4)
    for _ in range(steps):
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
    opt.close()


@pytest.mark.parametrize("stage", [2, 3])
def test_buffers_freed_on_another_stream_wait_for_it(
    stage: int, streams: Streams, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Allocated on `alloc`, freed with `other` current: every free makes `alloc` wait for
    `other` (the bucket at stage 2; the bucket and the unit's gathered params at stage 3)."""
    alloc, other = FakeStream("alloc"), FakeStream("other")
    streams.current = other
    allocated = {"bucket": 0, "unit": 0}

    def on(what: str) -> Any:
        def allocating_stream(t: torch.Tensor) -> FakeStream:
            allocated[what] += 1
            return alloc

        return allocating_stream

    monkeypatch.setattr(reduce, "allocating_stream", on("bucket"))
    monkeypatch.setattr(flat, "allocating_stream", on("unit"))
    _steps(stage)
    frees = allocated["bucket"] + allocated["unit"]
    assert allocated["bucket"] == 2 and (allocated["unit"] > 0) == (stage == 3)
    assert alloc.waited == [other] * frees
    streams.current = alloc  # the same stream: no wait
    before = len(alloc.waited)
    _steps(stage)
    assert len(alloc.waited) == before


@pytest.mark.parametrize("stage", [2, 3])
def test_cpu_steps_touch_no_stream(
    stage: int, streams: Streams, monkeypatch: pytest.MonkeyPatch
) -> None:
    def record_stream(self: torch.Tensor, stream: Any) -> None:
        raise AssertionError("record_stream on the CPU path")

    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
    _steps(stage)
    assert streams.calls == 0
