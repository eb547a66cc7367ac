"""`fusedzero doctor`'s distributed checks: a 1-rank process group, a ZeroAdamW step in it
against torch.optim.AdamW, a checkpoint round trip compared bitwise."""
from __future__ import annotations

import contextlib
import copy
import datetime
import tempfile
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fusedzero._spawn import reserved_port
from fusedzero.app.doctor_rows import Row, Status, row

# --checks names that stand for several checks.
GROUPS = {"distributed": ("process-group", "zero-step", "checkpoint")}


@contextlib.contextmanager
def one_rank_group(device: torch.device) -> Iterator[str]:
    """A world of one on a free local port; destroyed on exit (gloo can abort at interpreter
    exit with a live group)."""
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized in this process")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with reserved_port() as port:  # held until the store listens on it
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        yield backend
    finally:
        dist.destroy_process_group()


def _tiny_model(device: torch.device, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 24), nn.Tanh(), nn.Linear(24, 4)).to(device)


def _train(model: nn.Module, opt: torch.optim.Optimizer, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):  # two steps: the second reads the moments the first wrote
        x = torch.randn(16, 8, generator=gen).to(device)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def zero_step(device: torch.device) -> tuple[str, dict[str, Any]]:
    """Two ZeroAdamW steps (stage 2) vs torch.optim.AdamW on a copy of the model. fp32 on both
    sides, each param moves by ~lr per step: torch's fp32 tolerances (1.3e-6 relative, 1e-5
    absolute) are far under a semantic error (a lost weight decay or bias correction moves a
    param by ~1e-3 here)."""
    from fusedzero import ZeroAdamW

    model = _tiny_model(device, seed=0)
    ref = copy.deepcopy(model)
    hp = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt = ZeroAdamW(model.parameters(), stage=2, module=model, **hp)
    try:
        _train(model, opt, device)
        _train(ref, torch.optim.AdamW(ref.parameters(), **hp), device)
        with opt.gathered_params():
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, msg=lambda m, n=name: f"{n}: {m}")
    finally:
        opt.close()
    return "stage 2, 2 steps on a 2-layer MLP = torch.optim.AdamW (fp32 tolerance)", {}


def checkpoint_round_trip(device: torch.device) -> tuple[str, dict[str, Any]]:
    """Save a trained optimizer, load it into a fresh one (other init), compare bitwise."""
    from fusedzero import ZeroAdamW, checkpoint

    model, other = _tiny_model(device, seed=0), _tiny_model(device, seed=1)
    opts = [ZeroAdamW(m.parameters(), lr=1e-2, stage=2, module=m) for m in (model, other)]
    try:
        _train(model, opts[0], device)
        with tempfile.TemporaryDirectory(prefix="fusedzero-doctor-") as d:
            checkpoint.save(opts[0], d, step=2)
            got = checkpoint.load(opts[1], d)
        if got.step != 2:
            raise RuntimeError(f"loaded step {got.step}, saved 2")
        a, b = opts[0].shard_state(), opts[1].shard_state()
        pairs = [(f"{f}[{i}]", x, y) for f in ("master", "exp_avg", "exp_avg_sq")
                 for i, (x, y) in enumerate(zip(getattr(a, f), getattr(b, f)))]
        with opts[0].gathered_params(), opts[1].gathered_params():
            pairs += [(n, p, q) for (n, p), q in zip(model.named_parameters(), other.parameters())]
            diff = [n for n, x, y in pairs if not torch.equal(x, y)]
        if diff or a.step_count != b.step_count:
            raise RuntimeError(f"not bit-exact after load: {diff[:5]}, step count "
                               f"{a.step_count} vs {b.step_count}")
    finally:
        for o in opts:
            o.close()
    return f"save + load of {len(pairs)} tensors in a temp dir, bit-exact", {}


def distributed_rows(device: torch.device, checks: tuple[str, ...] = GROUPS["distributed"]
                     ) -> list[Row]:
    """The process group (always: the others run in it), then the ZeroAdamW step and the
    checkpoint round trip where `checks` names them."""
    rows: list[Row] = []
    with contextlib.ExitStack() as stack:
        def group() -> str:
            backend = stack.enter_context(one_rank_group(device))
            t = torch.arange(4, dtype=torch.float32, device=device)
            dist.all_reduce(t)
            if not torch.equal(t.cpu(), torch.arange(4, dtype=torch.float32)):
                raise RuntimeError(f"all_reduce over one rank changed the tensor: {t.tolist()}")
            return f"{backend}, 1 rank: init, all_reduce, destroy"

        rows.append(row("process group", group))
        for check, name, fn in (("zero-step", "ZeroAdamW step", zero_step),
                                ("checkpoint", "checkpoint", checkpoint_round_trip)):
            if check not in checks:
                continue
            if rows[0].status is Status.OK:
                rows.append(row(name, lambda fn=fn: fn(device)))
            else:
                rows.append(Row(name, Status.SKIPPED, "needs the process group above"))
    return rows
