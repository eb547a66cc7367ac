"""The defaults README.md and docs/train.md state are the CLI's and the library's (the
README once ran stage 1 where the CLI defaults to 2, and said params were bf16 on CPU where the
run is fp32). Each claim is read from the page's text; a reworded claim fails here by name."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

from fusedzero import ZeroAdamW
from fusedzero.app import preflight
from fusedzero.app.config import parse_args
from fusedzero.app.launch import local_ranks

REPO = Path(__file__).resolve().parents[2]


def _prose(page: str) -> str:
    return " ".join((REPO / page).read_text().split())  # line breaks as spaces


def _claim(page: str, pattern: str) -> re.Match[str]:
    m = re.search(pattern, _prose(page))
    assert m, f"{page} no longer says {pattern!r}: update the page's claim and this test together"
    return m


def _param_dtype(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, use_cuda: bool) -> torch.dtype:
    """The params' dtype of a default run, as the pre-flight disk check sizes its checkpoint
    (the ranks apply the same rule, fusedzero/app/loop.py)."""
    seen: list[torch.dtype] = []
    monkeypatch.setattr(preflight, "checkpoint_bytes", lambda c, w, dt: seen.append(dt) or 0)
    preflight.check_disk(parse_args(["--ckpt-dir", str(tmp_path)]), 2, use_cuda)
    return seen[0]


def test_readme_states_the_cli_and_library_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    ranks = _claim("README.md", r"a small GPT pretrained on (\d) local CPU ranks")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert local_ranks(parse_args([])) == (False, int(ranks.group(1)))
    # "bf16 params: precision=Precision(param_dtype=...)": by default the params keep their dtype.
    _claim("README.md", r"bf16 params: precision=Precision\(param_dtype=\.\.\.\)")
    assert inspect.signature(ZeroAdamW).parameters["precision"].default.param_dtype is None


def test_train_md_states_the_train_defaults(
    one_gpu: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = _claim(
        "docs/train.md",
        r"Defaults: stage (\d), (\d) gloo ranks on CPU \(NCCL, one rank "
        r"per GPU and (bf16) params on a GPU machine\), (\d+) layers x (\d+) wide, global "
        r"batch (\d+) x (\d+) bytes, (\d+) steps, cosine schedule with warmup, clip "
        r"([\d.]+)\.",
    )
    cfg = parse_args([])
    assert (
        cfg.stage,
        cfg.n_layer,
        cfg.n_embd,
        cfg.batch_size,
        cfg.block_size,
        cfg.steps,
        cfg.clip,
    ) == (int(m[1]), int(m[4]), int(m[5]), int(m[6]), int(m[7]), int(m[8]), float(m[9]))
    assert local_ranks(cfg) == (True, 1)  # one rank per GPU (one faked visible)
    assert _param_dtype(tmp_path, monkeypatch, use_cuda=True) == torch.bfloat16
    assert _param_dtype(tmp_path, monkeypatch, use_cuda=False) == torch.float32
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert local_ranks(cfg) == (False, int(m[2]))
    s = _claim(
        "docs/train.md",
        r"`--sample-tokens N` \(default (\d+), 0: none\).*?"
        r"`--temperature`, default ([\d.]+), 0: greedy; `--top-k`, default (\d+)\)",
    )
    assert (cfg.sample_tokens, cfg.temperature, cfg.top_k) == (int(s[1]), float(s[2]), int(s[3]))
