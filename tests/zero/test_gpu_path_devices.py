"""Device and backend decisions of the CUDA path, proven without a GPU.

- Devices: every device is made indexed once, at construction ("cuda" is the current CUDA
  device). CUDA is faked: `torch.cuda.current_device` / `is_available` are monkeypatched, and
  params "on cuda:2" are FakeTensors (FakeTensorMode builds tensors that report a CUDA device
  without any CUDA runtime), which is all `resolve_device` reads of them.
- Backends: what a wait means is decided per device type from the group's backend string
  ("cpu:gloo,cuda:nccl" for a mixed group); a one-rank gloo group registered for both device
  types gives that string's shape without NCCL.

About internals: fusedzero._comm, fusedzero._validate.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensorMode

from fusedzero import _comm as comm
from fusedzero._validate import indexed_device, resolve_device


@pytest.fixture
def cuda2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)


def _fake_params(device: str) -> list[nn.Parameter]:
    """Params that report `device` and hold no storage. FakeTensorMode's first tensor on a CUDA
    device also makes a real one there (`fake_tensor.init_gpu_context`, for a later backward),
    in torch 2.11 wherever `torch.cuda.is_available()`: on a one-GPU machine "cuda:2" is an
    invalid device ordinal (the H200 run of 2026-11-27, docs/gpu_suite.md; torch 2.13 asks
    `torch.accelerator` instead). Nothing here runs a backward: no context is made."""
    with (
        mock.patch.object(fake_tensor, "init_gpu_context", lambda device: None),
        FakeTensorMode(allow_non_fake_inputs=True),
    ):
        return [nn.Parameter(torch.empty(4, device=device))]


def test_fake_params_make_no_real_tensor(cuda2: None, monkeypatch: pytest.MonkeyPatch) -> None:
    def real_tensor(device: torch.device) -> None:  # torch 2.11's, where a GPU is visible
        raise AssertionError(f"a real tensor on {device}: invalid device ordinal on one GPU")

    monkeypatch.setattr(fake_tensor, "init_gpu_context", real_tensor)
    assert _fake_params("cuda:2")[0].device == torch.device("cuda", 2)


def test_indexed_device(cuda2: None) -> None:
    assert indexed_device("cuda") == torch.device("cuda", 2)
    assert indexed_device(torch.device("cuda")) == torch.device("cuda", 2)
    assert indexed_device("cuda:1") == torch.device("cuda", 1)
    assert indexed_device("cpu") == torch.device("cpu")
    assert indexed_device("meta") == torch.device("meta")


def test_meta_params_materialise_on_an_indexed_device(cuda2: None) -> None:
    """Before: `cuda` without an index, while every buffer built on it reports `cuda:2`, so the
    kernel launcher's device check refused the optimizer's own buffers."""
    meta = [nn.Parameter(torch.empty(4, device="meta"))]
    assert resolve_device(meta, None, True, None) == torch.device("cuda", 2)
    assert resolve_device(meta, None, True, "cuda") == torch.device("cuda", 2)
    assert resolve_device(meta, None, True, "cpu") == torch.device("cpu")


def test_device_argument_compared_indexed(cuda2: None) -> None:
    params = _fake_params("cuda:2")
    assert resolve_device(params, None, False, "cuda") == torch.device("cuda", 2)
    assert resolve_device(params, None, False, None) == torch.device("cuda", 2)
    with pytest.raises(ValueError, match=r"device=cuda:0 .*params are on cuda:2"):
        resolve_device(params, None, False, "cuda:0")


@pytest.fixture
def mixed_group(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """A one-rank group whose backend string reads "cpu:gloo,cuda:nccl"."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    store = dist.HashStore()
    dist.init_process_group("cpu:gloo,cuda:gloo", rank=0, world_size=1, store=store)
    real = dist.get_backend
    monkeypatch.setattr(
        dist, "get_backend", lambda group=None: str(real(group)).replace("cuda:gloo", "cuda:nccl")
    )
    yield
    dist.destroy_process_group()


def test_waits_decided_per_device_type(mixed_group: None) -> None:
    """Before: any backend string other than exactly "nccl" made every wait a host-blocking
    one with a timeout, which on NCCL is a host sync per collective."""
    assert comm.serving_backend(None, "cuda") == "nccl"
    assert comm.serving_backend(None, "cpu") == "gloo"
    counter = comm.CommCounter()
    assert not comm.CommContext.of(None, counter, device=torch.device("cuda", 0)).host_blocking
    assert comm.CommContext.of(None, counter, device=torch.device("cpu")).host_blocking
    # Without a device: blocking unless every backend of the group is stream-ordered.
    assert comm.CommContext.of(None, counter).host_blocking


def test_single_backend_strings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    for name, cuda_blocks in (("nccl", False), ("gloo", True), ("fake", True)):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, name=name: name)
        assert comm._host_blocking(None, torch.device("cuda", 0)) is cuda_blocks, name
        assert comm._host_blocking(None, torch.device("cpu")) is True, name


def test_premul_sum_where_nccl_serves_the_device(mixed_group: None) -> None:
    """The average's 1/W goes into the collective (NCCL premul_sum) for CUDA tensors of a mixed
    group, and stays a `mul_` (None here) for CPU tensors, which gloo serves."""
    ctx = comm.CommContext.of(None, comm.CommCounter(), device=torch.device("cuda", 0))
    (cuda_t,) = _fake_params("cuda:0")
    assert comm.premul_sum_op(ctx, cuda_t, 0.5) is not None
    assert comm.premul_sum_op(ctx, torch.ones(2), 0.5) is None
    assert comm.premul_sum_op(ctx, torch.ones(2, dtype=torch.int32), 0.5) is None


def test_premul_sum_only_where_the_factor_is_what_a_mul_would_use(mixed_group: None) -> None:
    """See [Note: premul_sum dtypes]: NCCL multiplies by the factor in the data's dtype: never for
    bf16 (1/24 in bf16 is 0.19% large; torch builds before pytorch#190747 made every
    power-of-two bf16 factor 0), fp16 only where the factor is exact in fp16, fp32 always. A
    `mul_` before the collective otherwise (None here). Before: any floating dtype."""
    ctx = comm.CommContext.of(None, comm.CommCounter(), device=torch.device("cuda", 0))
    with FakeTensorMode(allow_non_fake_inputs=True):
        t = {
            dt: torch.empty(4, device="cuda:0", dtype=dt)
            for dt in (torch.float32, torch.float16, torch.bfloat16)
        }
    for factor in (0.5, 0.25, 1 / 1024):
        assert comm.premul_sum_op(ctx, t[torch.float32], factor) is not None
        assert comm.premul_sum_op(ctx, t[torch.float16], factor) is not None
        assert comm.premul_sum_op(ctx, t[torch.bfloat16], factor) is None
    for factor in (1 / 3, 1 / 24, 2.0**-15):  # not exact in fp16 (2^-15: subnormal)
        assert comm.premul_sum_op(ctx, t[torch.float32], factor) is not None
        assert comm.premul_sum_op(ctx, t[torch.float16], factor) is None
        assert comm.premul_sum_op(ctx, t[torch.bfloat16], factor) is None


def test_nccl_watchdog_env_keeps_what_the_user_set() -> None:
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    added = comm.nccl_watchdog_env(env)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in added
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and added
