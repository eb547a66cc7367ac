"""Exposed communication of a step, from a profiler's device timeline (no torch needed here).

A step's communication is *exposed* where a collective kernel runs and no compute kernel does:
the time communication adds to the step beyond what overlapping with compute hides. Given the device
kernels of some
steps as (start, end, name) intervals, `exposed_fraction` is the measure of (communication
minus compute) divided by the span of the steps. Collectives are NCCL's kernels ("nccl" in the
name: `ncclDevKernel_AllGather_RING_LL`, ...).
"""

from __future__ import annotations

from collections.abc import Iterable

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same points."""
    out: list[list[float]] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def measure(intervals: Iterable[Interval]) -> float:
    return sum(b - a for a, b in union(intervals))


def minus(a: Iterable[Interval], b: Iterable[Interval]) -> float:
    """Measure of the points in `a` not in `b`."""
    ua, ub = union(a), union(b)
    inter, j = 0.0, 0
    for x0, x1 in ua:
        while j < len(ub) and ub[j][1] <= x0:
            j += 1
        k = j
        while k < len(ub) and ub[k][0] < x1:
            inter += min(x1, ub[k][1]) - max(x0, ub[k][0])
            k += 1
    return measure(ua) - inter


def is_collective(name: str) -> bool:
    return "nccl" in name.lower()


def exposed_fraction(
    kernels: Iterable[tuple[float, float, str]], span: float | None = None
) -> dict[str, float]:
    """Communication time no compute kernel overlaps, over the span of the kernels (or `span`,
    the measured wall time of the same steps)."""
    ks = list(kernels)
    comm = [(a, b) for a, b, n in ks if is_collective(n)]
    comp = [(a, b) for a, b, n in ks if not is_collective(n)]
    if span is None:
        span = (max(b for _, b, _ in ks) - min(a for a, _, _ in ks)) if ks else 0.0
    exposed = minus(comm, comp)
    return {
        "comm": measure(comm),
        "compute": measure(comp),
        "exposed": exposed,
        "span": span,
        "exposed_fraction": exposed / span if span > 0 else 0.0,
    }
