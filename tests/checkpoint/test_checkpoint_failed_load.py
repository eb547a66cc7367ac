"""A failed `checkpoint.load` of any kind changes nothing: the optimizer (states, params, step
count, hyper-parameters) and every RNG (torch, python, numpy) are bit-identical after it, and
`verify` refuses the same checkpoint (see [Note: transactional load] in checkpoint/_loading.py).

Each case edits one rank state of a real 1-rank checkpoint of a tiny model (milliseconds)."""

from __future__ import annotations

import base64
import io
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fusedzero import checkpoint as ck
from fusedzero.app.ckpt_cli import main as cli_main
from fusedzero.optim import ZeroAdamW

from _helpers import TINY_CKPT, copy_root, rewrite_shard, tiny_ckpt_opt, tiny_train, two_step_root


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import numpy  # noqa: F401 - saved states carry numpy's generator (rank_state.rng_state)

    return two_step_root(tmp_path_factory.mktemp("good"), lambda: tiny_ckpt_opt(TINY_CKPT))


def everything(opt: ZeroAdamW) -> list[Any]:
    """What a load may change, as exact values: every state buffer, every param, the step
    count, the hyper-parameters, and the torch, python and numpy RNG states."""
    st = opt.shard_state()
    out: list[Any] = [
        opt.step_count.clone(),
        torch.get_rng_state(),
        random.getstate(),
        repr(np.random.get_state(legacy=True)),
        [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
    ]
    for kind in ("master", "exp_avg", "exp_avg_sq"):
        out += [t.clone() for t in getattr(st, kind)]
    return out + [p.detach().clone() for p in opt.params]


def identical(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b)
    )


