"""`--check-modules` (tests/_module_check.py): the profiler it runs on the test loop's thread
sees the functions that ran, including after a test replaced it with a cProfile of its own."""

from __future__ import annotations

import cProfile
import json
import sys

import pytest

import _module_check as mc

# Python 3.12 runs cProfile on sys.monitoring (PEP 669): sys.getprofile() no longer shows it, and
# a second cProfile cannot start while one runs ("Another profiling tool is already active").
MONITORING = sys.version_info >= (3, 12)


def _profiling() -> object:
    """The profiler running on this thread: the cProfile object (3.11), "cProfile" (3.12+: the
    name sys.monitoring holds for it), or None."""
    if MONITORING:
        return sys.monitoring.get_tool(sys.monitoring.PROFILER_ID)
    return sys.getprofile()


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> tuple[set[str], set[str]]:
    """The check's state for this test only: its own profiler, its own ran and pending sets.
    (The session's profiler, if any, is put back by monkeypatch and switched on again by the
    hook after the test: `pytest_runtest_logfinish`.)"""
    ran: set[str] = set()
    pending = {json.__file__, cProfile.__file__}
    monkeypatch.setattr(mc, "_ran", ran)
    monkeypatch.setattr(mc, "_pending", pending)
    monkeypatch.setattr(mc, "_since_harvest", 0)
    monkeypatch.setattr(mc, "_profiler", cProfile.Profile(builtins=False))
    return ran, pending


def test_harvest_records_what_ran_and_stops_when_nothing_is_pending(fresh) -> None:
    ran, pending = fresh
    prof = mc._profiler
    prof.enable()
    json.dumps({"a": [1, 2]})  # json/__init__.py: dumps
    mc._harvest()
    assert json.__file__ in ran and pending == {cProfile.__file__}
    assert mc._profiler is prof  # a module still pending: still on
    cProfile.label(mc._trace.__code__)  # cProfile.py: label
    mc._harvest()
    assert pending == set() and mc._profiler is None


@pytest.mark.skipif(
    MONITORING,
    reason="Python 3.12+: a test's own cProfile cannot replace the "
    "check's, it fails to start (see MONITORING)",
)
def test_a_test_s_own_cprofile_does_not_hide_what_runs_after_it(fresh) -> None:
    ran, pending = fresh
    mc._profiler.enable()
    inner = cProfile.Profile()
    inner.enable()  # replaces the check's profiler (one profile hook per thread)
    inner.disable()  # and leaves none
    mc.pytest_runtest_logfinish("a test", ("f.py", 0, "a test"))  # the hook after each test
    json.dumps([1])
    mc._harvest()
    assert json.__file__ in ran and pending == {cProfile.__file__}
    mc._profiler.disable()


def test_profiler_is_paused_inside_an_interpreted_grid_only(fresh, monkeypatch) -> None:
    """Triton's interpreter runs a kernel grid without our profiler (millions of calls of its
    own), which is back on after the grid, also after one that raised."""

    from triton.runtime.interpreter import GridExecutor

    seen = []

    def grid(self, fail: bool) -> None:
        seen.append(_profiling())
        if fail:
            raise ValueError("a kernel failed")

    monkeypatch.setattr(GridExecutor, "__call__", grid)
    undo = mc._pause_in_interpreted_grids()
    prof = mc._profiler
    prof.enable()
    try:
        GridExecutor.__call__(None, False)
        on_after = _profiling()
        with pytest.raises(ValueError):
            GridExecutor.__call__(None, True)
        on_after_raise = _profiling()
    finally:
        prof.disable()
        undo()
    assert seen == [None, None]
    on = "cProfile" if MONITORING else prof
    assert on_after == on and on_after_raise == on, (on_after, on_after_raise)
    assert GridExecutor.__call__ is grid  # undone
