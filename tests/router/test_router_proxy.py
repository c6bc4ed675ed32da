"""The router proxies a worker's API unchanged: streams byte for byte (native and OpenAI), 4xx as is."""

from __future__ import annotations

import json
import re
import time

import openai
import pytest
import requests

from tests.router.conftest import run_router, wait_for
from tests.router.tap import TcpTap

# Fields that differ between two runs of the same request (ids, clocks, which worker had it cached).
VOLATILE = re.compile(rb'"(id|created|e2e_latency|cached_tokens|system_fingerprint)": ?("[^"]*"|[0-9.e-]+|null)')


def masked(raw: bytes) -> bytes:
    """`raw` with the volatile fields' values replaced, everything else byte for byte."""
    return VOLATILE.sub(rb'"\1": _', raw)


def post_raw(url: str, path: str, body: dict) -> requests.Response:
    r = requests.post(url + path, json=body, timeout=120)
    r.content  # noqa: B018 - read the whole body
    return r


NATIVE_STREAM = {"text": "The router must not change a byte", "stream": True,
                 "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
OPENAI_STREAM = {"model": "tiny", "messages": [{"role": "user", "content": "stream me"}], "max_tokens": 10,
                 "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
COMPLETION_STREAM = {"model": "tiny", "prompt": "once upon a time", "max_tokens": 10, "temperature": 0,
                     "stream": True}


@pytest.fixture(scope="module")
def tapped(workers, tmp_path_factory):
    """(router, tap): a router whose only worker is worker 0 seen through a recording relay."""
    host, port = workers.urls[0].rsplit(":", 1)
    with TcpTap(host.split("//")[1], int(port)) as tap:
        with run_router([tap.url], tmp_path_factory.mktemp("tapped") / "router.log") as r:
            yield r, tap


@pytest.mark.parametrize("path,body", [("/generate", NATIVE_STREAM), ("/v1/chat/completions", OPENAI_STREAM),
                                       ("/v1/completions", COMPLETION_STREAM)])
def test_stream_is_byte_identical_to_the_worker(tapped, path, body):
    router, tap = tapped
    before = _streams(tap)
    routed = post_raw(router.url, path, body)
    assert routed.status_code == 200 and routed.content.endswith(b"data: [DONE]\n\n")
    wait_for(lambda: len(_streams(tap)) == len(before) + 1, what="the tapped stream")
    [(headers, worker_bytes)] = [s for s in _streams(tap) if s not in before]
    assert routed.content == worker_bytes                     # every byte, every event, the same [DONE]
    assert routed.headers["content-type"] == headers["content-type"]
    assert routed.content.count(b"data: ") > 3


def _streams(tap: TcpTap) -> list[tuple[dict, bytes]]:
    return [(h, b) for _, h, b in tap.responses()
            if h.get("content-type", "").startswith("text/event-stream") and b.endswith(b"[DONE]\n\n")]


def test_stream_matches_a_direct_request(router, workers):
    """Same request to the worker directly and through the router: same events, modulo ids and clocks."""
    direct = post_raw(workers.urls[0], "/generate", NATIVE_STREAM)
    routed = post_raw(router.url, "/generate", NATIVE_STREAM)
    assert direct.status_code == routed.status_code == 200
    assert _final_event(masked(routed.content)) == _final_event(masked(direct.content))


def _final_event(raw: bytes) -> bytes:
    events = raw.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    return events[-3]


@pytest.mark.parametrize("path,body", [
    ("/generate", {"text": ["batch one", "batch two"], "sampling_params": {"max_new_tokens": 5, "temperature": 0}}),
    ("/generate", {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 5, "temperature": 0}}),
    ("/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 5, "temperature": 0}),
])
def test_json_answers_are_identical(router, workers, path, body):
    direct, routed = post_raw(workers.urls[1], path, body), post_raw(router.url, path, body)
    assert direct.status_code == routed.status_code == 200
    assert masked(routed.content) == masked(direct.content)


@pytest.mark.parametrize("path,body", [
    ("/generate", {"text": 1}),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": -3}}),
    ("/v1/chat/completions", {"model": "tiny", "messages": "not a list"}),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": "hot"}),
])
def test_worker_4xx_passes_through_unchanged(router, workers, path, body):
    direct, routed = post_raw(workers.urls[0], path, body), post_raw(router.url, path, body)
    assert 400 <= direct.status_code < 500
    assert routed.status_code == direct.status_code
    assert routed.content == direct.content
    assert routed.headers["content-type"] == direct.headers["content-type"]


def test_malformed_json_reaches_the_worker(router, workers):
    r = requests.post(router.url + "/generate", data=b"{not json", timeout=30)
    d = requests.post(workers.urls[0] + "/generate", data=b"{not json", timeout=30)
    assert r.status_code == d.status_code == 400 and r.content == d.content


def test_stream_is_not_buffered(router):
    """The first event reaches the client before the worker has produced the last one."""
    body = {"text": "long answer please", "stream": True,
            "sampling_params": {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}}
    start = time.perf_counter()
    with requests.post(router.url + "/generate", json=body, stream=True, timeout=120) as r:
        chunks = r.iter_content(chunk_size=None)
        first = next(chunks)
        first_arrival = time.perf_counter() - start
        raw = first + b"".join(chunks)
    events = [json.loads(e[len(b"data: "):]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    assert len(events) > 100 and events[-1]["meta_info"]["completion_tokens"] == 1500
    # e2e_latency: seconds since the worker got the request, when it made the event.
    assert first_arrival < events[-1]["meta_info"]["e2e_latency"] / 2


def test_openai_client_through_the_router(router):
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none")
    assert [m.id for m in client.models.list().data] == ["tiny"]
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=4, temperature=0)
    assert out.usage.completion_tokens == 4
    chunks = list(client.completions.create(model="tiny", prompt="abc", max_tokens=4, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices)


def test_info_health_flush_and_metrics(router, workers):
    assert requests.get(router.url + "/health", timeout=10).status_code == 200
    assert requests.get(router.url + "/health_generate", timeout=60).status_code == 200
    # what a worker answers (its resolved model folder, so SGLang's scripts can load the tokenizer from it)
    direct = requests.get(workers.urls[0] + "/get_model_info", timeout=10).json()
    assert requests.get(router.url + "/get_model_info", timeout=10).json() == direct
    assert "max_total_tokens" in requests.get(router.url + "/get_server_info", timeout=10).json()
    flushed = requests.post(router.url + "/flush_cache", timeout=60)
    assert flushed.status_code == 200 and sorted(flushed.json()["workers"]) == sorted(workers.urls)
    text = requests.get(router.url + "/metrics", timeout=10).text
    for name in ("kvstrata_router_requests_total", "kvstrata_router_in_flight_requests",
                 "kvstrata_router_routing_decisions_total", "kvstrata_router_worker_healthy"):
        assert name in text
    assert re.search(r'kvstrata_router_routing_decisions_total\{reason="[a-z_]+",worker="http', text)


def test_worker_load_report(workers):
    load = requests.get(workers.urls[0] + "/load", timeout=10).json()
    for key in ("running_requests", "waiting_requests", "free_pages", "capacity_pages", "pool_usage",
                "device_hit_tokens", "host_hit_tokens", "storage_hit_tokens"):
        assert key in load
    assert 0.0 <= load["pool_usage"] <= 1.0 and load["storage_id"] is None


def test_bad_add_worker_is_400(router):
    for url in ("", "foo", "http://127.0.0.1", "ftp://127.0.0.1:1"):
        r = requests.post(router.url + "/add_worker", params={"url": url}, timeout=10)
        assert r.status_code == 400 and "worker URL" in r.json()["error"]["message"]
    r = requests.post(router.url + "/remove_worker", params={"url": "http://127.0.0.1:1"}, timeout=10)
    assert r.status_code == 404
