"""Faults and worker management: a worker killed mid-workload, re-admission, drain, add/remove.

The kill test restarts the killed worker on the same port, so the session's workers are whole again after.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from tests.router.conftest import list_workers, run_router, wait_for

LONG = {"sampling_params": {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}, "stream": True}


def _generate(url: str, i: int, stream: bool) -> dict:
    """One request; returns what happened (status, whether its stream broke, when its first byte came)."""
    body = {"text": f"request number {i} of the kill test", "stream": stream,
            "sampling_params": {"max_new_tokens": 120, "temperature": 0, "ignore_eos": True}}
    out: dict = {"first_byte": None}
    with requests.post(url + "/generate", json=body, stream=True, timeout=300) as r:
        out["status"] = r.status_code
        out["worker"] = r.headers.get("x-kvstrata-worker")
        raw = b""
        for chunk in r.iter_content(chunk_size=None):
            if out["first_byte"] is None:
                out["first_byte"] = time.monotonic()
            raw += chunk
    out["error_event"] = b'"error"' in raw
    out["events_before_error"] = raw.split(b'"error"')[0].count(b"data: {") - 1 if out["error_event"] else None
    out["done"] = raw.endswith(b"data: [DONE]\n\n") if stream else None
    return out


def test_killed_worker_costs_no_request_that_was_not_streaming(workers, tmp_path):
    with run_router(workers.urls, tmp_path / "router.log", "--policy", "round_robin") as router, \
            run_router([workers.urls[0]], tmp_path / "single.log") as single:
        # A stream that is mid-way on worker 0 when it dies must end with an error event and [DONE].
        broken: dict = {}
        with requests.post(single.url + "/generate", json={"text": "mid-stream", **LONG}, stream=True,
                           timeout=300) as mid:
            chunks = mid.iter_content(chunk_size=None)
            assert next(chunks).startswith(b"data: {")
            t = threading.Thread(target=lambda: broken.setdefault("raw", b"".join(chunks)))
            t.start()
            with ThreadPoolExecutor(16) as pool:
                futures = [pool.submit(_generate, router.url, i, i % 2 == 0) for i in range(16)]
                wait_for(lambda: list_workers(router)[workers.urls[0]]["in_flight"] >= 3, what="load on worker 0")
                workers.procs[0].proc.kill()          # SIGKILL: no goodbye
                killed_at = time.monotonic()
                results = [f.result() for f in futures]
            t.join(60)
        assert broken["raw"].endswith(b"data: [DONE]\n\n") and b'"error"' in broken["raw"].rsplit(b"data: ", 2)[1]

        dead, alive = workers.urls
        for r in results:
            assert r["status"] == 200 and r["done"] in (True, None), r
            if r["error_event"]:   # only a stream that had begun on the dead worker may break
                assert r["worker"] == dead and r["events_before_error"] >= 1 and r["first_byte"] < killed_at + 5, r
            else:
                assert r["worker"] in (dead, alive)
        assert all(not r["error_event"] for r in results if r["worker"] == alive)
        assert sum(r["worker"] == alive for r in results) > 8        # retried ones moved over
        wait_for(lambda: not list_workers(router)[dead]["healthy"], timeout_s=10, what="the dead worker out")
        metrics = requests.get(router.url + "/metrics", timeout=10).text
        assert f'kvstrata_router_retries_total{{worker="{dead}"}}' in metrics

        workers.restart(0)
        wait_for(lambda: list_workers(router)[workers.urls[0]]["healthy"], what="re-admission")
        counts = [_generate(router.url, 100 + i, False)["status"] for i in range(4)]
        assert counts == [200] * 4


def test_drain_waits_for_in_flight_requests(workers, tmp_path):
    with run_router(workers.urls, tmp_path / "router.log") as router:
        with requests.post(router.url + "/generate", json={"text": "drain me", **LONG}, stream=True,
                           timeout=300) as r:
            chunks = r.iter_content(chunk_size=None)
            next(chunks)
            [busy] = [u for u, w in list_workers(router).items() if w["in_flight"] == 1]
            drained: dict = {}
            t = threading.Thread(target=lambda: drained.update(
                resp=requests.post(router.url + "/remove_worker", params={"url": busy, "drain": "true"},
                                   timeout=300), at=time.monotonic()))
            t.start()
            wait_for(lambda: list_workers(router)[busy]["draining"], what="draining")
            other = _generate(router.url, 0, False)          # new requests avoid the draining worker
            assert other["status"] == 200
            assert list_workers(router)[busy]["in_flight"] == 1 and t.is_alive()
            b"".join(chunks)
            stream_end = time.monotonic()
        t.join(60)
        assert drained["resp"].status_code == 200 and drained["resp"].json()["drained"] is True
        assert drained["at"] >= stream_end - 0.5
        assert busy not in list_workers(router)
        added = requests.post(router.url + "/add_worker", params={"url": busy}, timeout=30).json()
        assert added["added"] and added["healthy"]
        assert busy in list_workers(router)


def test_add_and_remove_worker(workers, tmp_path):
    with run_router([workers.urls[0]], tmp_path / "router.log", "--policy", "round_robin") as router:
        assert list(list_workers(router)) == [workers.urls[0]]
        added = requests.post(router.url + "/add_worker", params={"url": workers.urls[1] + "/"}, timeout=30)
        assert added.status_code == 200 and added.json() == {"success": True, "url": workers.urls[1],
                                                            "added": True, "healthy": True}
        again = requests.post(router.url + "/add_worker", params={"url": workers.urls[1]}, timeout=30)
        assert again.json()["added"] is False
        for i in range(4):
            assert _generate(router.url, i, False)["status"] == 200
        metrics = requests.get(router.url + "/metrics", timeout=10).text
        for url in workers.urls:   # round robin used both
            assert f'kvstrata_router_requests_total{{worker="{url}"}} 2.0' in metrics
        removed = requests.post(router.url + "/remove_worker", params={"url": workers.urls[0]}, timeout=30)
        assert removed.status_code == 200 and list(list_workers(router)) == [workers.urls[1]]
        assert _generate(router.url, 9, False)["status"] == 200
        requests.post(router.url + "/remove_worker", params={"url": workers.urls[1]}, timeout=30)
        assert requests.get(router.url + "/health", timeout=10).status_code == 503
        none = requests.post(router.url + "/generate", json={"text": "x"}, timeout=30)
        assert none.status_code == 503 and "no worker" in none.json()["error"]["message"]
