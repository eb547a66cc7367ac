"""Models and data shared by test modules: `from _helpers import ...` (tests/ is on sys.path, the
folder of the root conftest.py, in the test process and in the ranks it spawns).

Library-side helpers (ranks on gloo, a fake process group) are `fusedzero.testing`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fusedzero import Groups, Sharding, ZeroAdamW
from fusedzero.app.model import GPT, GPTConfig, gpt_param_groups


class TwoLinear(nn.Module):
    """`b(tanh(a(x)))`: two linear layers, sizes chosen by the test (uneven ones exercise
    padding and params cut at shard edges)."""

    def __init__(self, d_in: int, hidden: int, d_out: int) -> None:
        super().__init__()
        self.a = nn.Linear(d_in, hidden)
        self.b = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class Stack(nn.Module):
    """Three stage-3 units (the ModuleList children) and a root-owned head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


def make_gpt(cfg: GPTConfig, seed: int = 0) -> GPT:
    """The GPT of `cfg`, initialised from `seed` (the global RNG, as the ranks seed it)."""
    torch.manual_seed(seed)
    return GPT(cfg)


def assert_memory_is_plan(opt: Any, want: Any, what: str) -> None:
    """`opt.memory()` equals a `StagePlan`'s bytes to the byte (params, grads, optimizer,
    total), and `opt.comm`'s bytes so far (one step) its comm per step."""
    mem = opt.memory()
    got = (mem.params, mem.grads, mem.optimizer, mem.total)
    assert got == (
        want.params_bytes,
        want.grads_bytes,
        want.optimizer_bytes,
        want.total_bytes,
    ), what
    assert opt.comm.total_bytes == want.comm_bytes_per_step, (what, opt.comm.snapshot())


