"""A collective that ran past the group's timeout ends the run as a CollectiveTimeout naming the
wait and the limit, whichever of gloo's words reported it: "Timed out waiting ..." from the op
that ran out of time, or "Application timeout caused pair closure" from one whose connection the
timeout closed (a CI run of tests/zero/test_lifecycle.py's stalled-rank case got the second and
ended with gloo's bare words). No process group needed: the handles here raise as gloo does.

About an internal: fusedzero._comm."""

from __future__ import annotations

import datetime

import pytest

from fusedzero import _comm as comm
from fusedzero.app.log import waiting_for

GLOO = [
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Application timeout caused pair closure",
    "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 8000ms "
    "for recv operation to complete",
]


class _Raises:
    def __init__(self, msg: str) -> None:
        self.msg = msg

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        raise RuntimeError(self.msg)


@pytest.mark.parametrize("msg", GLOO)
def test_a_timeout_in_either_words_is_a_collective_timeout(msg: str) -> None:
    # Raised at once (elapsed far below the limit): only the words say it timed out.
    with pytest.raises(
        comm.CollectiveTimeout,
        match=r"timed out .*limit 8s.* waiting for the "
        r"grad-norm all-reduce",
    ):
        comm.wait(_Raises(msg), what="the grad-norm all-reduce", timeout=8.0, host_blocking=True)
    with pytest.raises(
        comm.CollectiveTimeout,
        match=r"timed out \(limit [0-9.]+s\) waiting for "
        r"the all-reduce of logged losses",
    ):
        with waiting_for("the all-reduce of logged losses"):
            raise RuntimeError(msg)


def test_other_errors_keep_their_words() -> None:
    with pytest.raises(RuntimeError, match="failed: Connection reset by peer") as e:
        comm.wait(
            _Raises("Connection reset by peer"), what="a gather", timeout=8.0, host_blocking=True
        )
    assert not isinstance(e.value, comm.CollectiveTimeout)
    with pytest.raises(RuntimeError, match="^Connection reset by peer$") as e:
        with waiting_for("a barrier"):
            raise RuntimeError("Connection reset by peer")
    assert not isinstance(e.value, comm.CollectiveTimeout)
