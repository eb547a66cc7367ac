"""A transformers model from the meta device, initialised by its own `_init_weights` at stage 3
on each rank's elements only (fusedzero/_shard_init.py): the same values at W = 1 and on each of
4 emulated ranks, with the config's distributions.

About an internal: fusedzero._layout."""

from __future__ import annotations

import pytest
import torch

from fusedzero import FullUnitInit, Sharding, ZeroAdamW
from fusedzero._layout import ALIGN
from fusedzero.emulate import fake_group

transformers = pytest.importorskip("transformers", reason="needs the 'hf' extra")
pytestmark = pytest.mark.slow  # importing transformers takes seconds


def _llama_config(**overrides: object) -> transformers.LlamaConfig:
    """A two-layer Llama small enough for the fast path of every test here."""
    kw: dict[str, object] = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    return transformers.LlamaConfig(**kw)


CONFIGS = {
    "llama": lambda: transformers.LlamaForCausalLM(_llama_config()),
    "gpt2": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=16)
    ),
    # transformers.initialization.trunc_normal_ (its own reference to torch's): ViT, DINOv2.
    "vit": lambda: transformers.ViTModel(
        transformers.ViTConfig(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            image_size=16,
            patch_size=8,
        )
    ),
}


def _shards(kind: str, W: int, rank: int) -> tuple[dict[str, torch.Tensor], list]:
    """(full values at W=1, or {}), and this rank's (name, start, values) runs."""
    with torch.device("meta"):
        model = CONFIGS[kind]()
    kw = dict(
        stage=3,
        module=model,
        device="cpu",
        sharding=Sharding(
            bucket_numel=W * ALIGN, param_init_fn=lambda name, m: model._init_weights(m)
        ),
    )
    torch.manual_seed(3)
    if W == 1:
        opt = ZeroAdamW(model.parameters(), **kw)
    else:
        with fake_group(rank, W):
            opt = ZeroAdamW(model.parameters(), **kw)
    runs = []
    for buf in opt.flat_groups:
        for seg in buf.layout.segments(buf.shard_rank):
            name = next(s.name for s in buf.layout.params if s.index == seg.param)
            runs.append((name, seg.start, buf.param_shard[seg.local : seg.local + seg.length]))
    full = {}
    if W == 1:
        with opt.gathered_params():
            full = {n: p.detach().reshape(-1).clone() for n, p in model.named_parameters()}
    return full, runs


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_hf_init_weights_on_local_shards_is_the_same_at_w_1_and_4(kind: str) -> None:
    full, _ = _shards(kind, 1, 0)
    std = 0.02  # every config's initializer_range
    for name, v in full.items():
        if name.endswith(("norm.weight", "ln_1.weight", "ln_2.weight", "ln_f.weight")):
            assert torch.equal(v, torch.ones_like(v)), name
        elif name.endswith("bias"):
            assert torch.equal(v, torch.zeros_like(v)), name
        elif v.numel() >= 1024 and "c_proj" not in name:  # GPT-2 scales c_proj down
            assert abs(v.std().item() - std) < 0.15 * std, name
    held = 0
    for r in range(4):
        for name, start, got in _shards(kind, 4, r)[1]:
            assert torch.equal(got, full[name][start : start + got.numel()]), (kind, r, name)
            held += got.numel()
    assert held == sum(v.numel() for v in full.values())


@pytest.mark.parametrize("full_unit", [False, True], ids=["local", "full_unit"])
def test_tied_llama_keeps_the_embedding_s_init_and_its_rotary_buffers(full_unit: bool) -> None:
    """A tied LlamaForCausalLM from the meta device: the shared weight is the embedding's
    init (padding row zero), not the lm_head's over it, and `_init_weights` fills the rotary
    buffers with an eager build's values (so they pass the unwritten-buffer check)."""
    cfg = _llama_config(tie_word_embeddings=True, pad_token_id=0)
    eager = transformers.LlamaForCausalLM(cfg)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    fn = lambda name, m: model._init_weights(m)  # noqa: E731
    torch.manual_seed(0)
    opt = ZeroAdamW(
        model.parameters(),
        stage=3,
        module=model,
        device="cpu",
        sharding=Sharding(param_init_fn=FullUnitInit(fn) if full_unit else fn),
    )
    with opt.gathered_params():
        w = model.model.embed_tokens.weight.detach().clone()
    assert torch.equal(w[0], torch.zeros(32))
    assert abs(w[1:].std().item() - 0.02) < 0.15 * 0.02  # 2016 draws: the std's error ~1.6%
    want = dict(eager.named_buffers())
    got = dict(model.named_buffers())
    assert got.keys() == want.keys() and got
    for n, b in got.items():
        assert torch.equal(b, want[n]), n