def gpt_batch(cfg: GPTConfig, batch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s global batch of `batch` random token sequences: (inputs, next tokens)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def fast_only(cases: Iterable[Any], fast: Callable[[Any], bool]) -> list[Any]:
    """`cases` for `pytest.mark.parametrize`, those `fast` rejects marked slow: the fast tier
    runs a few that together still reach every branch, the slow tier the rest. A tuple case is
    the values of several argnames."""
    return [
        c
        if fast(c)
        else pytest.param(*(c if isinstance(c, tuple) else (c,)), marks=pytest.mark.slow)
        for c in cases
    ]


# -- a tiny trained checkpoint, the input of the checkpoint trust and hostile-input tests ------
TINY_CKPT = GPTConfig(vocab_size=31, block_size=8, n_layer=1, n_head=2, n_embd=16)


def tiny_ckpt_opt(
    cfg: GPTConfig = TINY_CKPT, stage: int = 1, pg: Any = None, rep: Any = None
) -> tuple[GPT, ZeroAdamW]:
    """The GPT of `cfg` (seed 0) and its optimizer: small buckets, so params cross them."""
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = ZeroAdamW(
        gpt_param_groups(model, 0.1),
        lr=1e-2,
        stage=stage,
        module=model,
        groups=Groups(shard=pg, replicate=rep),
        sharding=Sharding(bucket_numel=700),
    )
    return model, opt


def tiny_train(model: GPT, opt: ZeroAdamW, steps: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, model.config.vocab_size, (2, model.config.block_size + 1), generator=g)
        model(x[:, :-1], x[:, 1:])[1].backward()
        opt.step()
        opt.zero_grad()


def two_step_root(root: Path, build: Callable[[], tuple[GPT, ZeroAdamW]]) -> Path:
    """`root` holding step-1 and step-2 of a trained model (non-zero moments)."""
    from fusedzero import checkpoint

    model, opt = build()
    tiny_train(model, opt, 1)
    checkpoint.save(opt, root, step=1)
    tiny_train(model, opt, 1, seed=1)
    checkpoint.save(opt, root, step=2)
    return root


def refused_then_upgraded(old: Path, opt: ZeroAdamW, version: int, root: Path) -> Path:
    """A checkpoint of an older format `version`: `verify` and `load` refuse it, naming the
    converter; `fusedzero ckpt upgrade` writes `root` (checking every sha256 first), which
    verifies as format 3."""
    from fusedzero import checkpoint as ck
    from fusedzero.app.ckpt_cli import main as ckpt_main

    for call in (lambda: ck.verify(old), lambda: ck.load(opt, old)):
        with pytest.raises(
            ck.CheckpointError,
            match=rf"format version {version}, .* convert it "
            r"with `fusedzero ckpt upgrade",
        ):
            call()
    assert ckpt_main(["ckpt", "upgrade", str(old), str(root)]) == 0
    ck.verify(root)
    assert ck.read_manifest(root)["version"] == 3
    return root


def copy_root(src: Path, tmp_path: Path, tag: str = "c") -> Path:
    """A copy of a checkpoint root to tamper with (symlinks kept as links)."""
    dst = tmp_path / tag
    shutil.copytree(src, dst, symlinks=True)
    return dst


def run_forked(
    body: Callable[[], None],
    out_dir: Path,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """`body()` in a fork of this process, as a subprocess would run it but without a fresh
    interpreter importing torch (seconds): its own stdout and stderr (files in `out_dir`), `env`
    added to its environment, one torch thread; a crash (SIGSEGV) or an exception is its exit
    status, never this process's. Not where torch sees a GPU: a fork keeps the parent's CUDA
    state, which no environment variable can hide from it, and cannot run a backward once the
    parent has run one (`run_isolated` picks a fresh interpreter there)."""
    out, err = out_dir / "forked.out", out_dir / "forked.err"
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            for fd, path in ((1, out), (2, err)):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
            sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - the child's own
            sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
            os.environ.update(env or {})
            # A fork of a process whose OpenMP pool has run hangs in its first parallel region
            # (libgomp is not fork-safe), and this one may have run it (`fusedzero train` in
            # process sets a rank's threads): one thread, as every test runs (conftest.py).
            torch.set_num_threads(1)
            try:
                body()
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:  # noqa: BLE001 - the body's error is its output
                traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + timeout
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise subprocess.TimeoutExpired([f"fork of {os.getpid()}"], timeout)
        time.sleep(0.02)
    return subprocess.CompletedProcess(
        [f"fork of {os.getpid()}"],
        os.waitstatus_to_exitcode(done[1]),
        out.read_text(errors="replace"),
        err.read_text(errors="replace"),
    )


def run_isolated(
    fn: Callable[..., None],
    args: tuple[Any, ...],
    out_dir: Path,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """`fn(*args)` (a module-level function of a test file; `args` by repr) away from this
    process, a crash its exit status: in a fork (`run_forked`, milliseconds) where torch sees no
    GPU, else in a fresh interpreter (seconds). Where torch sees a GPU, this process's first
    backward started autograd's per-device threads, after which a fork's backward raises
    "Unable to handle autograd's threading in combination with fork-based multiprocessing" (the
    H200 run of 2026-11-27, docs/gpu_suite.md); no environment variable undoes that."""
    if not torch.cuda.is_available():
        return run_forked(lambda: fn(*args), out_dir, timeout, env)
    here = Path(__file__).resolve().parent
    code = (
        f"import sys; sys.path[:0] = [{str(here)!r}]; import runpy; "
        f"runpy.run_path({fn.__code__.co_filename!r})[{fn.__name__!r}](*{args!r})"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def compile_offline(module: str, out: Path, *args: str, timeout: float = 300) -> list[dict]:
    """Run `python -m fusedzero.kernels.<module> --json OUT [args]` (module: `_compile`, ...;
    an offline compile for a CUDA target, no GPU) in a child process without the interpreter
    (this process imported triton with it, where nothing compiles); its JSON rows."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run(
        [sys.executable, "-m", f"fusedzero.kernels.{module}", "--json", str(out), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"offline compile failed:\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


def rewrite_shard(d: Path, edit: Callable[[str, torch.Tensor], torch.Tensor]) -> None:
    """Rewrite checkpoint folder `d`'s rank-0 shard with its own header rows, tensors changed by
    `edit`, and the manifest's size and sha256 updated to match: only checks of the values (or
    of what the header binds) can catch it."""
    from safetensors import safe_open

    from fusedzero import checkpoint as ck

    p = d / ck.shard_file_name(0, 1)
    with safe_open(p, framework="pt") as f:
        meta = f.metadata()
        tensors = {k: edit(k, f.get_tensor(k)) for k in f.keys()}
    w = ck.SafetensorsWriter(p, [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()], meta)
    for k, t in tensors.items():
        w.write(k, t)
    size, sha = w.close()
    m = json.loads((d / ck.MANIFEST).read_text())
    m["files"][0].update(bytes=size, sha256=sha)
    (d / ck.MANIFEST).write_text(json.dumps(m))


def cli_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """`fusedzero ARGV` exits 2 with exactly one stderr line, `fusedzero: error: ...`: that line."""
    from fusedzero import cli

    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fusedzero: error: "), err
    return lines[0]
