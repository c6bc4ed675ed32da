"""The router's /dashboard: one row per worker (each its own /dashboard/data) and the routing decisions."""

from __future__ import annotations

import requests

from tests.capabilities import requires_chromium
from tests.router.conftest import run_router
from tests.server.browser import chromium_page, screenshot


def send_conversations(url: str, n: int = 6) -> None:
    """Two turns of n conversations through the router (the second turn reuses the first's prefix)."""
    for turn in range(2):
        for c in range(n):
            ids = [100 + c] * 40 + list(range(200, 200 + 20 * (turn + 1)))
            body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 2}}
            requests.post(url + "/generate", json=body, timeout=120).raise_for_status()


@requires_chromium
def test_router_dashboard_shows_every_worker_and_its_decisions(workers, tmp_path):
    workers.flush()
    with run_router(workers.urls, tmp_path / "router.log") as router:
        page_html = requests.get(router.url + "/dashboard", timeout=30)
        assert page_html.status_code == 200 and "updateRouter" in page_html.text
        assert requests.get(router.url + "/dashboard/data?since=soon", timeout=30).status_code == 400
        send_conversations(router.url)
        data = requests.get(router.url + "/dashboard/data", timeout=30).json()
        assert [w["url"] for w in data["workers"]] == workers.urls
        assert sum(d["count"] for d in data["decisions"]) == 12
        own = {w["url"]: w["data"]["totals"] for w in data["workers"]}
        for url in workers.urls:
            totals = requests.get(url + "/dashboard/data", timeout=30).json()["totals"]
            assert own[url]["prompt_tokens"] == totals["prompt_tokens"]
        assert sum(t["device_hit_tokens"] for t in own.values()) > 0

        with chromium_page(tmp_path / "profile") as (page, errors):
            page.goto(router.url + "/dashboard")
            page.wait_for_function("document.getElementById('status').dataset.updates >= 2", timeout=30_000)
            try:
                assert page.locator(".worker").count() == len(workers.urls)
                assert page.locator("#chart-decisions rect").count() >= 1
                for i, url in enumerate(workers.urls):
                    assert url in page.inner_text(f"#w{i} h2.url")
                    shown = page.get_attribute(f"#w{i} .tile.device .value", "data-value")
                    assert shown == str(own[url]["device_hit_tokens"])
                assert not errors, errors
            finally:
                screenshot(page, "router-dashboard.png")
