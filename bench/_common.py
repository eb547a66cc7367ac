"""Helpers the benchmark subjects share (importable: pytest puts bench/ on sys.path)."""

from __future__ import annotations

from typing import Any

import torch


def percentiles(xs: list[float]) -> dict[str, float]:
    """median, p20, p80 (linear interpolation), min, max of `xs`."""
    t = torch.tensor(xs, dtype=torch.float64)
    q = torch.quantile(t, torch.tensor([0.2, 0.5, 0.8], dtype=torch.float64)).tolist()
    return {"p20": q[0], "median": q[1], "p80": q[2], "min": min(xs), "max": max(xs), "n": len(xs)}


class _ReplayTimer:
    """A clock that makes each round of `benchmark.pedantic` last exactly one recorded duration.

    pytest-benchmark times a callable in this process; a multi-rank step is timed inside the
    spawned ranks instead. Replaying those durations through the fixture's timer puts them in
    pytest-benchmark's own statistics (table, --benchmark-json, --benchmark-compare).
    """

    def __init__(self, durations: list[float]) -> None:
        self._ticks: list[float] = []
        now = 0.0
        for d in durations:
            self._ticks += [now, now + d]
            now += d
        self._i = 0

    def __call__(self) -> float:
        t = self._ticks[self._i]
        self._i += 1
        return t


def replay(benchmark: Any, durations: list[float]) -> None:
    """Record `durations` (seconds, measured elsewhere) as the rounds of `benchmark`."""
    if not durations:
        raise ValueError("no durations to record")
    if not hasattr(benchmark, "_timer"):  # pytest-benchmark internals moved: keep extra_info
        benchmark.pedantic(lambda: None, rounds=1)
        return
    benchmark._timer = _ReplayTimer(durations)
    benchmark.pedantic(lambda: None, rounds=len(durations), iterations=1)


def add_stats(benchmark: Any) -> None:
    """Put median/p20/p80 of the recorded rounds into extra_info (pytest-benchmark has no p20)."""
    data = list(benchmark.stats.stats.data)
    benchmark.extra_info.update({f"time_{k}": v for k, v in percentiles(data).items()})


SUMMARY: list[str] = []
"""Lines printed at the end of the session (e.g. fusedzero / torch fused ratios)."""
