"""How the kernels are launched: grid shape within CUDA's limits and the device guard.

Neither needs a GPU: the grid is arithmetic, and the launch is observed through a recording
`torch.cuda.device` and a fake kernel object (the launchers index `kernel[grid]` and call it).

About internals: fusedzero.kernels._adamw, fusedzero.kernels._launch,
fusedzero.kernels._sum_of_squares, fusedzero.kernels._table.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import triton.runtime.interpreter as interp

from fusedzero.kernels import (
    Strided,
    _adamw as adamw_mod,
    _launch,
    _sum_of_squares as sumsq_mod,
    _table as table,
    adamw_reference,
    adamw_step,
    sumsq,
)

CUDA_MAX_Y = 65535  # CUDA's limit on grid axes 1 and 2
HP = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
LR, STEP, SCALE = float(torch.tensor(3e-3)), 3, float(torch.tensor(0.37))


def _scalars() -> dict[str, torch.Tensor]:
    return dict(
        lr=torch.tensor([LR]),
        step=torch.tensor([float(STEP)]),
        grad_scale=torch.tensor([SCALE]),
        skip=torch.tensor([0], dtype=torch.int32),
    )


# ------------------------------------------------------------------------------------------- grid


@pytest.mark.slow
@pytest.mark.parametrize("block", [adamw_mod.BLOCK, sumsq_mod.BLOCK])
@pytest.mark.parametrize("shard", [128, 2**20 // 8, 3 * 4096 + 128])
def test_table_for_70k_buckets_is_1d_and_maps_every_program_once(block: int, shard: int) -> None:
    # bucket_numel=2**20 on a 70B-param decay group at W=8: ~67k buckets of 2**17-element shards.
    nb = 70_000
    full = torch.empty(2, dtype=torch.float32)  # addresses only: nothing is launched
    pieces = [table.Piece((full,), (0,), shard, 0)] * nb
    t = table.build_table(pieces, block, torch.device("cpu"))
    nblocks = math.ceil(shard / block)
    assert t.programs == nb * nblocks <= _launch.MAX_GRID_X
    # prog_piece maps program -> piece, `first` maps back: every (piece, block) pair once.
    prog = torch.arange(t.programs, dtype=torch.int64)
    piece = t.prog_piece.long()
    blk = prog - t.pieces[piece, table.Col.FIRST]
    assert int(piece.max()) == nb - 1 and int(blk.min()) == 0 and int(blk.max()) == nblocks - 1
    assert torch.equal(torch.unique(piece * nblocks + blk), prog)


def test_grid_beyond_cuda_axis0_limit_is_refused_with_the_fix() -> None:
    full = torch.empty(2, dtype=torch.float32)
    with pytest.raises(ValueError, match="exceed CUDA's grid limit .* use larger buckets"):
        table.build_table([table.Piece((full,), (0,), 2**30, 0)] * 3, 1, torch.device("cpu"))


@pytest.mark.slow
@pytest.mark.interpreter
def test_adamw_last_programs_of_a_70k_bucket_grid_triton_interpreter(monkeypatch) -> None:
    """The AdamW kernel at bucket ids past 65535, in the interpreter, on 128-element shards.

    An interpreted program costs ~20 ms on this machine: the whole 70k-program grid would take
    ~25 min. The launcher's grid is narrowed to a few programs and the interpreter is told their
    real ids (ids past the old axis-1 cap included), so the kernel's own index math is what runs.
    """
    monkeypatch.setenv("FUSEDZERO_BACKEND", "triton")
    nb, S = 70_000, 128
    progs = [0, CUDA_MAX_Y - 1, CUDA_MAX_Y, nb - 1]
    kernel = adamw_mod._grouped_adamw_kernel
    full: list[int] = []

    class _Narrowed:
        def __getitem__(self, grid: tuple[int]):
            full[:] = grid
            return kernel[(len(progs),)]

    monkeypatch.setattr(adamw_mod, "_grouped_adamw_kernel", _Narrowed())
    builder = interp.interpreter_builder
    own_grid = builder.set_grid_idx

    def set_grid_idx(x: int, y: int, z: int) -> None:
        if not full:  # another kernel of the update (its per-group rows): its own grid
            own_grid(x, y, z)
            return
        assert full == [nb], full
        builder.grid_dim = (full[0], 1, 1)
        builder.grid_idx = (progs[x], y, z)

    monkeypatch.setattr(builder, "set_grid_idx", set_grid_idx)
    gen = torch.Generator().manual_seed(0)
    # master as rank 1's pieces of a 2-rank bucketed buffer; the moments local.
    master_full = torch.randn(nb * 2 * S, generator=gen)
    grad = torch.randn(nb * S, generator=gen)
    m = torch.randn(nb * S, generator=gen) * 0.1
    v = torch.rand(nb * S, generator=gen) * 0.02 + 1e-4
    before = [t.clone() for t in (master_full, grad, m, v)]
    adamw_step(
        Strided(master_full, 2 * S, S),
        grad,
        m,
        v,
        **_scalars(),
        **HP,
        num_buckets=nb,
        shard_numel=S,
    )
    touched = torch.zeros(nb, dtype=torch.bool)
    touched[progs] = True
    for k in range(nb):
        if not touched[k] and k % 997:  # spot-check untouched buckets (all would take long)
            continue
        loc = slice(k * S, (k + 1) * S)
        mine = slice(k * 2 * S + S, k * 2 * S + 2 * S)
        if not touched[k]:
            assert torch.equal(m[loc], before[2][loc]), f"bucket {k} written by no program"
            continue
        p_ref, m_ref, v_ref = adamw_reference(
            before[0][mine],
            grad[loc],
            before[2][loc],
            before[3][loc],
            lr=LR,
            step=STEP,
            grad_scale=SCALE,
            **HP,
        )
        torch.testing.assert_close(master_full[mine].double(), p_ref, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(m[loc].double(), m_ref, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(v[loc].double(), v_ref, rtol=1e-6, atol=1e-9)
        # rank 0's piece of the same bucket is not ours: untouched.
        other = slice(k * 2 * S, k * 2 * S + S)
        assert torch.equal(master_full[other], before[0][other]), f"bucket {k}: wrote rank 0"


# ----------------------------------------------------------------------------------- device guard


class _RecordingDevice:
    """Stands in for torch.cuda.device: records which device each launch was guarded by."""

    entered: list[torch.device] = []
    active: list[torch.device] = []

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)

    def __enter__(self) -> None:
        type(self).entered.append(self.device)
        type(self).active.append(self.device)

    def __exit__(self, *exc: object) -> None:
        type(self).active.pop()


def test_device_guard_enters_torch_cuda_device_for_cuda_tensors(monkeypatch) -> None:
    monkeypatch.setattr(_RecordingDevice, "entered", [])
    monkeypatch.setattr(torch.cuda, "device", _RecordingDevice)
    with _launch.device_guard(torch.device("cuda", 1)):
        assert _RecordingDevice.active == [torch.device("cuda", 1)]
    assert _RecordingDevice.entered == [torch.device("cuda", 1)] and not _RecordingDevice.active
    with _launch.device_guard(torch.device("cpu")):
        pass
    assert _RecordingDevice.entered == [torch.device("cuda", 1)], "CPU needs no CUDA guard"


class _FakeKernel:
    """`kernel[grid](*args)` that records the guard active at launch instead of running."""

    def __init__(self, active: list[torch.device]) -> None:
        self.active, self.launches = active, []

    def __getitem__(self, grid: tuple[int, ...]):
        def launch(*args: object, **kwargs: object) -> None:
            self.launches.append((grid, list(self.active)))

        return launch


@pytest.mark.interpreter
@pytest.mark.parametrize("kernel", ["adamw", "sumsq"])
def test_every_triton_launch_runs_under_the_tensors_device_guard(monkeypatch, kernel) -> None:
    monkeypatch.setenv("FUSEDZERO_BACKEND", "triton")
    active: list[torch.device] = []
    guarded: list[torch.device] = []

    @contextlib.contextmanager
    def guard(device: torch.device):
        guarded.append(device)
        active.append(device)
        try:
            yield
        finally:
            active.pop()

    fake = _FakeKernel(active)
    mod = adamw_mod if kernel == "adamw" else sumsq_mod
    monkeypatch.setattr(mod, "device_guard", guard)
    monkeypatch.setattr(
        mod, "_grouped_adamw_kernel" if kernel == "adamw" else "_grouped_sumsq_kernel", fake
    )
    x = torch.randn(3 * 256)
    if kernel == "adamw":
        adamw_step(
            x,
            x.clone(),
            x.clone(),
            x.clone().abs(),
            **_scalars(),
            **HP,
            num_buckets=3,
            shard_numel=256,
        )
    else:
        sumsq(x, num_buckets=3, shard_numel=256)
    assert guarded == [x.device]
    assert len(fake.launches) == 1 and fake.launches[0][1] == [x.device], (
        f"{kernel} launched outside the device guard: {fake.launches}"
    )
