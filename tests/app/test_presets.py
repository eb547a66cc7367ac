"""`fusedzero train --preset`: the named shapes (GPT-2 sizes, a Llama-shaped 254M decoder),
their FLOPs per token, and MFU against a known bf16 peak (n/a on a CPU). All on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fusedzero.app import summary
from fusedzero.app.config import UsageError, parse_args
from fusedzero.app.model import GPT, PRESETS, CausalSelfAttention, GPTConfig, flops_per_token


def _meta(**cfg) -> GPT:
    with torch.device("meta"):
        return GPT(GPTConfig(**cfg))


def _linear_weights(model: GPT) -> int:
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_llama_254m_has_the_llama_matrices() -> None:
    m = _meta(**PRESETS["llama-254m"])
    # Llama's 254.2M: q, o 1024^2; k, v 1024 x 512; SwiGLU 3 x 1024 x 2816; embed + head 32000 x
    # 1024.
    assert (
        _linear_weights(m) + m.wte.weight.numel()
        == 16 * (2 * 1024**2 + 2 * 1024 * 512 + 3 * 1024 * 2816) + 2 * 32000 * 1024
    )
    assert m.lm_head.weight is not m.wte.weight  # untied
    assert tuple(m.blocks[0].attn.qkv.weight.shape) == (1024 + 2 * 512, 1024)
    assert tuple(m.blocks[0].mlp.fc.weight.shape) == (2 * 2816, 1024)
    # Beside Llama's matrices and embeddings (254,279,680): learned positions (1024 x 1024),
    # LayerNorm weight and bias where Llama has an RMSNorm weight, the attention output bias.
    assert m.num_params() == 254_279_680 + 1024 * 1024 + (2 * 16 + 1) * 2 * 1024 + 16 * 1024


def test_grouped_query_attention_equals_repeated_kv_heads() -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(n_embd=24, n_head=6, n_kv_head=2, block_size=8)
    attn = CausalSelfAttention(cfg)
    torch.nn.init.normal_(attn.qkv.weight)
    x = torch.randn(3, 8, 24)
    q, k, v = attn.qkv(x).split([24, 8, 8], dim=2)
    q = q.view(3, 8, 6, 4).transpose(1, 2)
    k, v = (t.view(3, 8, 2, 4).transpose(1, 2).repeat_interleave(3, dim=1) for t in (k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(3, 8, 24)
    torch.testing.assert_close(attn(x), attn.proj(y), rtol=1e-5, atol=1e-6)


def test_swiglu_untied_model_trains_and_inits_reproducibly() -> None:
    cfg = dict(
        n_layer=2,
        n_head=4,
        n_kv_head=2,
        n_embd=32,
        mlp="swiglu",
        mlp_hidden=40,
        vocab_size=50,
        block_size=16,
        tie_head=False,
    )
    torch.manual_seed(3)
    a = GPT(GPTConfig(**cfg))
    b = _meta(**cfg)
    b.to_empty(device="cpu")
    torch.manual_seed(3)
    b.init_weights()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    assert a.lm_head.weight.std() > 0.01 and a.blocks[0].mlp.fc.bias is None
    x = torch.randint(0, 50, (2, 16))
    a(x, x)[1].backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in a.parameters())


def test_bad_kv_heads_and_mlp_are_refused() -> None:
    with pytest.raises(ValueError, match="n_kv_head=3 must be >= 1 and divide n_head=4"):
        GPTConfig(n_head=4, n_kv_head=3)
    with pytest.raises(ValueError, match="mlp='relu'"):
        GPTConfig(mlp="relu")


def test_preset_flag_sets_the_shape_and_given_flags_override_it() -> None:
    cfg = parse_args(["--preset", "llama-254m", "--block-size", "256"]).model_config()
    assert cfg == {**PRESETS["llama-254m"], "block_size": 256}
    assert parse_args(["--preset", "gpt2"]).model_config() == PRESETS["gpt2"]
    assert parse_args([]).model_config() == {
        "n_layer": 2,
        "n_head": 4,
        "n_embd": 128,
        "block_size": 128,
    }
    with pytest.raises(UsageError, match="invalid choice: 'gpt3'"):
        parse_args(["--preset", "gpt3"])
    # Checked before any rank starts: one line naming the clash, not a rank's traceback.
    with pytest.raises(
        UsageError,
        match="--preset llama-254m with these shape flags: .*"
        "n_kv_head=8 must be >= 1 and divide n_head=4",
    ):
        parse_args(["--preset", "llama-254m", "--n-head", "4", "--n-embd", "64"])


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_flops_per_token_is_6_per_matmul_weight_plus_attention(name: str) -> None:
    c = GPTConfig(**PRESETS[name])
    m = _meta(**PRESETS[name])
    want = 6 * _linear_weights(m) + 12 * c.n_layer * c.block_size * c.n_embd
    assert flops_per_token(c) == want


def test_mfu_against_a_known_peak_and_n_a_elsewhere(monkeypatch) -> None:
    cuda = torch.device("cuda", 0)
    # Each variant before the name it contains (before: "H200 NVL" took the H200's 989 and
    # "L40" the L4's 121).
    for name, peak in (
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA GeForce GTX 1080", None),
        ("NVIDIA H200 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA L40", 181e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA L4", 121e12),
    ):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d, name=name: name)
        assert summary.bf16_peak(cuda) == (peak, name)
    assert summary.bf16_peak(torch.device("cpu")) == (None, "cpu")
    # 2 GPUs at 1e5 tokens/s of 1.5e9 FLOPs each: 1.5e14 / (2 * 989e12)
    assert summary.mfu(1e5, 1_500_000_000, 2, 989e12) == pytest.approx(0.0758341759)
    assert summary.mfu(1e5, 1_500_000_000, 2, None) is None
    row = summary._mfu_text({"mfu": None, "device": "cpu"})
    assert row == "MFU n/a: no bf16 peak for a CPU"
    row = summary._mfu_text(
        {
            "mfu": 0.4123,
            "device": "cuda",
            "world_size": 8,
            "device_name": "NVIDIA H100 80GB HBM3",
            "bf16_peak_flops": 989e12,
        }
    )
    assert row == "MFU 41.2% of 8 x NVIDIA H100 80GB HBM3 at 989 TFLOP/s bf16"


def test_loss_is_fp32_from_bf16_params() -> None:
    """The training loss in fp32 whatever the params' dtype (bf16 on GPUs): the cross-entropy of
    the fp32 logits. Before: computed in bf16, rounded inside the softmax and onto the bf16
    grid (7.4375 for 7.4639 in a 256-byte vocabulary)."""
    torch.manual_seed(0)
    m = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16)).to(torch.bfloat16)
    x = torch.randint(0, 256, (2, 16))
    y = torch.randint(0, 256, (2, 16))
    logits, loss = m(x, y)
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    want = F.cross_entropy(logits.float().reshape(32, -1), y.reshape(32))
    assert torch.equal(loss, want)
