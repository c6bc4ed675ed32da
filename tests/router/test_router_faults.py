"""Faults and worker management: a worker killed mid-workload, re-admission, drain, add/remove, limits.

A worker's HTTP process is frozen with SIGSTOP where a test needs requests to stay in flight on it (the
tiny model would otherwise finish them before the checks). The kill test restarts the killed worker on
the same port, so the session's workers are whole again after it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import requests

from kvstrata.bench.launcher import ServerProcess
from tests.router.conftest import list_workers, run_router, wait_for
from tests.router.fake_worker import FakeWorker

# Long enough to still be streaming while a test does its checks (the tiny model decodes ~2 ms/token).
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
    out["done"] = raw.endswith(b"data: [DONE]\n\n") if stream else None
    return out


@contextlib.contextmanager
def frozen(proc: ServerProcess) -> Iterator[None]:
    """SIGSTOP the worker's HTTP process (requests to it wait, connections stay open); SIGCONT after."""
    os.kill(proc.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        if proc.proc.poll() is None:
            os.kill(proc.proc.pid, signal.SIGCONT)


def test_killed_worker_costs_no_request_that_was_not_streaming(workers, tmp_path):
    dead, alive = workers.urls
    with run_router(workers.urls, tmp_path / "router.log", "--policy", "round_robin") as router, \
            run_router([dead], tmp_path / "single.log") as single:
        broken: dict = {}
        with requests.post(single.url + "/generate", json={"text": "mid-stream", **LONG}, stream=True,
                           timeout=300) as mid:
            chunks = mid.iter_content(chunk_size=None)
            assert next(chunks).startswith(b"data: {")
            t = threading.Thread(target=lambda: broken.setdefault("raw", b"".join(chunks)))
            t.start()
            # Freeze worker 0 mid-stream, queue requests on it (nothing streams from it any more), kill it.
            with frozen(workers.procs[0]), ThreadPoolExecutor(16) as pool:
                futures = [pool.submit(_generate, router.url, i, i % 2 == 0) for i in range(16)]
                wait_for(lambda: list_workers(router)[dead]["in_flight"] >= 4, what="requests queued on worker 0")
                workers.procs[0].proc.kill()
                results = [f.result() for f in futures]
            t.join(60)
        # The stream that was mid-way ends with an error event and [DONE]; every other request succeeds.
        assert broken["raw"].endswith(b"data: [DONE]\n\n") and b'"error"' in broken["raw"].rsplit(b"data: ", 2)[1]
        for r in results:
            assert r["status"] == 200 and not r["error_event"] and r["done"] in (True, None), r
            assert r["worker"] == alive
        wait_for(lambda: not list_workers(router)[dead]["healthy"], timeout_s=10, what="the dead worker out")
        metrics = requests.get(router.url + "/metrics", timeout=10).text
        assert f'kvstrata_router_retries_total{{worker="{dead}"}}' in metrics

        workers.restart(0)
        wait_for(lambda: list_workers(router)[dead]["healthy"], what="re-admission")
        served = {_generate(router.url, 100 + i, False)["worker"] for i in range(4)}
        assert served == {dead, alive}       # round robin uses it again


def test_drain_waits_for_in_flight_requests(workers, tmp_path):
    busy, other = workers.urls
    with run_router(workers.urls, tmp_path / "router.log", "--policy", "round_robin") as router:
        with ThreadPoolExecutor(2) as pool:
            with frozen(workers.procs[0]):
                held = pool.submit(_generate, router.url, 0, False)          # round robin: worker 0 first
                wait_for(lambda: list_workers(router)[busy]["in_flight"] == 1, what="a request on worker 0")
                drain = pool.submit(requests.post, router.url + "/remove_worker",
                                    params={"url": busy, "drain": "true"}, timeout=300)
                wait_for(lambda: list_workers(router)[busy]["draining"], what="draining")
                assert [_generate(router.url, i, False)["worker"] for i in (1, 2)] == [other, other]
                time.sleep(0.5)
                assert not drain.done() and list_workers(router)[busy]["in_flight"] == 1
            assert held.result()["status"] == 200                          # thawed: it finishes...
            assert drain.result().status_code == 200 and drain.result().json()["drained"] is True   # ...then
        assert busy not in list_workers(router)
        added = requests.post(router.url + "/add_worker", params={"url": busy}, timeout=30).json()
        assert added["added"] and added["healthy"]
        assert busy in list_workers(router)


def test_add_and_remove_worker(workers, tmp_path):
    with run_router([workers.urls[0]], tmp_path / "router.log", "--policy", "round_robin") as router:
        assert list(list_workers(router)) == [workers.urls[0]]
        added = requests.post(router.url + "/add_worker", params={"url": workers.urls[1] + "/"}, timeout=30)
        assert added.status_code == 200 and added.json() == {"success": True, "url": workers.urls[1],
                                                            "id": "worker-1", "added": True, "healthy": True}
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


def test_api_key_and_concurrency_limit(workers, tmp_path):
    flags = ("--api-key", "router-key", "--max-concurrent-requests", "1")
    with run_router(workers.urls[:1], tmp_path / "router.log", *flags) as router:
        body = {"text": "with a key", "sampling_params": {"max_new_tokens": 2}}
        assert requests.post(router.url + "/generate", json=body, timeout=60).status_code == 401
        assert requests.get(router.url + "/list_workers", timeout=10).status_code == 401
        assert requests.get(router.url + "/health", timeout=10).status_code == 200
        assert requests.get(router.url + "/metrics", timeout=10).status_code == 200
        auth = {"Authorization": "Bearer router-key"}
        assert requests.post(router.url + "/generate", json=body, headers=auth, timeout=60).status_code == 200
        with ThreadPoolExecutor(1) as pool:
            with frozen(workers.procs[0]):
                held = pool.submit(requests.post, router.url + "/generate", json=body, headers=auth, timeout=120)
                wait_for(lambda: requests.get(router.url + "/list_workers", headers=auth,
                                              timeout=10).json()["active_requests"] == 1, what="a held request")
                over = requests.post(router.url + "/generate", json=body, headers=auth, timeout=60)
                assert over.status_code == 429 and "max-concurrent-requests" in over.json()["error"]["message"]
            assert held.result().status_code == 200
        assert requests.post(router.url + "/generate", json=body, headers=auth, timeout=60).status_code == 200


def test_frozen_worker_is_taken_out_within_the_first_byte_bound(workers, tmp_path):
    stuck, alive = workers.urls
    bound = 2.0
    # Health checks alone would not notice in time (one check waits a minute): the bound must.
    flags = ("--policy", "round_robin", "--worker-first-byte-timeout-secs", str(bound),
             "--health-check-timeout-secs", "60")
    with run_router(workers.urls, tmp_path / "router.log", *flags) as router:
        with frozen(workers.procs[0]), ThreadPoolExecutor(8) as pool:
            start = time.monotonic()
            futures = [pool.submit(_generate, router.url, i, i % 2 == 0) for i in range(8)]
            results = [f.result() for f in futures]
            assert list_workers(router)[stuck]["stalled"]
            later = time.monotonic()
            after = _generate(router.url, 99, True)        # a new request does not wait on it at all
        for r in (*results, after):
            assert r["status"] == 200 and not r["error_event"] and r["done"] in (True, None), r
            assert r["worker"] == alive
        # Half the requests went to the frozen worker first: none waited on it much beyond the bound.
        assert max(r["first_byte"] for r in results) - start < bound + 10
        assert after["first_byte"] - later < bound
        # Thawed, it answers again (its /load report) and takes requests again.
        wait_for(lambda: not list_workers(router)[stuck]["stalled"] and list_workers(router)[stuck]["healthy"],
                 timeout_s=30, what="the thawed worker back")
        served = {_generate(router.url, 100 + i, False)["worker"] for i in range(4)}
        assert served == {stuck, alive}
        metrics = requests.get(router.url + "/metrics", timeout=10).text
        assert f'kvstrata_router_retries_total{{worker="{stuck}"}}' in metrics


def test_stream_stuck_after_its_status_line_is_retried_elsewhere(tmp_path):
    """A frozen scheduler behind a live HTTP front end: the stream's status line comes, its first event
    never does. No request waits on it beyond the bound; the client never sees that attempt."""
    bound = 1.5
    flags = ("--policy", "round_robin", "--worker-first-byte-timeout-secs", str(bound))
    with FakeWorker() as stuck, FakeWorker() as fine, \
            run_router([stuck.url, fine.url], tmp_path / "router.log", *flags) as router:
        stuck.freeze()
        body = {"text": "x", "stream": True}
        with ThreadPoolExecutor(6) as pool:
            start = time.monotonic()
            answers = list(pool.map(lambda _: requests.post(router.url + "/generate", json=body, timeout=20),
                                    range(6)))
            elapsed = time.monotonic() - start
        assert [(a.status_code, a.headers["x-kvstrata-worker"]) for a in answers] == [(200, fine.url)] * 6
        assert elapsed < bound + 5, elapsed
        assert list_workers(router)[stuck.url]["stalled"] and list_workers(router)[stuck.url]["healthy"]
        assert sum(p == "/generate" for m, p, _ in stuck.seen if m == "POST") >= 1
        stuck.thaw()
        wait_for(lambda: not list_workers(router)[stuck.url]["stalled"], timeout_s=15, what="the thawed worker back")
        served = {requests.post(router.url + "/generate", json={"text": "y"}, timeout=20).headers["x-kvstrata-worker"]
                  for _ in range(4)}
        assert served == {stuck.url, fine.url}
