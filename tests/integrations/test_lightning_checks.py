"""ZeroStrategy's checks that need no fit, fast (one process, no Trainer run): its constructor's
keywords and stage, and the clip-algorithm refusal's message.

About internals: ZeroStrategy.setup is called with a stand-in trainer (only the two clip
attributes it reads before anything else)."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

pytest.importorskip(
    "lightning", reason="needs the 'lightning' extra: pip install 'fusedzero[lightning]'"
)

from lightning.pytorch.utilities import GradClipAlgorithmType  # noqa: E402

from fusedzero.integrations.lightning import ZeroStrategy  # noqa: E402


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"param_dtype": torch.bfloat16},
            r"^ZeroStrategy got param_dtype=: it moved, "
            r"use precision=Precision\(param_dtype=...\)$",
        ),
        ({"unit_policy": nn.Linear}, r"^ZeroStrategy got unit_policy=: it moved, use sharding="),
        ({"stage": True}, r"^ZeroStrategy\(stage=True\): expected an int 0, 1, 2 or 3"),
        ({"stage": 2.0}, r"^ZeroStrategy\(stage=2.0\): expected an int 0, 1, 2 or 3"),
    ],
)
def test_the_constructor_names_moved_keywords_and_bad_stages(kwargs: dict, match: str) -> None:
    """Refused when the strategy is built (not at fit), naming the record a moved keyword
    lives in now, where "unexpected keyword" was printed (and stage=True taken as stage 1)."""
    with pytest.raises(TypeError, match=match):
        ZeroStrategy(**kwargs)


def test_clip_by_value_is_refused_with_a_plain_value() -> None:
    """Lightning holds the algorithm as an enum: the message prints 'value', not its repr."""
    trainer = types.SimpleNamespace(
        gradient_clip_algorithm=GradClipAlgorithmType("value"), gradient_clip_val=1.0
    )
    with pytest.raises(ValueError) as info:
        ZeroStrategy(stage=2).setup(trainer)  # type: ignore[arg-type]
    assert str(info.value) == (
        "ZeroStrategy clips by norm only (gradient_clip_algorithm='value'); use 'norm'"
    )
