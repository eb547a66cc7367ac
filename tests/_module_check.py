"""`pytest --check-modules`: the run fails unless it touched every module of the package.

A module is touched when code of one of its functions ran in this process during the tests
(module-level code does not count: importing `fusedzero.optim` alone imports most of the
package, and a test that only imports a module tests nothing in it); a module with no function
at all (re-exports, constants) is touched when it was imported. Ranks and CLIs a test spawns are
other processes and do not count. CI runs it with the fast tier, which must touch everything:

    python -m pytest -q -m "not slow" --check-modules

The trace is a global `sys.settrace` function that records each new frame's file and returns
None (no line events), installed for the test loop only and removed as soon as every module it
waits for has run; off without the flag.
"""
from __future__ import annotations

import ast
import sys
import threading
from collections.abc import Iterator
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
    "fusedzero/spawn.py": "starts rank processes: every run_ranks test and tests/app/test_train.py",
    "fusedzero/app/loop.py": "the training loop of `fusedzero train`: tests/app/test_train.py",
    "fusedzero/app/lifecycle.py": "a training run's start and end: tests/app/test_train.py",
    "fusedzero/app/log.py": "a training run's console log: tests/app/test_train.py",
    "fusedzero/app/resume.py": "`fusedzero train --resume`: tests/app/test_train.py, "
                               "tests/checkpoint/test_checkpoint_hostile.py",
    "fusedzero/app/summary.py": "a training run's summary: tests/app/test_train.py",
    "fusedzero/checkpoint/dcp.py": "needs a torch.distributed.checkpoint folder: "
                                   "tests/checkpoint/test_dcp_import.py",
    "fusedzero/checkpoint/hf.py": "needs transformers models: tests/checkpoint/test_hf.py",
    "kernels/compile_memory_modes.py": "offline compilation (a child without the interpreter): "
                                       "tests/kernels/test_compile.py",
    "kernels/compile_quant.py": "offline compilation of the wire kernels (a child without the "
                                "interpreter): tests/kernels/test_quant.py",
    "kernels/compile_scalars.py": "offline compilation of the step's scalar kernels (a child "
                                  "without the interpreter): tests/kernels/test_step_scalars.py",
}

_ran: set[str] = set()
_pending: set[str] = set()  # files of the modules not yet run, as code objects name them


def _trace(frame: FrameType, event: str, arg: Any) -> None:
    f = frame.f_code.co_filename
    _ran.add(f)
    if f in _pending:
        _pending.discard(f)
        if not _pending:  # every module has run: stop paying for the trace
            sys.settrace(None)
            threading.settrace(None)  # type: ignore[arg-type]


def _modules() -> list[Path]:
    return [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--check-modules", action="store_true",
                     help="fail unless the run's tests ran code of every module under "
                          f"{', '.join(PACKAGES)}/ (tests/_module_check.py)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtestloop(session: pytest.Session) -> Iterator[None]:
    on = session.config.getoption("check_modules")
    if on:
        _pending.update(str(p) for p in _modules() if _has_function(p)
                        and p.relative_to(ROOT).as_posix() not in SLOW_ONLY)
        threading.settrace(_trace)
        sys.settrace(_trace)
    try:
        yield
    finally:
        if on:
            sys.settrace(None)
            threading.settrace(None)  # type: ignore[arg-type]


def _has_function(path: Path) -> bool:
    tree = ast.parse(path.read_text(), str(path))
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(tree))


def untouched() -> list[str]:
    """The package's modules (repo-relative paths) that this run did not touch, but for
    `SLOW_ONLY`."""
    ran = {str(Path(f).resolve()) for f in _ran if not f.startswith("<")}
    imported = {str(Path(m.__file__).resolve()) for m in list(sys.modules.values())
                if getattr(m, "__file__", None)}
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
        msg = (f"--check-modules: {len(missing)} module(s) ran no code in this run's tests: "
               f"{', '.join(missing)}; add a test of the tier that exercises them")
        if reporter is not None:
            reporter.write_line(msg, red=True)
        else:
            print(msg, file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
