"""Tensor parallelism: the docs example runs as written at 4 gloo ranks (and its optimizer
saves a checkpoint), and a dp group that is not orthogonal to the tp mesh fails with a message
that says what to pass: one spawn for all of it (slow). README.md holds the same example, short.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from fusedzero.testing import run_ranks

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "tensor_parallel.md"
README = REPO / "README.md"


def doc_example(doc: Path = DOC) -> str:
    blocks = re.findall(r"```python slow nproc=4[^\n]*\n(.*?)```", doc.read_text(), flags=re.S)
    assert len(blocks) == 1, (
        f"{doc} should hold one ```python slow nproc=4 block, found {len(blocks)}"
    )
    return blocks[0]


def test_doc_example_is_short() -> None:
    """The 2-D example, in docs/tensor_parallel.md and README.md: under 15 lines, the same in
    both (the spawning test below runs the docs' copy)."""
    for doc in (DOC, README):
        lines = [ln for ln in doc_example(doc).splitlines() if ln.strip()]
        assert len(lines) < 15, (
            f"{doc.name}: the 2-D example has {len(lines)} lines; keep it under 15"
        )
    assert doc_example(README) == doc_example(DOC), (
        "README.md's 2-D example differs from docs/tensor_parallel.md's: keep one example"
    )


def _run(rank: int, world: int, code: str, tmp: str) -> dict:
    from torch.distributed.tensor import DTensor

    from fusedzero import checkpoint
    from fusedzero.optim import ZeroAdamW

    ns: dict = {"__name__": "__main__"}
    exec(compile(code, str(DOC), "exec"), ns)  # the block as written
    model, opt = ns["model"], ns["opt"]
    out: dict = {
        "step_count": float(opt.step_count),
        "dtensors": sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor)),
        "finite": all(
            bool(p.full_tensor().isfinite().all())
            if isinstance(p, DTensor)
            else bool(p.isfinite().all())
            for p in model.parameters()
        ),
    }
    checkpoint.save(opt, tmp, step=3)
    opt.close()
    try:  # the world group holds both ranks of every tp group: not a dp group
        ZeroAdamW(model.parameters(), module=model)
        out["world"] = "no error"
    except ValueError as e:
        out["world"] = str(e)
    return out


@pytest.mark.slow  # spawns 4 ranks
def test_doc_example_runs_and_boundaries(tmp_path: Path) -> None:
    results = run_ranks(_run, 4, doc_example(), str(tmp_path / "ckpt"), timeout=600)
    for rank, r in enumerate(results):
        assert r["step_count"] == 3.0, (rank, r)
        assert r["dtensors"] == ["0.bias", "0.weight", "2.bias", "2.weight"], (rank, r)
        assert r["finite"], rank
        assert "must be the data-parallel group" in r["world"], (rank, r["world"])
    root = tmp_path / "ckpt"
    assert sorted(p.name for p in root.iterdir()) == ["tensor_parallel.json", "tp0of2", "tp1of2"]
    assert all((root / t / "step-00000003").is_dir() for t in ("tp0of2", "tp1of2"))


def test_plain_model_keeps_one_buffer_kind() -> None:
    """A plain model: no tp info, every buffer tp-replicated, as before tensor parallelism."""
    from fusedzero.optim import ZeroAdamW

    m = torch.nn.Linear(5, 3)
    opt = ZeroAdamW(m.parameters(), stage=1, module=m)
    assert opt.tp is None
    assert [b.tp_replicated for b in opt.flat_groups] == [True]
    opt.close()
