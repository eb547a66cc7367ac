"""A small byte-level GPT (pre-LayerNorm, tied embeddings) used to train and test the optimizer.

The model is deliberately plain: the library is about the optimizer, so the model only has to be
a realistic mix of parameter shapes (2-D matrices, 1-D biases and LayerNorm weights, one tied
weight) that trains quickly on a CPU or a single GPU.

Initialisation draws from torch's global RNG and nothing else, in a fixed order, so
``torch.manual_seed(s); GPT(cfg)`` is reproducible, and a model built on the meta device can be
materialised to the same weights with ``model.to_empty(device=...); torch.manual_seed(s);
model.init_weights()``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# GPT-2's initialisation scale for every weight matrix and embedding.
INIT_STD = 0.02


@dataclass(kw_only=True)
class GPTConfig:
    """Shape of a :class:`GPT`. Validated at construction. The defaults are `fusedzero
    train`'s model, so ``GPT(GPTConfig())`` loads what ``fusedzero ckpt export`` writes of a
    default run."""

    vocab_size: int = 256
    """Number of token ids; 256 because the corpus is raw bytes."""
    block_size: int = 128
    """Longest sequence the model accepts (size of the position embedding)."""
    n_layer: int = 2
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int = 128
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention and residual branches (training only)."""
    n_kv_head: int | None = None
    """Key/value heads (grouped-query attention); None: n_head (plain multi-head)."""
    mlp: str = "gelu"
    """"gelu": fc 4x, GELU, proj (GPT-2); "swiglu": silu(x W1) * (x W3), then W2, no biases
    (Llama)."""
    mlp_hidden: int | None = None
    """Hidden width of the MLP; None: 4 * n_embd."""
    tie_head: bool = True
    """Output head shares the token embedding's weight (GPT-2); False: its own (Llama)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)} must be >= 1")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                f"head size n_embd/n_head must be an integer"
            )
        kv = self.kv_heads
        if kv < 1 or self.n_head % kv != 0:
            raise ValueError(
                f"GPTConfig.n_kv_head={self.n_kv_head} must be >= 1 and divide "
                f"n_head={self.n_head} (each kv head serves n_head/n_kv_head heads)"
            )
        if self.mlp not in ("gelu", "swiglu"):
            raise ValueError(f"GPTConfig.mlp={self.mlp!r}, expected 'gelu' or 'swiglu'")
        if self.mlp_hidden is not None and self.mlp_hidden < 1:
            raise ValueError(f"GPTConfig.mlp_hidden={self.mlp_hidden} must be >= 1")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout={self.dropout} must be in [0, 1)")

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def hidden(self) -> int:
        return 4 * self.n_embd if self.mlp_hidden is None else self.mlp_hidden


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention on top of ``F.scaled_dot_product_attention``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.kv_heads
        self.dropout = config.dropout
        # One matmul for q, k and v together, split afterwards (k and v: n_kv_head heads each).
        # No qkv bias: the key bias cannot change softmax, so its exact gradient is zero and Adam
        # would turn rounding noise in it into full-size, sign-random updates.
        kv_width = config.n_embd // config.n_head * self.n_kv_head
        self.qkv = nn.Linear(config.n_embd, config.n_embd + 2 * kv_width, bias=False)
        # Output projection into the residual stream; GPT.init_weights scales its init down.
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        qkv = self.qkv(x)
        hs = C // self.n_head
        # Under tensor parallelism qkv holds this rank's heads only (fusedzero/app/tp_plan.py):
        # the head counts are the local ones (tp = full width / local width).
        tp = hs * (self.n_head + 2 * self.n_kv_head) // qkv.shape[-1]
        nh, nkv = self.n_head // tp, self.n_kv_head // tp
        q, k, v = qkv.split([hs * nh, hs * nkv, hs * nkv], dim=2)
        # (B, T, heads * hs) -> (B, heads, T, hs), the layout SDPA expects.
        q = q.view(B, T, nh, hs).transpose(1, 2)
        k, v = (t.view(B, T, nkv, hs).transpose(1, 2) for t in (k, v))
        gqa = {"enable_gqa": True} if nkv != nh else {}
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True, **gqa
        )
        y = y.transpose(1, 2).reshape(B, T, nh * hs)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network: expand (4x by default), GELU, project back; or SwiGLU
    (`mlp="swiglu"`): `fc` holds W1 and W3 stacked, silu(x W1) * (x W3), project back."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.swiglu = config.mlp == "swiglu"
        h, bias = config.hidden, not self.swiglu
        self.fc = nn.Linear(config.n_embd, 2 * h if self.swiglu else h, bias=bias)
        self.gelu = nn.GELU()
        # Output projection into the residual stream; GPT.init_weights scales its init down.
        self.proj = nn.Linear(h, config.n_embd, bias=bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = self.fc(x).chunk(2, dim=-1)
            return self.dropout(self.proj(F.silu(gate) * up))
        return self.dropout(self.proj(self.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer language model; the output head is tied to the token embedding
    unless `tie_head=False`. With `n_kv_head`, `mlp="swiglu"` and an untied head it has a Llama
    block's matrices (pre-LayerNorm and learned positions stay: not RMSNorm and RoPE)."""

    blocks: nn.ModuleList  # of Block

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        # The stock nn.Linear/nn.Embedding constructors draw their own default init from the RNG.
        # Building the submodules on the meta device skips those draws, so init_weights() is the
        # only consumer of the RNG and an eager build matches a meta build + init_weights().
        # get_default_device() honours an enclosing `with torch.device(...)` (meta included).
        device = torch.get_default_device()
        with torch.device("meta"):
            # `_weight=` skips nn.Embedding's own normal_() init: on the meta device that call
            # goes through torch._refs and imports torch._dynamo (seconds per process).
            self.wte = nn.Embedding(
                config.vocab_size,
                config.n_embd,
                _weight=torch.empty(config.vocab_size, config.n_embd),
            )
            self.wpe = nn.Embedding(
                config.block_size,
                config.n_embd,
                _weight=torch.empty(config.block_size, config.n_embd),
            )
            self.drop = nn.Dropout(config.dropout)
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
            self.ln_f = nn.LayerNorm(config.n_embd)
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying: one Parameter object, seen once by parameters() and the optimizer.
        # to_empty() unties it again; init_weights() restores it.
        if config.tie_head:
            self.lm_head.weight = self.wte.weight
        self.to_empty(device=device)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter in place from torch's global RNG, in a fixed order.

        Matrices and embeddings get N(0, 0.02); the two projections that write into the residual
        stream (``attn.proj``, ``mlp.proj``) get N(0, 0.02 / sqrt(2 * n_layer)) as in GPT-2, so
        the residual stream's variance does not grow with depth. Biases are zero, LayerNorms are
        the identity. On the meta device this is a no-op that consumes no randomness. It also
        re-ties ``lm_head.weight`` to ``wte.weight``, so call it after ``to_empty()``.
        """
        # Module.to_empty() from meta gives each module its own new Parameter, which silently
        # unties lm_head from wte (torch 2.13); re-tie so a materialised model is tied again.
        if self.config.tie_head:
            self.lm_head.weight = self.wte.weight
        if self.wte.weight.is_meta:
            return  # nothing to fill; meta-device init ops import torch._dynamo for nothing
        for name, module in self.named_modules():
            self.init_module(name, module)

    @torch.no_grad()
    def init_module(self, name: str, module: nn.Module) -> None:
        """Initialise the params a module owns directly (see init_weights). ZeRO-3 calls this
        module by module to build a model from the meta device without ever holding it whole."""
        if module is self.lm_head and self.config.tie_head:
            return  # its weight is wte.weight, initialised as an embedding
        if isinstance(module, nn.Linear):
            std = (
                INIT_STD / math.sqrt(2 * self.config.n_layer)
                if name.endswith(".proj")
                else INIT_STD
            )
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def num_params(self) -> int:
        """Number of unique parameter elements (the tied embedding/head weight counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return ``(logits, loss)``.

        Args:
            idx: int64 token ids of shape (B, T) with T <= block_size.
            targets: optional int64 next-token ids of shape (B, T).

        Returns:
            logits of shape (B, T, vocab_size), and the mean cross-entropy over all B*T positions
            if ``targets`` is given, else None.
        """
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(
                f"sequence length {T} exceeds block_size={self.config.block_size}; "
                f"crop the input or build the model with a larger block_size"
            )
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            # reshape, not view: targets sliced from a larger buffer need not be contiguous.
            # In fp32 whatever the params' dtype: a bf16 cross-entropy rounds inside its
            # softmax, and its loss sits on the bf16 grid (1/32 apart at 4-8).
            loss = F.cross_entropy(logits.float().reshape(B * T, -1), targets.reshape(B * T))
        return logits, loss


def gpt_param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Split ``model``'s parameters into optimizer groups: decayed and not decayed.

    Parameters with 2 or more dims (matrices, embeddings, the tied head once) are decayed;
    1-D ones (biases, LayerNorm weights and biases) are not, since shrinking a gain or an offset
    towards zero is not regularisation. Each parameter appears once, in
    ``model.named_parameters()`` order, so every rank builds identical groups. Parameters with
    ``requires_grad=False`` are left out. Both groups are always returned, possibly empty.
    """
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    # named_parameters() already drops the second name of a tied (shared) Parameter.
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def gpt_muon_param_groups(
    model: nn.Module,
    weight_decay: float,
    *,
    muon_lr: float,
    lr: float,
    betas: tuple[float, float],
) -> list[dict[str, Any]]:
    """``model``'s parameters as `ZeroMuon` groups: the hidden matrices to Muon at ``muon_lr``
    (`fusedzero.muon_param_groups`), the rest to AdamW at ``lr``, split as in
    `gpt_param_groups` (the embedding decayed, 1-D params not). Every group decays with the same
    ``weight_decay`` where it decays at all."""
    from fusedzero import muon_param_groups

    groups = muon_param_groups(
        model, muon=dict(lr=muon_lr, weight_decay=weight_decay), adamw=dict(lr=lr, betas=betas)
    )
    out: list[dict[str, Any]] = []
    for g in groups:
        if g["use_muon"]:
            out.append(g)
            continue
        for decayed in (True, False):
            ps = [p for p in g["params"] if (p.dim() >= 2) == decayed]
            if ps:
                wd = weight_decay if decayed else 0.0
                out.append({**g, "params": ps, "weight_decay": wd})
    return out


_GPT2 = dict(vocab_size=50257, block_size=1024)
PRESETS: dict[str, dict[str, Any]] = {
    # GPT-2 shapes (tied head, no qkv bias: a few params fewer than OpenAI's), as `fusedzero plan`
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, **_GPT2),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, **_GPT2),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280, **_GPT2),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, **_GPT2),
    # A Llama-shaped decoder of 254M params: d 1024, 16 layers, 16 heads, 8 kv heads, SwiGLU
    # 2816, vocab 32000, untied head. Here with LayerNorm and learned positions instead of
    # RMSNorm and RoPE, and the attention output's bias: 255.4M params (+1.1M: positions
    # 1024 x 1024, norm biases, output biases), the same matmuls and so the same FLOPs per token.
    "llama-254m": dict(
        n_layer=16,
        n_head=16,
        n_kv_head=8,
        n_embd=1024,
        mlp="swiglu",
        mlp_hidden=2816,
        vocab_size=32000,
        block_size=1024,
        tie_head=False,
    ),
}
"""Model shapes by name, for `fusedzero train --preset` (GPTConfig fields)."""


def flops_per_token(config: GPTConfig, seq_len: int | None = None) -> int:
    """Model FLOPs of one token's forward + backward (the MFU numerator, as in PaLM / nanoGPT):
    6 per weight of every matmul (2 forward, 4 backward; the head counted even when tied, the
    embedding lookups not), plus causal-free attention 12 * n_layer * T * n_embd (scores and
    the weighted sum, forward and backward) at sequence length T (default block_size)."""
    d, h = config.n_embd, config.hidden
    kv = d // config.n_head * config.kv_heads
    per_layer = d * (d + 2 * kv) + d * d + d * h * (3 if config.mlp == "swiglu" else 2)
    matmul = config.n_layer * per_layer + d * config.vocab_size
    T = config.block_size if seq_len is None else seq_len
    return 6 * matmul + 12 * config.n_layer * T * d
