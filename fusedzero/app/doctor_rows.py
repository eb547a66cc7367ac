"""The rows of `fusedzero doctor`'s table, and how one check becomes a row."""
from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable
from typing import Any


class Status(enum.Enum):
    OK = "ok"
    FAIL = "FAIL"
    SKIPPED = "skipped"
    INFO = "info"  # ran and measured, but the figure is no pass/fail on this device


@dataclasses.dataclass
class Row:
    check: str
    status: Status
    detail: str
    seconds: float = 0.0
    data: dict[str, Any] = dataclasses.field(default_factory=dict)


class Skip(Exception):
    """Raised by a check that cannot run here; the message is the reason."""


class Measured(Exception):
    """Raised by a check that ran but can give no verdict here; the message says what ran and
    what its figure means on this device, `data` holds the figures."""

    def __init__(self, detail: str, data: dict[str, Any]) -> None:
        super().__init__(detail)
        self.data = data


def row(check: str, fn: Callable[[], tuple[str, dict[str, Any]] | str]) -> Row:
    """Run one check: ok with its detail, FAIL with the error, skipped with the reason, info
    with what a measurement means here."""
    t = time.perf_counter()
    try:
        got = fn()
        detail, data = got if isinstance(got, tuple) else (got, {})
        status = Status.OK
    except Measured as e:
        status, detail, data = Status.INFO, str(e), e.data
    except Skip as e:
        status, detail, data = Status.SKIPPED, str(e), {}
    except Exception as e:  # noqa: BLE001 - every failure is a row, the other checks still run
        status, detail, data = Status.FAIL, f"{type(e).__name__}: {' '.join(str(e).split())}", {}
    return Row(check, status, detail, time.perf_counter() - t, data)
