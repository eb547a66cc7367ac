"""The RNG states a checkpoint carries: they round-trip through pack/unpack (weights-only) and
restore every generator exactly, in today's form (state words as int64 tensors) and in the form
of checkpoints saved before (lists of ints).

About an internal: fusedzero.checkpoint._rank_state."""

from __future__ import annotations

import random

import numpy as np
import torch

from fusedzero.checkpoint._rank_state import check_rng_state, pack, rng_state, set_rng_state, unpack


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
    old = dict(
        st,
        python=(st["python"][0], st["python"][1].tolist(), st["python"][2]),
        numpy=(st["numpy"][0], st["numpy"][1].tolist(), *st["numpy"][2:]),
    )
    want = _draws()
    st = unpack(pack(old))
    check_rng_state(st, "here")
    set_rng_state(st)
    assert _draws() == want


def _cuda(v: int) -> torch.Tensor:
    """A CUDA generator state as torch writes it: seed (8 bytes), then an offset that is a
    multiple of 4 (torch.cuda.set_rng_state refuses others)."""
    return torch.tensor([v] * 8 + [4 * v] + [0] * 7, dtype=torch.uint8)


def test_cuda_state_is_the_own_gpus_and_one_saved_for_8_gpus_restores_on_2(monkeypatch) -> None:
    """See [Note: one GPU's RNG state per rank], on a stand-in for torch.cuda: 2 visible GPUs, this
    rank on GPU 1. A state holds GPU 1's generator only and restores into it; a state saved
    before, with every GPU of an 8-GPU machine, restores its entry 1 (before: IndexError on
    GPU 2, after the optimizer was loaded). A malformed CUDA state fails the check."""
    import pytest

    from fusedzero.checkpoint import CheckpointError

    gens = {0: torch.zeros(16, dtype=torch.uint8), 1: _cuda(7)}

    def index(device: object) -> int:
        i = 1 if device == "cuda" else int(device)  # type: ignore[call-overload]
        if i not in gens:
            raise IndexError("tuple index out of range")  # torch's default_generators[i]
        return i

    def get_gpu_state(device: object = "cuda") -> torch.Tensor:
        return gens[index(device)].clone()

    def set_gpu_state(state: torch.Tensor, device: object = "cuda") -> None:
        gens[index(device)] = state.clone()

    for mod in (torch.cuda, torch.cuda.random):
        monkeypatch.setattr(mod, "get_rng_state", get_gpu_state)
        monkeypatch.setattr(mod, "set_rng_state", set_gpu_state)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    st = unpack(pack(rng_state()))
    assert torch.equal(st["cuda"], _cuda(7))
    gens[1] = torch.zeros(16, dtype=torch.uint8)
    check_rng_state(st, "here")
    set_rng_state(st)
    assert torch.equal(gens[1], _cuda(7)) and gens[0].eq(0).all()
    old = dict(st, cuda=[_cuda(g) for g in range(8)])
    check_rng_state(old, "here")
    set_rng_state(old)
    assert torch.equal(gens[1], _cuda(1)) and gens[0].eq(0).all()
    with pytest.raises(CheckpointError, match="CUDA generator state"):
        check_rng_state(dict(st, cuda="not a state"), "here")
