"""What both integration tests share: the tiny Llama they train and the tolerances."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

DOC = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"

W, SEQ, VOCAB, LR = 2, 16, 64, 3e-3
STAGES = (0, 1, 2, 3)
# fp32 on both sides: the ranks' grads differ from DDP's only in summation order (~1e-7
# relative); Adam's 1/sqrt(v) can amplify that to ~lr * 1e-6 in elements with tiny grads, so
# the weights are held to 1e-3 of lr (tests/zero/test_zero.py's bound), the logged losses and
# norms (sums over many elements) to 1e-5 relative.
RTOL, ATOL = 1e-5, 1e-3 * LR


def tiny_llama() -> torch.nn.Module:
    """A 2-layer LlamaForCausalLM, hidden 32, the same init on every call."""
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
            tie_word_embeddings=False,
        )
    )


def tokens(n: int) -> torch.Tensor:
    """n random sequences, the same on every rank (the framework shards them)."""
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(7))


def run_doc_block(tested_by: str, cwd: str) -> dict[str, Any]:
    """Run docs/integrations.md's block fenced with `tested-by=<tested_by>`, as written, in
    `cwd` (made here) as `__main__`; returns its globals."""
    blocks = re.findall(
        rf"```python[^\n]* tested-by={re.escape(tested_by)}\n(.*?)```", DOC.read_text(), flags=re.S
    )
    assert len(blocks) == 1, f"docs/integrations.md should hold one block tested by {tested_by}"
    here = os.getcwd()
    os.makedirs(cwd, exist_ok=True)  # every rank runs it in the same folder
    os.chdir(cwd)
    try:
        ns: dict[str, Any] = {"__name__": "__main__"}
        exec(compile(blocks[0], str(DOC), "exec"), ns)
        return ns
    finally:
        os.chdir(here)
