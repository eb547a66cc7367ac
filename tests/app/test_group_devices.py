"""Which device a rank of `fusedzero train` takes (fusedzero/app/launch.py), on stand-ins for
torch.cuda where a GPU would be needed: a process that sees one GPU (a scheduler's
CUDA_VISIBLE_DEVICES per task) uses it whatever its local rank; a local rank without a GPU is a
usage error; inside a group the caller made without NCCL, `--device cuda` is a usage error
(its collectives cannot take CUDA tensors) and `--device auto` stays on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fusedzero.app import launch
from fusedzero.app.config import UsageError, parse_args


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    return chosen


def test_one_visible_gpu_is_the_rank_s_whatever_its_local_rank(gpus, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert launch._setup_device(True, 3, 4) == torch.device("cuda", 0) and gpus == [0]


def test_local_rank_without_a_gpu_is_a_usage_error(gpus, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert launch._setup_device(True, 1, 2) == torch.device("cuda", 1)
    with pytest.raises(UsageError, match="local rank 3 has no GPU of its own: torch sees 2"):
        launch._setup_device(True, 3, 4)
    assert gpus == [1]


def test_a_gloo_group_of_the_caller_refuses_cuda_and_keeps_auto_on_cpu(monkeypatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine
    threads = torch.get_num_threads()  # a CPU rank sets its share of the cores
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        with pytest.raises(UsageError, match="cannot take CUDA tensors; initialise it with nccl"):
            launch._device_in_group(parse_args(["--device", "cuda"]))
        assert launch._device_in_group(parse_args([])) == (False, torch.device("cpu"))
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)
