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

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)} must be >= 1")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                f"head size n_embd/n_head must be an integer"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout={self.dropout} must be in [0, 1)")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention on top of ``F.scaled_dot_product_attention``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        # One matmul for q, k and v together, split afterwards.
        # No qkv bias: the key bias cannot change softmax, so its exact gradient is zero and Adam
        # would turn rounding noise in it into full-size, sign-random updates.
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        # Output projection into the residual stream; GPT.init_weights scales its init down.
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_size), the layout SDPA expects.
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network: expand 4x, GELU, project back."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU()
        # Output projection into the residual stream; GPT.init_weights scales its init down.
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
    """Decoder-only transformer language model with the output head tied to the token embedding."""

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
            self.wte = nn.Embedding(config.vocab_size, config.n_embd,
                                    _weight=torch.empty(config.vocab_size, config.n_embd))
            self.wpe = nn.Embedding(config.block_size, config.n_embd,
                                    _weight=torch.empty(config.block_size, config.n_embd))
            self.drop = nn.Dropout(config.dropout)
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
            self.ln_f = nn.LayerNorm(config.n_embd)
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying: one Parameter object, seen once by parameters() and the optimizer.
        # to_empty() unties it again; init_weights() restores it.
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
        self.lm_head.weight = self.wte.weight
        if self.wte.weight.is_meta:
            return  # nothing to fill; meta-device init ops import torch._dynamo for nothing
        for name, module in self.named_modules():
            self.init_module(name, module)

    @torch.no_grad()
    def init_module(self, name: str, module: nn.Module) -> None:
        """Initialise the params a module owns directly (see init_weights). ZeRO-3 calls this
        module by module to build a model from the meta device without ever holding it whole."""
        if module is self.lm_head:
            return  # its weight is wte.weight, initialised as an embedding
        if isinstance(module, nn.Linear):
            std = INIT_STD / math.sqrt(2 * self.config.n_layer) if name.endswith(".proj") \
                else INIT_STD
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
            loss = F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T))
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
