"""Tests wait for a condition, never for a length of time: `wait_for` polls the condition until
it holds, and fails at a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    condition: Callable[[], T], what: str, timeout_s: float = 10.0, interval_s: float = 0.01
) -> T:
    """Poll `condition` until it returns something true, and return that; fail after
    `timeout_s`, naming `what` was awaited."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval_s)
    return value
