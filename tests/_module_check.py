"""`pytest --check-modules`: the run fails unless it touched every module of the package.

A module is touched when code of one of its functions ran in this process during the tests
(module-level code does not count: importing `fusedzero.optim` alone imports most of the
package, and a test that only imports a module tests nothing in it); a module with no function
at all (re-exports, constants) is touched when it was imported. Ranks and CLIs a test spawns are
other processes and do not count. CI runs it with the fast tier, which must touch everything:

    python -m pytest -q -m "not slow" --check-modules

How: on the test loop's thread, cProfile (C-level, no builtins) records every function called;
after every HARVEST_EVERY tests its functions' files are harvested and the profiler cleared, and
it is switched off once every module it waits for has run. A test that runs its own cProfile
replaces ours for its duration (3.11 has one profile hook per thread), so ours is switched back
on after every test. It is paused while Triton's interpreter runs a kernel grid: our launchers,
which count, call it; inside it run millions of Python calls of Triton's own machinery and of
the kernel bodies, which do not count (a module whose only functions were `@triton.jit` kernels
would need a plain function that a test runs). Threads the tests start get a
`threading.settrace` function that records each new frame's file and returns None (no line
events). Off without the flag.

A global `sys.settrace` on the main thread, as before, cost more: the interpreted kernels make
millions of Python calls, and a Python-level trace call each costs more than cProfile's C one.
The fast tier, one run each on this 2-core machine: 61 s with that trace, 55 s with the
profiler on throughout, 45-49 s with the pauses, 36-38 s unchecked.
"""

from __future__ import annotations

import ast
import cProfile
import functools
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fusedzero", "kernels")  # kernels/ installs as fusedzero.kernels

# Modules whose code only the slow tier runs, each with why; everything else must be touched by
# the fast tier. Adding a module here is a decision a reviewer sees, not a way around the check.
SLOW_ONLY = {
    "fusedzero/__init__.py": "lazy re-exports (PEP 562 __getattr__), run when test modules import "
    "`from fusedzero import ...` at collection, before the test loop",
    "fusedzero/_spawn.py": "starts rank processes: every run_ranks test and "
    "tests/app/test_train.py",
    "fusedzero/app/loop.py": "the training loop of `fusedzero train`: tests/app/test_train.py",
    "fusedzero/app/lifecycle.py": "a training run's start and end: tests/app/test_train.py",
    "fusedzero/app/log.py": "a training run's console log: tests/app/test_train.py",
    "fusedzero/app/resume.py": "`fusedzero train --resume`: tests/app/test_train.py, "
    "tests/checkpoint/test_checkpoint_hostile.py",
    "fusedzero/app/summary.py": "a training run's summary: tests/app/test_train.py",
    "fusedzero/checkpoint/dcp.py": "needs a torch.distributed.checkpoint folder: "
    "tests/checkpoint/test_dcp_import.py",
    "fusedzero/checkpoint/hf.py": "needs transformers models: tests/checkpoint/test_hf.py",
    "fusedzero/integrations/hf.py": "a transformers.Trainer subclass: importing the Trainer costs "
    "seconds; tests/integrations/test_hf_trainer.py",
    "fusedzero/integrations/lightning.py": "a Lightning strategy: importing lightning costs "
    "seconds; tests/integrations/test_lightning_strategy.py",
    "kernels/_compile_muon.py": "offline compilation of Muon's element-wise kernels (a child "
    "without the interpreter): tests/kernels/test_muon.py",
    "kernels/_compile_memory_modes.py": "offline compilation (a child without the interpreter): "
    "tests/kernels/test_compile.py",
    "kernels/_compile_quant.py": "offline compilation of the wire kernels (a child without the "
    "interpreter): tests/kernels/test_quant.py",
    "kernels/_compile_scalars.py": "offline compilation of the step's scalar kernels (a child "
    "without the interpreter): tests/kernels/test_step_scalars.py",
}

_ran: set[str] = set()
_pending: set[str] = set()  # files of the modules not yet run, as code objects name them


