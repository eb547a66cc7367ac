"""`--check-modules` (tests/_module_check.py): the profiler it runs on the test loop's thread
sees the functions that ran, including after a test replaced it with a cProfile of its own."""
from __future__ import annotations

import cProfile
import json

import pytest

import _module_check as mc


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
    import sys

    from triton.runtime.interpreter import GridExecutor
    seen = []

    def grid(self, fail: bool) -> None:
        seen.append(sys.getprofile())
        if fail:
            raise ValueError("a kernel failed")

    monkeypatch.setattr(GridExecutor, "__call__", grid)
    undo = mc._pause_in_interpreted_grids()
    prof = mc._profiler
    prof.enable()
    try:
        GridExecutor.__call__(None, False)
        on_after = sys.getprofile()
        with pytest.raises(ValueError):
            GridExecutor.__call__(None, True)
        on_after_raise = sys.getprofile()
    finally:
        prof.disable()
        undo()
    assert seen == [None, None]
    assert on_after is prof and on_after_raise is prof
    assert GridExecutor.__call__ is grid  # undone
