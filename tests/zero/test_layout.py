"""Flat-layout geometry (fusedzero/_layout.py): padding bounds over many world sizes and buckets.

About an internal: fusedzero._layout."""

from __future__ import annotations

import math
import random

import pytest

from fusedzero._layout import ALIGN, build_layout, round_up


def _check_bounds(shapes: list[tuple[int, ...]], W: int, bucket: int) -> None:
    L = build_layout([(i, f"p{i}", s) for i, s in enumerate(shapes)], W, bucket)
    what = f"W={W} bucket_numel={bucket} shapes={shapes[:4]}..."
    unit = W * ALIGN
    assert L.bucket_numel % unit == 0, what
    # Buckets never exceed the request rounded to whole aligned shards, and there are no more
    # of them than that rounded size needs: the count is taken after rounding.
    assert L.bucket_numel <= round_up(bucket, unit), what
    assert L.num_buckets == math.ceil(L.numel / round_up(bucket, unit)), what
    holes = L.numel - L.param_numel  # each param's start rounded up to ALIGN
    assert holes <= len(shapes) * (ALIGN - 1), what
    tail = L.padded_numel - L.numel
    assert 0 <= tail < L.num_buckets * unit, what
    # Whatever the request, padding is at most one aligned shard row per element row: never
    # more than the params themselves plus one bucket row (was 9x the params at W=8, bucket 100).
    assert L.padded_numel - L.param_numel <= L.param_numel + unit + holes, what
    # Every param element is placed inside the padded buffer.
    assert L.params[-1].offset + L.params[-1].numel <= L.padded_numel, what


def test_issue_case_million_params_w8_bucket_100_pads_under_one_row() -> None:
    L = build_layout([(0, "w", (1000, 1000))], 8, 100)
    assert L.bucket_numel == 8 * ALIGN
    assert L.num_buckets == math.ceil(1_000_000 / (8 * ALIGN))
    assert L.padded_numel - 1_000_000 < 8 * ALIGN, (
        f"{L.padded_numel - 1_000_000} padding elements for a 1M param (was ~9M)"
    )


@pytest.mark.parametrize("W", [1, 2, 3, 7, 8, 64, 129, 1000, 1024])
def test_padding_bounded_for_any_bucket_numel(W: int) -> None:
    rng = random.Random(W)
    unit = W * ALIGN
    buckets = [1, 100, unit - 1, unit, unit + 1, 3 * unit - 5, 1 << 20, 1 << 25, 10**9]
    for _ in range(12):
        shapes: list[tuple[int, ...]] = []
        for _ in range(rng.randint(1, 6)):
            shapes.append(
                rng.choice(
                    [
                        (rng.randint(1, 300),),
                        (rng.randint(1, 3000), 7),
                        (rng.randint(1, 5000), rng.randint(1, 500)),
                        (),
                    ]
                )
            )
        for bucket in buckets + [rng.randint(1, 4 * unit)]:
            _check_bounds(shapes, W, bucket)
