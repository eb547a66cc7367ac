"""torchao's AdamW8bit beside our memory modes, on the run `fusedzero train` makes (default config,
500 steps, seed 0 or --seed N): the same GPT, init, global batches, lr schedule, clipping and
validation set, in one process (the global batch of the 2 ranks, whose mean loss is the same).
torchao has no ZeRO, so this is the quality and the per-param optimizer bytes, not a sharded run.

    pip install torchao && python bench/quality_torchao.py [--bf16] [--seed N] > out.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from fusedzero.app.config import TrainConfig
from fusedzero.app.data import BatchSampler, eval_batches
from fusedzero.app.loop import lr_lambda_for
from fusedzero.app.model import GPT, GPTConfig, gpt_param_groups
from fusedzero.app.preflight import load_data


def state_bytes(opt: torch.optim.Optimizer) -> int:
    total, seen = 0, set()
    for st in opt.state.values():
        for v in st.values():
            if not isinstance(v, torch.Tensor):
                continue
            parts = [getattr(v, a) for a in ("codes", "scale", "qmap") if hasattr(v, a)] or [v]
            for t in parts:
                if t.data_ptr() not in seen:  # the qmap is shared by every state
                    seen.add(t.data_ptr())
                    total += t.numel() * t.element_size()
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--bf16",
        action="store_true",
        help="bf16 params with torchao's bf16_stochastic_round (no fp32 master)",
    )
    ap.add_argument(
        "--seed",
        type=int,
        default=TrainConfig().seed,
        help="model init and data order, as `fusedzero train --seed`",
    )
    args = ap.parse_args()
    from torchao.optim import AdamW8bit

    cfg = TrainConfig(seed=args.seed)
    train, val = load_data(cfg)
    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig(**cfg.model_config()))
    if args.bf16:
        model = model.to(torch.bfloat16)
    opt = AdamW8bit(
        gpt_param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        bf16_stochastic_round=args.bf16,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda_for(cfg))
    sampler = BatchSampler(train, cfg.block_size, cfg.batch_size, cfg.seed)
    vx, vy = eval_batches(val, cfg.block_size, cfg.eval_seqs, 1)[0]
    t0 = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        x, y = sampler.batch(step - 1, 0, 1)
        _, loss = model(x, y)
        loss.backward()
        if cfg.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        logits, _ = model(vx)
        val_loss = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), vy.reshape(-1)
        ).item()
    n = sum(p.numel() for p in model.parameters())
    print(
        json.dumps(
            {
                "optimizer": "torchao.optim.AdamW8bit",
                "params": "bf16" if args.bf16 else "fp32",
                "bf16_stochastic_round": args.bf16,
                "seed": cfg.seed,
                "val_loss": val_loss,
                "train_loss": loss.item(),
                "steps": cfg.steps,
                "optimizer_state_bytes": state_bytes(opt),
                "param_elements": n,
                "seconds": time.perf_counter() - t0,
            }
        )
    )


if __name__ == "__main__":
    main()
