"""Stage 3's `model.state_dict()` and `close()` walk the units one at a time: the gathered
storage alive at once (counted exactly by `Zero3.max_gathered_numel`, elements of every unit's
gathered buffers from `gather` to `free`) never exceeds the largest unit, where before it was
the whole model; state_dict's values are CPU copies equal to a plain model trained alike."""

from __future__ import annotations

import torch
from torch import nn

from fusedzero import Sharding, ZeroAdamW


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(8, 32)
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
        self.head = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.emb(x)
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


def _trained() -> tuple[Net, Net, ZeroAdamW]:
    torch.manual_seed(0)
    ref = Net()
    torch.manual_seed(0)
    model = Net()
    opt = ZeroAdamW(
        model.parameters(), lr=1e-2, stage=3, module=model, sharding=Sharding(bucket_numel=256)
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    for m, o in ((model, opt), (ref, ref_opt)):
        nn.functional.mse_loss(m(x), y).backward()
        o.step()
        o.zero_grad()
    return model, ref, opt


def test_state_dict_unit_by_unit_to_cpu() -> None:
    model, ref, opt = _trained()
    z = opt.zero3
    assert z is not None and len(z.modules) == 5  # the root (emb, head) and 4 blocks
    largest = max(z.unit_numel(u) for u in range(len(z.modules)))
    assert z.gathered_numel == 0
    z.max_gathered_numel = 0
    sd = model.state_dict()
    assert z.max_gathered_numel <= largest < sum(map(z.unit_numel, range(5))), (
        z.max_gathered_numel,
        largest,
    )
    assert z.gathered_numel == 0
    for k, v in ref.state_dict().items():
        assert sd[k].device == torch.device("cpu")
        torch.testing.assert_close(sd[k], v, rtol=1e-6, atol=1e-6, msg=k)
    z.max_gathered_numel = 0
    opt.close()
    assert z.max_gathered_numel <= largest, (z.max_gathered_numel, largest)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6, msg=n)
