"""The router's control plane and what it shows: admin key, loopback rule, POST only, no credential sent
to a worker that was not given it, worker URLs hidden from strangers, and a dashboard that renders a
hostile worker's data as text (in chromium).

A "stranger" is a non-loopback client: the router is bound to 127.0.0.1 in tests, so the requests carry
`X-Forwarded-For`, which uvicorn takes from a loopback peer as the client address (as behind a reverse
proxy on the same machine).
"""

from __future__ import annotations

import socket

import requests

from tests.capabilities import requires_chromium
from tests.router.conftest import list_workers, run_router
from tests.router.fake_worker import FakeWorker
from tests.server.browser import chromium_page, screenshot

STRANGER = {"X-Forwarded-For": "192.0.2.10"}
HTML_HOST_URL = "http://<img src=x onerror=alert(1)>:80"


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"     # nothing listens there once closed


def test_control_routes_are_post_only_and_refuse_strangers(tmp_path):
    with FakeWorker() as worker, FakeWorker() as other, run_router([worker.url], tmp_path / "router.log") as router:
        # No cross-site GET: a page that makes the browser GET these changes nothing.
        assert requests.get(router.url + "/add_worker", params={"url": other.url}, timeout=10).status_code == 405
        assert requests.get(router.url + "/remove_worker", params={"url": worker.url}, timeout=10).status_code == 405
        for path in ("/abort_request", "/flush_cache"):
            assert requests.get(router.url + path, timeout=10).status_code == 405
        # A hostname with HTML in it is no hostname.
        bad = requests.post(router.url + "/add_worker", params={"url": HTML_HOST_URL}, timeout=10)
        assert bad.status_code == 400 and "bad worker URL" in bad.json()["error"]["message"]
        assert list(list_workers(router)) == [worker.url]

        # Without --admin-api-key, a non-loopback client may neither change nor see the worker set.
        for method, path in [("POST", "/add_worker"), ("POST", "/remove_worker"), ("GET", "/list_workers"),
                             ("POST", "/abort_request"), ("POST", "/flush_cache")]:
            r = requests.request(method, router.url + path, params={"url": other.url}, json={"abort_all": True},
                                 headers=STRANGER, timeout=10)
            assert r.status_code == 403 and "admin" in r.json()["error"]["message"], (path, r.text)
        assert list(list_workers(router)) == [worker.url]
        assert not [p for _, p, _ in worker.seen if p.startswith(("/abort_request", "/flush_cache"))]
        # Nor may another site's page, through the operator's own browser on loopback (a form POST needs no
        # CORS preflight): the browser names that page's origin.
        for headers in ({"Origin": "https://evil.example"}, {"Sec-Fetch-Site": "cross-site"}):
            r = requests.post(router.url + "/add_worker", params={"url": other.url}, headers=headers, timeout=10)
            assert r.status_code == 403 and "another site" in r.json()["error"]["message"], r.text
        assert list(list_workers(router)) == [worker.url]
        # The same answer for an open, a closed and an unroutable port: /add_worker scans nothing.
        answers = {requests.post(router.url + "/add_worker", params={"url": url}, headers=STRANGER,
                                 timeout=10).text for url in (other.url, _closed_port_url(), "http://192.0.2.200:9")}
        assert len(answers) == 1, answers
        assert not other.seen

        # Strangers see worker ids; the operator on loopback sees URLs.
        for path in ("/metrics", "/dashboard/data"):
            text = requests.get(router.url + path, headers=STRANGER, timeout=10).text
            assert "worker-0" in text and "127.0.0.1" not in text, (path, text[:2000])
        answer = requests.post(router.url + "/generate", json={"text": "hi"}, headers=STRANGER, timeout=10)
        assert answer.status_code == 200 and answer.headers["x-kvstrata-worker"] == "worker-0"
        assert f'worker="{worker.url}"' in requests.get(router.url + "/metrics", timeout=10).text
        assert requests.post(router.url + "/generate", json={"text": "hi"},
                             timeout=10).headers["x-kvstrata-worker"] == worker.url


