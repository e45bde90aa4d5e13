"""The run's closing summary of suites skipped for want of a tool."""

from __future__ import annotations

import pytest

from tests import optional


def test_a_skip_from_unavailable_is_named_with_its_enabling_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception) as skipped:
        optional.unavailable("etcd", "etcd is not installed")
    reason = str(skipped.value)
    assert optional.suite_of(reason) == "etcd"
    lines = optional.summary([reason, reason, "some other skip"])
    assert lines == [
        "  etcd: 2 test(s) skipped (coordination against a real etcd); "
        "enable: apt-get install etcd-server"
    ]


def test_under_ci_a_missing_tool_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI must have it"):
        optional.unavailable("containers", "podman is not installed")


def test_other_skips_name_no_suite() -> None:
    assert optional.suite_of("vllm not installed") is None
    assert optional.summary(["x [needs: nosuch]"]) == []
