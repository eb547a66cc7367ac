"""Per-rank state a checkpoint carries besides the optimizer: the caller's state and the RNG
states, packed with torch.save and read back with weights_only=True (a manifest is data: it must
never run code when read).

[Note: one GPU's RNG state per rank] A rank draws from its own GPU's generator only: a state
holds that one (the current device's), restored into the current device. States saved before held
every visible GPU's (`get_rng_state_all`), whose restore indexed GPUs the resuming machine may not
have (fewer GPUs, one visible per process: an IndexError after the optimizer was loaded): the entry
of the current device is taken, where there is one.
"""
from __future__ import annotations

import base64
import io
import random
import sys
from typing import Any

import torch

from fusedzero.checkpoint.manifest import CheckpointError


def rng_state() -> dict[str, Any]:
    # The Mersenne Twister words (624 + position) as int64 tensors, not lists of ints: a tensor
    # loads as one storage, a list as 625 objects through the weights-only unpickler (~7 ms a
    # rank state, which rank 0 pays for every rank at every save). Older states hold lists.
    version, words, gauss = random.getstate()
    st: dict[str, Any] = {"torch": torch.get_rng_state(),
                          "python": (version, torch.tensor(words, dtype=torch.int64), gauss)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state()  # See [Note: one GPU's RNG state per rank]
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        st["numpy"] = (name, torch.tensor(keys.tolist(), dtype=torch.int64), int(pos),
                       int(has_gauss), float(cached))
    return st


def set_rng_state(st: dict[str, Any]) -> None:
    torch.set_rng_state(st["torch"])
    py = st["python"]
    random.setstate((py[0], _words(py[1]), py[2]))
    cuda = _own_cuda_state(st)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)
    np = sys.modules.get("numpy")
    if "numpy" in st and np is not None:
        name, keys, pos, has_gauss, cached = st["numpy"]
        np.random.set_state((name, np.array(_words(keys), dtype=np.uint32), pos, has_gauss,
                             cached))


def _own_cuda_state(st: dict[str, Any]) -> torch.Tensor | None:
    """This rank's GPU's entry of a saved CUDA RNG state (see
    [Note: one GPU's RNG state per rank])."""
    saved = st.get("cuda")
    if saved is None or not torch.cuda.is_available():
        return None
    if isinstance(saved, torch.Tensor):
        return saved
    i = torch.cuda.current_device()
    return saved[i] if i < len(saved) else None


def _words(x: Any) -> tuple[int, ...]:
    """A generator's state words: an int64 tensor, or a list (states saved before)."""
    return tuple(x.tolist() if isinstance(x, torch.Tensor) else x)


def pack(obj: Any) -> str:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return base64.b64encode(buf.getvalue()).decode()


def unpack(s: str, what: str = "state") -> Any:
    # weights_only: a manifest is data, it must not run code when read.
    try:
        return torch.load(io.BytesIO(base64.b64decode(s, validate=True)), weights_only=True)
    except Exception as e:  # noqa: BLE001 - binascii, pickle and torch all raise their own
        # Not torch's own text: it suggests weights_only=False, i.e. running the payload.
        why = next((ln.strip() for ln in str(e).splitlines()
                    if "GLOBAL" in ln or "Unsupported" in ln), type(e).__name__)
        raise CheckpointError(
            f"{what} is refused: only tensors, numbers, strings, lists, tuples and dicts are "
            f"loaded from a checkpoint, never objects that would run code ({why[:200]})"
        ) from None


def check_rng_state(st: Any, where: str) -> None:
    """Apply the saved RNG states to scratch generators: a malformed one fails here, before
    anything was changed, not half-way through the commit."""
    try:
        torch.Generator().set_state(st["torch"])
        py = st["python"]
        random.Random().setstate((py[0], _words(py[1]), py[2]))
        cuda = st.get("cuda", [])  # one state, or (saved before) one per visible GPU
        for t in cuda if isinstance(cuda, (list, tuple)) else [cuda]:
            if not (isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1):
                raise TypeError(f"a CUDA generator state is a 1-D uint8 tensor, got "
                                f"{type(t).__name__} {getattr(t, 'dtype', '')}")
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{where}: RNG state is malformed ({type(e).__name__}: {e})"
                              ) from None