def test_admin_key_and_no_credential_to_a_worker_not_given_it(tmp_path):
    client, admin = {"Authorization": "Bearer router-key"}, {"Authorization": "Bearer admin-key"}
    flags = ("--api-key", "router-key", "--admin-api-key", "admin-key", "--policy", "round_robin")
    with FakeWorker() as configured, FakeWorker() as added, FakeWorker() as keyed, \
            run_router([configured.url], tmp_path / "router.log", *flags) as router:
        # The API key does not open the control routes, nor does loopback once an admin key is set.
        for headers in (client, {}):
            r = requests.post(router.url + "/add_worker", params={"url": added.url}, headers=headers, timeout=10)
            assert r.status_code == 401, r.text
            assert requests.get(router.url + "/list_workers", headers=headers, timeout=10).status_code == 401
        # The admin key does, from anywhere. A worker added at run time gets only the key given for it.
        r = requests.post(router.url + "/add_worker", params={"url": added.url}, headers={**admin, **STRANGER},
                          timeout=10)
        assert r.status_code == 200 and r.json()["added"] and r.json()["healthy"], r.text
        r = requests.post(router.url + "/add_worker", json={"url": keyed.url, "api_key": "keyed-key"},
                          headers=admin, timeout=10)
        assert r.status_code == 200 and r.json()["healthy"], r.text
        assert requests.get(router.url + "/list_workers", headers=admin, timeout=10).json()["urls"] == [
            configured.url, added.url, keyed.url]

        for i in range(6):      # round robin: two requests each, all carrying the client's key
            r = requests.post(router.url + "/generate", json={"text": f"{i}"}, headers=client, timeout=10)
            assert r.status_code == 200, r.text
        assert requests.get(router.url + "/dashboard/data", headers=client, timeout=10).status_code == 200
        for w in (configured, added, keyed):
            assert [p for m, p, _ in w.seen if m == "POST"] == ["/generate", "/generate"]
            assert any(p.startswith("/dashboard/data") for _, p, _ in w.seen)
        assert configured.credentials() == {"Bearer router-key"}     # named at start: --api-key
        assert added.credentials() == {None}                         # nothing, not even the client's key
        assert keyed.credentials() == {"Bearer keyed-key"}


# Values a hostile worker puts in its /dashboard/data: each would run a handler if written as markup.
PAYLOAD_ATTR = '"><img src=x onerror="window.__xss=1;alert(1)">'
PAYLOAD_TEXT = "<img src=x onerror=\"window.__xss=2;alert(2)\">"
HOSTILE_DATA = {
    "columns": ["t", "running", "queued", "engine_util", "hit_overall", "hit_device"],
    "rows": [[1.0, PAYLOAD_TEXT, PAYLOAD_TEXT, 0.5, 0.5, 0.5], [2.0, PAYLOAD_TEXT, PAYLOAD_TEXT, 0.5, 0.5, 0.5]],
    "totals": {"prompt_tokens": PAYLOAD_ATTR, "cached_tokens": PAYLOAD_ATTR, "device_hit_tokens": PAYLOAD_ATTR,
               "host_hit_tokens": PAYLOAD_ATTR, "storage_hit_tokens": PAYLOAD_ATTR},
    "tiers": ["device"],
    "minute": {"device": PAYLOAD_TEXT, "host": 0, "storage": 0, "computed": 1, "span_s": 60},
}


@requires_chromium
def test_dashboard_renders_a_hostile_workers_data_as_text(tmp_path):
    with FakeWorker(HOSTILE_DATA) as hostile, run_router([hostile.url], tmp_path / "router.log") as router:
        assert requests.post(router.url + "/add_worker", params={"url": HTML_HOST_URL}, timeout=10).status_code == 400
        with chromium_page(tmp_path / "profile") as (page, errors):
            dialogs: list[str] = []
            page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
            page.goto(router.url + "/dashboard")
            page.wait_for_function("document.getElementById('status').dataset.updates >= 2", timeout=30_000)
            try:
                assert page.evaluate("window.__xss") is None and not dialogs, dialogs
                assert page.locator("#w0 img").count() == 0
                shown = page.get_attribute("#w0 .tile.device .value", "data-value")
                assert shown == PAYLOAD_ATTR                                  # the value, as an attribute value
                assert PAYLOAD_TEXT in page.inner_text("#w0 .tiles")          # ... and as text
                assert hostile.url in page.inner_text("#w0 h2.url")
                assert not errors, errors
            finally:
                screenshot(page, "router-dashboard-hostile.png")
