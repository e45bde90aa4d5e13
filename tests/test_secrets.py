"""Keys, tokens and request ids: nothing blank turns auth off, nothing odd reaches logs."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.cli import EXIT_CONFIG, main
from tests.conftest import settings_for

RANKS = """\
groups:
  - name: dp-a
    ranks: [{name: r0, url: "http://127.0.0.1:8400"}]
"""


@pytest.mark.parametrize(
    "extra",
    ['api_keys: [""]', 'api_keys: ["  "]', 'api_keys: ["sk-1", ""]', 'api_keys: ["a b"]',
     'admin: {token: ""}', 'admin: {token: " \\t"}', 'admin: {metrics_token: ""}',
     "admin: {metrics_use_admin_token: true}", 'upstream_api_key: ""',
     'upstream_api_key: "a b"', 'upstream_api_key: "cl\u00e9"'],
)  # fmt: skip
def test_blank_secrets_refused_at_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: str
) -> None:
    config = tmp_path / "proxy.yaml"
    config.write_text(RANKS + extra + "\n")
    assert main(["serve", "--config", str(config)]) == EXIT_CONFIG == 2
    err = capsys.readouterr().err
    assert "invalid configuration" in err and ("api_key" in err or "admin" in err)


async def test_client_request_ids_are_checked(fakes, proxy, http) -> None:
    a = await fakes(name="a")
    p = await proxy(settings_for([a]))
    body = {"prompt": "x"}
    for given, kept in (("abc-123.x:y", True), ("x" * 129, False), ("a b", False),
                        ("a\u00e9", False), ("<script>", False), ("x" * 128, True)):  # fmt: skip
        async with http.post(p.url + "/tokenize", json=body, headers={"X-Request-Id": given}) as r:
            assert r.status == 200
            assert (r.headers["X-Request-Id"] == given) is kept, given
            assert r.headers["X-Request-Id"].startswith("ftp-") is not kept
    sent = [rid for _, _, rid in a.log if rid is not None]
    assert len(sent) == 6 and all(len(rid) <= 128 and " " not in rid for rid in sent)


async def test_metrics_token(fakes, proxy, http) -> None:
    a = await fakes(name="a")
    p = await proxy(settings_for([a], admin={"token": "adm", "metrics_use_admin_token": True}))
    async with http.get(p.url + "/metrics") as r:
        assert r.status == 401 and (await r.json())["error"]["code"] == "unauthorized"
    async with http.get(p.url + "/metrics", headers={"Authorization": "Bearer adm"}) as r:
        assert r.status == 200 and b"ftproxy_internal_errors_total" in await r.read()
    q = await proxy(settings_for([a], admin={"metrics_token": "m"}))
    async with http.get(q.url + "/metrics", headers={"Authorization": "Bearer adm"}) as r:
        assert r.status == 401
    async with http.get(q.url + "/metrics", headers={"Authorization": "Bearer m"}) as r:
        assert r.status == 200
