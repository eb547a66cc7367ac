"""The RNG states a checkpoint carries: they round-trip through pack/unpack (weights-only) and
restore every generator exactly, in today's form (state words as int64 tensors) and in the form
of checkpoints saved before (lists of ints)."""
from __future__ import annotations

import random

import numpy as np
import torch

from fusedzero.checkpoint.rank_state import (check_rng_state, pack, rng_state, set_rng_state,
                                             unpack)


def _draws() -> tuple:
    return random.random(), torch.rand(3).tolist(), np.random.rand(2).tolist()


def test_rng_state_round_trips_and_restores_every_generator() -> None:
    random.seed(1)
    torch.manual_seed(2)
    np.random.seed(3)
    _draws()  # not at a fresh seed: mid-stream positions
    st = unpack(pack(rng_state()))
    want = _draws()
    # The words are one tensor each, not 625 Python ints for the unpickler to walk.
    assert isinstance(st["python"][1], torch.Tensor) and st["python"][1].dtype == torch.int64
    assert isinstance(st["numpy"][1], torch.Tensor)
    check_rng_state(st, "here")
    set_rng_state(st)
    assert _draws() == want


def test_rng_state_saved_as_lists_still_restores() -> None:
    random.seed(4)
    np.random.seed(5)
    st = rng_state()
    old = dict(st, python=(st["python"][0], st["python"][1].tolist(), st["python"][2]),
               numpy=(st["numpy"][0], st["numpy"][1].tolist(), *st["numpy"][2:]))
    want = _draws()
    st = unpack(pack(old))
    check_rng_state(st, "here")
    set_rng_state(st)
    assert _draws() == want
