"""Tests for the GPT model (fusedzero.app.model) and the byte-level data pipeline
(fusedzero.app.data)."""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import pytest
import torch

from fusedzero.app.data import (
    BatchSampler,
    default_corpus_files,
    eval_batches,
    load_corpus,
    split_corpus,
)
from fusedzero.app.model import GPT, GPTConfig, gpt_param_groups

# Small enough that every model test runs in milliseconds on a CPU.
TINY = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)


def _build(seed: int, config: GPTConfig = TINY) -> GPT:
    torch.manual_seed(seed)
    return GPT(config)


def _assert_same_params(a: GPT, b: GPT) -> None:
    na, nb = dict(a.named_parameters()), dict(b.named_parameters())
    assert na.keys() == nb.keys()
    for name in na:
        assert torch.equal(na[name], nb[name]), f"parameter {name} differs"


# ---------------------------------------------------------------- model


def test_head_is_tied_to_token_embedding() -> None:
    model = _build(0)
    assert model.lm_head.weight is model.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names


def test_forward_shapes_and_finite_loss() -> None:
    model = _build(0)
    idx = torch.randint(0, TINY.vocab_size, (3, 17))  # T=17: shorter than block_size, odd
    logits, loss = model(idx, idx)
    assert logits.shape == (3, 17, TINY.vocab_size)
    assert loss is not None and loss.dim() == 0 and torch.isfinite(loss)
    logits, loss = model(idx)
    assert loss is None
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, TINY.block_size + 1, dtype=torch.long))


def test_same_seed_same_params_different_seed_different() -> None:
    _assert_same_params(_build(123), _build(123))
    assert not torch.equal(_build(1).wte.weight, _build(2).wte.weight)


def test_meta_build_then_init_weights_matches_eager_build() -> None:
    eager = _build(7)
    with torch.device("meta"):
        model = GPT(TINY)
    assert model.wte.weight.is_meta
    model.to_empty(device="cpu")
    torch.manual_seed(7)
    model.init_weights()
    assert model.lm_head.weight is model.wte.weight
    _assert_same_params(eager, model)


def test_init_weights_reinitialises_in_place() -> None:
    model = _build(3)
    before = {n: p for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    torch.manual_seed(3)
    model.init_weights()
    after = dict(model.named_parameters())
    assert all(after[n] is before[n] for n in before), "init_weights must not replace Parameters"
    _assert_same_params(_build(3), model)


def test_residual_projections_use_scaled_init() -> None:
    model = _build(0, GPTConfig(n_layer=8))
    std = model.blocks[0].mlp.proj.weight.std().item()
    assert std == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert model.blocks[0].mlp.fc.weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_loss_at_init_is_near_uniform() -> None:
    model = _build(0, GPTConfig())
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 256, (4, 128), generator=gen)
    targets = torch.randint(0, 256, (4, 128), generator=gen)
    _, loss = model(idx, targets)
    assert abs(loss.item() - math.log(256)) < 0.3, f"loss at init {loss.item()} vs ln 256"


def test_num_params_counts_tied_weight_once() -> None:
    c = TINY
    per_block = (
        2 * 2 * c.n_embd  # two LayerNorms
        + c.n_embd * 3 * c.n_embd  # qkv (no bias)
        + c.n_embd * c.n_embd
        + c.n_embd  # attn proj
        + c.n_embd * 4 * c.n_embd
        + 4 * c.n_embd  # fc
        + 4 * c.n_embd * c.n_embd
        + c.n_embd  # mlp proj
    )
    expected = (
        c.vocab_size * c.n_embd + c.block_size * c.n_embd + c.n_layer * per_block + 2 * c.n_embd
    )
    assert _build(0).num_params() == expected


def test_param_groups_unique_ordered_and_split_by_dim() -> None:
    model = _build(0)
    groups = gpt_param_groups(model, weight_decay=0.1)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    decay, no_decay = groups[0]["params"], groups[1]["params"]
    assert all(p.dim() >= 2 for p in decay) and all(p.dim() == 1 for p in no_decay)
    ids = [id(p) for p in decay + no_decay]
    assert len(ids) == len(set(ids)), "a parameter appears twice"
    assert sum(p.numel() for p in decay + no_decay) == model.num_params()
    order = {id(p): i for i, p in enumerate(model.parameters())}
    for group in (decay, no_decay):
        positions = [order[id(p)] for p in group]
        assert positions == sorted(positions), "groups must follow named_parameters() order"
    torch.optim.AdamW(groups, lr=1e-3)  # accepted by a stock optimizer


def test_config_validation_names_values() -> None:
    with pytest.raises(ValueError, match="n_embd=30 is not divisible by n_head=4"):
        GPTConfig(n_embd=30, n_head=4)


# ---------------------------------------------------------------- data


@pytest.fixture(scope="module")
def train_data() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (10_007,), generator=gen, dtype=torch.uint8)


