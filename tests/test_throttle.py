"""Log lines once a minute per key (proxy.core.throttle)."""

from __future__ import annotations

import pytest

from proxy.core import throttle
from proxy.core.throttle import Throttle


def test_a_key_s_line_is_due_once_per_interval_and_keys_are_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [1000.0]
    monkeypatch.setattr(throttle.time, "monotonic", lambda: now[0])
    lines = Throttle(every_s=60.0)
    assert lines.due("a")
    assert not lines.due("a")
    assert lines.due(("b", 1))  # another key: its own minute
    now[0] += 59.9
    assert not lines.due("a")
    now[0] += 0.1
    assert lines.due("a")
    assert not lines.due("a")


def test_a_key_is_due_at_once_just_after_the_clock_s_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(throttle.time, "monotonic", lambda: 0.0)
    assert Throttle().due("a")


def test_the_record_starts_over_past_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(throttle.time, "monotonic", lambda: 1000.0)
    lines = Throttle()
    for key in range(throttle.MAX_KEYS + 1):
        assert lines.due(key)
    assert not lines.due(0)
    assert lines.due("one more")  # the record, over its bound, starts over
    assert lines.due(0)