def _trace(frame: FrameType, event: str, arg: Any) -> None:
    """Other threads' trace: each new frame's file."""
    f = frame.f_code.co_filename
    _ran.add(f)
    _pending.discard(f)


# How many tests run between two harvests of the profiler (each costs a few ms).
HARVEST_EVERY = 10
_profiler: cProfile.Profile | None = None  # on while modules are pending
_since_harvest = 0


def _harvest() -> None:
    """The files of the functions the profiler saw since the last harvest into `_ran`; the
    profiler off for good once no module is pending."""
    global _profiler
    if _profiler is None:
        return
    _profiler.disable()
    for entry in _profiler.getstats():
        if not isinstance(entry.code, str):  # (a str: a builtin, not recorded with builtins off)
            _ran.add(entry.code.co_filename)
    _profiler.clear()
    _pending.difference_update(_ran)
    if _pending:
        _profiler.enable()
    else:  # every module has run: stop paying for the profiler and the threads' trace
        _profiler = None
        threading.settrace(None)  # type: ignore[arg-type]


def _pause_in_interpreted_grids() -> Callable[[], None]:
    """Pause the profiler while Triton's interpreter runs a kernel grid (see the module
    docstring); returns the undo. No-op where Triton has no interpreter."""
    try:
        from triton.runtime.interpreter import GridExecutor
    except ImportError:
        return lambda: None
    run = GridExecutor.__call__

    @functools.wraps(run)
    def paused(self: Any, *args: Any, **kwargs: Any) -> Any:
        prof = _profiler
        if prof is None:
            return run(self, *args, **kwargs)
        prof.disable()
        try:
            return run(self, *args, **kwargs)
        finally:
            if _profiler is prof:  # (not switched off for good meanwhile)
                prof.enable()

    GridExecutor.__call__ = paused  # type: ignore[method-assign]

    def undo() -> None:
        GridExecutor.__call__ = run  # type: ignore[method-assign]

    return undo


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    global _since_harvest
    if _profiler is None:
        return
    _since_harvest += 1
    if _since_harvest >= HARVEST_EVERY:
        _since_harvest = 0
        _harvest()
    else:
        _profiler.enable()  # back on after a test that ran its own cProfile


def _modules() -> list[Path]:
    return [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--check-modules",
        action="store_true",
        help="fail unless the run's tests ran code of every module under "
        f"{', '.join(PACKAGES)}/ (tests/_module_check.py)",
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtestloop(session: pytest.Session) -> Iterator[None]:
    global _profiler
    on = session.config.getoption("check_modules")
    if on:
        _pending.update(
            str(p)
            for p in _modules()
            if _has_function(p) and p.relative_to(ROOT).as_posix() not in SLOW_ONLY
        )
        _profiler = cProfile.Profile(builtins=False)
        unpause = _pause_in_interpreted_grids()
        threading.settrace(_trace)
        _profiler.enable()
    try:
        yield
    finally:
        if on:
            unpause()
            _harvest()
            if _profiler is not None:
                _profiler.disable()
            threading.settrace(None)  # type: ignore[arg-type]


def _has_function(path: Path) -> bool:
    tree = ast.parse(path.read_text(), str(path))
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(tree))


def untouched() -> list[str]:
    """The package's modules (repo-relative paths) that this run did not touch, but for
    `SLOW_ONLY`."""
    ran = {str(Path(f).resolve()) for f in _ran if not f.startswith("<")}
    imported = {
        str(Path(m.__file__).resolve())
        for m in list(sys.modules.values())
        if getattr(m, "__file__", None)
    }
    missing = []
    for path in _modules():
        f, name = str(path.resolve()), path.relative_to(ROOT).as_posix()
        if f in ran or (f in imported and not _has_function(path)) or name in SLOW_ONLY:
            continue
        missing.append(name)
    return missing


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not session.config.getoption("check_modules"):
        return
    missing = untouched()
    if missing:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        msg = (
            f"--check-modules: {len(missing)} module(s) ran no code in this run's tests: "
            f"{', '.join(missing)}; add a test of the tier that exercises them"
        )
        if reporter is not None:
            reporter.write_line(msg, red=True)
        else:
            print(msg, file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
