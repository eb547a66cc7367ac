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

from fusedzero.checkpoint._manifest import CheckpointError


def rng_state() -> dict[str, Any]:
    # The Mersenne Twister words (624 + position) as int64 tensors, not lists of ints: a tensor
    # loads as one storage, a list as 625 objects through the weights-only unpickler (~7 ms a
    # rank state, which rank 0 pays for every rank at every save). Older states hold lists.
    version, words, gauss = random.getstate()
    st: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": (version, torch.tensor(words, dtype=torch.int64), gauss),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state()  # See [Note: one GPU's RNG state per rank]
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        st["numpy"] = (
            name,
            torch.tensor(keys.tolist(), dtype=torch.int64),
            int(pos),
            int(has_gauss),
            float(cached),
        )
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
        np.random.set_state((name, np.array(_words(keys), dtype=np.uint32), pos, has_gauss, cached))


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
        why = next(
            (ln.strip() for ln in str(e).splitlines() if "GLOBAL" in ln or "Unsupported" in ln),
            type(e).__name__,
        )
        raise CheckpointError(
            f"{what} is refused: only tensors, numbers, strings, lists, tuples and dicts are "
            f"loaded from a checkpoint, never objects that would run code ({why[:200]})"
        ) from None


def check_rng_state(st: Any, where: str) -> None:
    """Every check `set_rng_state` would make, made first on scratch generators and by form: a
    malformed state (a key word out of range, another generator's name, a wrong word count, a
    byte flipped in its base64) fails here, before anything was changed, not half-way through
    the commit (see [Note: transactional load] in _loading.py)."""
    try:
        if not isinstance(st, dict):
            raise TypeError(f"expected a dict, got {type(st).__name__}")
        torch.Generator().set_state(st["torch"])
        py = st["python"]
        if not isinstance(py, (tuple, list)) or len(py) != 3:
            raise ValueError("the python state is not (version, words, gauss)")
        # random.setstate truncates a word past 32 bits silently: checked here.
        _check_words(_words(py[1]), 625, "python", last=(0, 625))
        random.Random().setstate((py[0], _words(py[1]), py[2]))
        cuda = st.get("cuda", [])  # one state, or (saved before) one per visible GPU
        for t in cuda if isinstance(cuda, (list, tuple)) else [cuda]:
            _check_cuda(t)
        if "numpy" in st:
            _check_numpy(st["numpy"])
    except Exception as e:  # noqa: BLE001
        msg = " ".join(str(e).split())
        raise CheckpointError(
            f"{where}: RNG state is malformed ({type(e).__name__}: {msg[:200]})"
        ) from None


# The words of a Mersenne Twister state, Python's and numpy's: 624 of 32 bits (Python's
# state appends its position, 0..624).
_MT_WORDS = 624


def _check_words(
    words: tuple[Any, ...], n: int, what: str, last: tuple[int, int] | None = None
) -> None:
    if len(words) != n:
        raise ValueError(f"the {what} generator has {len(words)} state words, expected {n}")
    for i, w in enumerate(words):
        lo, hi = last if last is not None and i == n - 1 else (0, 1 << 32)
        if isinstance(w, bool) or not isinstance(w, int) or not lo <= w < hi:
            raise ValueError(
                f"the {what} generator's state word {i} is {str(w)[:24]}, "
                f"expected an integer in [{lo}, {hi})"
            )


def _check_cuda(t: Any) -> None:
    """A CUDA generator state: 16 bytes, seed then offset, the offset a multiple of 4 (what
    torch.cuda.set_rng_state checks), or 8 (the seed alone, older torch)."""
    if not (isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1):
        raise TypeError(
            f"a CUDA generator state is a 1-D uint8 tensor, got "
            f"{type(t).__name__} {getattr(t, 'dtype', '')}"
        )
    if t.numel() not in (8, 16):
        raise ValueError(f"a CUDA generator state has 16 bytes, got {t.numel()}")
    if t.numel() == 16 and int.from_bytes(bytes(t[8:].tolist()), "little") % 4:
        raise ValueError("a CUDA generator state's offset must be a multiple of 4")


def _check_numpy(st: Any) -> None:
    """numpy's legacy state: ('MT19937', 624 words, pos, has_gauss, cached_gaussian)."""
    if not isinstance(st, (tuple, list)) or len(st) != 5:
        raise ValueError("the numpy state is not (name, keys, pos, has_gauss, cached_gaussian)")
    name, keys, pos, has_gauss, cached = st
    if name != "MT19937":
        raise ValueError(f"the numpy generator is {str(name)[:24]!r}, expected 'MT19937'")
    _check_words(_words(keys), _MT_WORDS, "numpy")
    for v, what, hi in ((pos, "pos", _MT_WORDS + 1), (has_gauss, "has_gauss", 2)):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < hi:
            raise ValueError(
                f"the numpy state's {what} is {str(v)[:24]}, expected an integer in [0, {hi})"
            )
    if isinstance(cached, bool) or not isinstance(cached, (int, float)):
        raise ValueError(f"the numpy state's cached_gaussian is {type(cached).__name__}")
    np = sys.modules.get("numpy")
    if np is not None:  # and numpy's own checks, on a scratch generator
        np.random.RandomState().set_state(
            (name, np.array(_words(keys), dtype=np.uint32), pos, has_gauss, cached)
        )


def decode(s: str, where: str, check_rng: bool = True) -> dict[str, Any]:
    """A rank's packed state, unpacked (weights-only) and checked: a dict, its RNG states
    with `check_rng_state`. CheckpointError names `where` otherwise."""
    state = unpack(s, where)
    if not isinstance(state, dict):
        raise CheckpointError(f"{where} is a {type(state).__name__}, expected a dict")
    if check_rng and "rng" in state:
        check_rng_state(state["rng"], where)
    return state