def edit_state(root: Path, fn: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite rank 0's packed state with `fn` applied to it (as a hostile editor would)."""
    f = ck.resolve(root) / ck.MANIFEST
    m = json.loads(f.read_text())
    st = torch.load(io.BytesIO(base64.b64decode(m["ranks"][0]["state"])), weights_only=True)
    fn(st)
    buf = io.BytesIO()
    torch.save(st, buf)
    m["ranks"][0]["state"] = base64.b64encode(buf.getvalue()).decode()
    f.write_text(json.dumps(m))


def _np(i: int, v: Any) -> Callable[[dict[str, Any]], None]:
    def f(st: dict[str, Any]) -> None:
        n = list(st["rng"]["numpy"])
        n[i] = v(n[i]) if callable(v) else v
        st["rng"]["numpy"] = tuple(n)

    return f


def _word(kind: str, value: int) -> Callable[[dict[str, Any]], None]:
    def f(st: dict[str, Any]) -> None:
        s = list(st["rng"][kind])
        s[1] = s[1].clone()
        s[1][5] = value
        st["rng"][kind] = tuple(s)

    return f


MALFORMED = [
    ("numpy key word 2**40", _word("numpy", 2**40), "state word 5 is 1099511627776"),
    ("numpy key word -1", _word("numpy", -1), "state word 5 is -1"),
    ("python word 2**40", _word("python", 2**40), "python generator's state word 5"),
    ("numpy generator name", _np(0, "PCG64"), "numpy generator is 'PCG64'"),
    ("numpy 3 words", _np(1, lambda k: k[:3]), "numpy generator has 3 state words"),
    ("numpy pos", _np(2, 10**6), "pos is 1000000"),
    ("numpy not a tuple", lambda st: st["rng"].update(numpy=7), "numpy state is not"),
    (
        "torch state cut",
        lambda st: st["rng"].update(torch=st["rng"]["torch"][:100]),
        "RNG state is malformed",
    ),
    (
        "cuda offset",
        lambda st: st["rng"].update(cuda=torch.tensor([0] * 8 + [1] + [0] * 7, dtype=torch.uint8)),
        "offset must be a multiple of 4",
    ),
    (
        "cuda size",
        lambda st: st["rng"].update(cuda=torch.zeros(5, dtype=torch.uint8)),
        "has 16 bytes, got 5",
    ),
    ("state not a dict", lambda st: st.update(rng=[1, 2]), "RNG state is malformed"),
]


@pytest.mark.parametrize("case, edit, words", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_a_malformed_rank_state_fails_the_load_and_changes_nothing(
    good: Path,
    tmp_path: Path,
    case: str,
    edit: Callable[[dict[str, Any]], None],
    words: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = copy_root(good, tmp_path)
    edit_state(root, edit)
    model, opt = tiny_ckpt_opt(TINY_CKPT)
    tiny_train(model, opt, 1, seed=7)
    before = everything(opt)
    with pytest.raises(ck.CheckpointError, match="ranks\\[0\\].state") as e:
        ck.load(opt, root)
    assert words in str(e.value), str(e.value)
    assert identical(everything(opt), before), f"{case}: the failed load changed something"
    with pytest.raises(ck.CheckpointError, match="RNG state is malformed"):
        ck.verify(root)
    assert cli_main(["ckpt", "verify", str(root)]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "RNG state is malformed" in out, out
    # resume: `latest` fails verification, so the previous step is taken, with the reason
    found = ck.find_latest(root)
    assert found.path.name == "step-00000001" and "RNG state is malformed" in found.skipped[0]


def _payload(root: Path) -> bytes:
    m = json.loads((ck.resolve(root) / ck.MANIFEST).read_text())
    return base64.b64decode(m["ranks"][0]["state"])


def test_byte_flips_in_a_packed_state_fail_whole_or_load_whole(good: Path, tmp_path: Path) -> None:
    """A flip in the high byte of a generator word (its storage located by its first words),
    and flips spread over the whole payload: each load either succeeds or raises
    CheckpointError with nothing changed."""
    payload = _payload(good)
    st = torch.load(io.BytesIO(payload), weights_only=True)
    flips = []
    for kind in ("numpy", "python"):
        words = st["rng"][kind][1]
        at = payload.find(words[:4].numpy().tobytes())
        assert at > 0, kind
        flips.append(at + 8 * 7 + 5)  # word 7, bits 40-47: past 32 bits
    flips += [int(i) for i in np.random.default_rng(0).integers(0, len(payload), 14)]
    root = copy_root(good, tmp_path)
    f = ck.resolve(root) / ck.MANIFEST
    text = f.read_text()
    model, opt = tiny_ckpt_opt(TINY_CKPT)
    tiny_train(model, opt, 1, seed=7)
    refused = 0
    for i in flips:
        bad = bytearray(payload)
        bad[i] ^= 0xFF
        m = json.loads(text)
        m["ranks"][0]["state"] = base64.b64encode(bytes(bad)).decode()
        f.write_text(json.dumps(m))
        before = everything(opt)
        try:
            ck.load(opt, root, verify=False)
        except ck.CheckpointError:
            refused += 1
            assert identical(everything(opt), before), f"flip at {i} changed something"
    assert refused >= 2


def _poison(root: Path, tensor: str, value: float) -> None:
    """Element 0 of shard tensor `tensor` set to `value`, the manifest's size and sha256
    updated to match (so only the value check can catch it)."""

    def edit(k: str, t: torch.Tensor) -> torch.Tensor:
        if k == tensor:
            t[0] = value
        return t

    rewrite_shard(ck.resolve(root), edit)


@pytest.mark.parametrize(
    "tensor, value",
    [
        ("fg0.master", float("nan")),
        ("fg1.exp_avg", float("inf")),
        ("fg0.exp_avg_sq", float("-inf")),
        ("fg0.exp_avg_sq", -1.0),
    ],
)
def test_non_finite_saved_states_fail_the_load_and_change_nothing(
    good: Path, tmp_path: Path, tensor: str, value: float
) -> None:
    root = copy_root(good, tmp_path)
    _poison(root, tensor, value)
    model, opt = tiny_ckpt_opt(TINY_CKPT)
    tiny_train(model, opt, 1, seed=7)
    before = everything(opt)
    kind = tensor.split(".")[1]
    with pytest.raises(
        ck.CheckpointError,
        match=rf"its {kind} \(buffer \d\) holds 1 value\(s\) "
        r"that are .*not finite, the first",
    ):
        ck.load(opt, root)
    assert identical(everything(opt), before)
