"""`fusedzero.emulate.step_comm` (the per-step bytes of `fusedzero plan --emulate` and of
docs/scale.md's table) against what a real optimizer's counter records on a real step.

`step_comm` issues one step's collectives on meta tensors without running a step, so that
W=1024 and 70B shapes cost nothing; here a real ZeroAdamW is built as rank r of W=4 on the
fake process group, runs forward, backward and a step, and its `opt.comm` counter (bytes,
elements and calls per collective kind) must equal `step_comm` of its own buffers, for every
stage, with and without resharding after forward, and over every wire format.
"""

from __future__ import annotations

import torch
from torch import nn

from fusedzero import Precision, Sharding, Wire, ZeroAdamW
from fusedzero.emulate import param_groups, step_comm
from fusedzero.stage import Stage
from fusedzero.testing import fake_group

W, D, BUCKET = 4, 24, 1024  # buckets of 2 * W * ALIGN: most flat buffers have several

WIRES = [  # (param dtype, reduce dtype, wire, param_wire): every path of fusedzero.wire
    (torch.bfloat16, torch.bfloat16, None, None),  # plain collectives
    (torch.float32, torch.float32, "fp32", None),  # fp32 grads over fp32: a plain reduce
    (torch.bfloat16, torch.bfloat16, "fp32", "int8"),  # packed grads and params
    (torch.float32, torch.float32, "bf16", "bf16"),  # fp32 params gathered as bf16
    (torch.bfloat16, torch.float32, "int8", "bf16"),  # bf16 params as bf16: a plain gather
]
STAGES = [(0, True), (1, True), (2, True), (3, True), (3, False)]  # (stage, reshard)


class Net(nn.Module):
    """Three stage-3 units (the ModuleList's children) and a root-owned head."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(3))
        self.head = nn.Linear(D, 5, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def test_step_comm_equals_a_real_steps_counter() -> None:
    # Each (wire, stage) case at rank 0 or rank W-1 in turn: both ranks see every stage and
    # every wire path, in 25 optimizers rather than 50 (~1 s).
    for i, (pdt, rdt, wire, param_wire) in enumerate(WIRES):
        for j, (stage, reshard) in enumerate(STAGES):
            rank = (0, W - 1)[(i + j) % 2]
            what = f"rank {rank} stage {stage} reshard={reshard} {pdt}/{rdt} {wire}/{param_wire}"
            with fake_group(rank, W):
                torch.manual_seed(rank)
                model = Net()
                opt = ZeroAdamW(
                    param_groups(model),
                    stage=stage,
                    module=model,
                    max_grad_norm=1.0,
                    precision=Precision(param_dtype=pdt, reduce_dtype=rdt),
                    wire=Wire(grads=wire, params=param_wire),
                    sharding=Sharding(bucket_numel=BUCKET, reshard_after_forward=reshard),
                )
                model(torch.randn(3, D, dtype=pdt)).float().square().mean().backward()
                opt.step()
                opt.zero_grad()
                counted = opt.comm.snapshot()
                issued = step_comm(
                    opt.flat_groups,
                    Stage(stage),
                    reshard,
                    W,
                    wire_format=opt.grad_wire,
                    param_wire=opt.param_wire,
                ).snapshot()
                opt.close()
            assert counted["bytes"]["all_gather"] > 0 or stage == 0, what
            assert issued == counted, (what, issued, counted)