def _concat(sampler: BatchSampler, step: int, world: int, accum: int) -> torch.Tensor:
    # Rank-major order, as documented in BatchSampler: rank outer, micro-step inner.
    xs, ys = [], []
    for rank in range(world):
        for micro in range(accum):
            x, y = sampler.batch(step, rank, world, micro, accum)
            assert x.shape == (sampler.global_batch_size // (world * accum), sampler.block_size)
            assert x.dtype == y.dtype == torch.int64
            assert torch.equal(x[:, 1:], y[:, :-1]), "y must be x shifted by one"
            xs.append(x)
            ys.append(y)
    return torch.cat([torch.cat(xs), torch.cat(ys)], dim=1)


def test_global_batch_independent_of_world_size_and_accum(train_data: torch.Tensor) -> None:
    sampler = BatchSampler(train_data, block_size=16, global_batch_size=8, seed=5)
    for step in (0, 1, 17):
        ref = _concat(sampler, step, world=1, accum=1)
        for world, accum in ((2, 1), (4, 2), (1, 8), (2, 4)):
            got = _concat(sampler, step, world, accum)
            assert torch.equal(ref, got), f"step {step}: W={world} accum={accum} differs"
    assert not torch.equal(_concat(sampler, 0, 1, 1), _concat(sampler, 1, 1, 1))
    other_seed = BatchSampler(train_data, block_size=16, global_batch_size=8, seed=6)
    assert not torch.equal(_concat(sampler, 0, 1, 1), _concat(other_seed, 0, 1, 1))


def test_sampler_windows_match_data(train_data: torch.Tensor) -> None:
    sampler = BatchSampler(train_data, block_size=16, global_batch_size=4, seed=0)
    x, y = sampler.batch(3, rank=0, world_size=1)
    for row, s in enumerate(sampler.global_starts(3).tolist()):
        assert torch.equal(x[row], train_data[s : s + 16].long())
        assert torch.equal(y[row], train_data[s + 1 : s + 17].long())


def test_sampler_rejects_indivisible_batch(train_data: torch.Tensor) -> None:
    sampler = BatchSampler(train_data, block_size=16, global_batch_size=12, seed=0)
    with pytest.raises(ValueError, match=r"global_batch_size=12 .* 4\*2 = 8"):
        sampler.batch(0, rank=0, world_size=4, micro_step=0, grad_accum=2)
    with pytest.raises(ValueError, match="rank=2"):
        sampler.batch(0, rank=2, world_size=2)


def test_eval_batches_deterministic_and_in_range(train_data: torch.Tensor) -> None:
    a = eval_batches(train_data, block_size=16, batch_size=3, n_batches=5)
    b = eval_batches(train_data, block_size=16, batch_size=3, n_batches=5)
    assert len(a) == 5
    for (xa, ya), (xb, yb) in zip(a, b):
        assert xa.shape == ya.shape == (3, 16)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert torch.equal(xa[:, 1:], ya[:, :-1])
    # The last window ends exactly at the end of the split.
    assert torch.equal(a[-1][1][-1], train_data[-16:].long())


def test_split_corpus_is_tail_validation() -> None:
    data = bytes(range(256)) * 4
    train, val = split_corpus(data, val_fraction=0.25)
    assert train.dtype == val.dtype == torch.uint8
    assert bytes(train.tolist()) + bytes(val.tolist()) == data
    assert val.numel() == 256
    _, val = split_corpus(data, val_fraction=0.01, block_size=64)
    assert val.numel() == 65  # grown to one full window


def test_load_corpus_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_corpus(tmp_path / "missing.txt")
    small = tmp_path / "small.txt"
    small.write_bytes(b"x" * 20)
    with pytest.raises(ValueError, match=r"20 bytes, fewer than 2\*block_size\+2 = 34"):
        load_corpus(small, block_size=16)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no text files"):
        load_corpus(empty)
    (empty / "blob.bin").write_bytes(b"\0" * 1000)
    with pytest.raises(ValueError, match="no text files"):
        load_corpus(empty)


def test_load_corpus_folder_concatenates_sorted_text(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "2.txt").write_bytes(b"B" * 40)
    (tmp_path / "a.txt").write_bytes(b"A" * 40)
    (tmp_path / "c.bin").write_bytes(b"C\0" * 40)
    (tmp_path / ".hidden").write_bytes(b"H" * 40)
    assert load_corpus(tmp_path, block_size=16) == b"A" * 40 + b"B" * 40
    assert load_corpus(tmp_path / "a.txt", block_size=16) == b"A" * 40


def test_default_corpus_nonempty_deterministic_and_large() -> None:
    files = default_corpus_files()
    assert files and files == default_corpus_files()
    assert all(f.suffix == ".py" for f in files)
    root = Path(sysconfig.get_paths()["stdlib"])
    excluded = {"test", "tests", "site-packages"}
    assert not any(excluded & set(f.relative_to(root).parts) for f in files)
    data = load_corpus(None)
    assert len(data) > 1_000_000
    assert len(data) <= 8_000_000
