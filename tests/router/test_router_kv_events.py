"""tier_aware on KV events: the router learns what each worker holds from its events (not from what it sent
it), a subscriber that missed events detects the gap and resyncs, and POST /prefetch is admin-keyed and
refuses bad bodies. Two real tiny-model workers that publish events; real routers; real ZMQ sockets.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from kvstrata.bench.launcher import ServerProcess
from kvstrata.cache.events import AllCleared, BlocksStored
from kvstrata.kv_events.config import parse_kv_events_config
from kvstrata.kv_events.publisher import KVEventPublisher
from kvstrata.net import free_port
from kvstrata.router.kv_index import KVIndex
from kvstrata.router.kv_subscriber import EventSource, EventSubscriber
from tests.router.conftest import WORKER_FLAGS, run_router, wait_for

BLOCK = 16
ADMIN = "admin-secret"


def events_config(pub: int, replay: int) -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{pub}",
                       "replay_endpoint": f"tcp://127.0.0.1:{replay}", "buffer_steps": 4})


@pytest.fixture(scope="module")
def evented(tmp_path_factory) -> Iterator[list[tuple[ServerProcess, EventSource]]]:
    log_dir = tmp_path_factory.mktemp("evented")
    out = []
    try:
        for i in range(2):
            pub, replay = free_port(), free_port()
            proc = ServerProcess([*WORKER_FLAGS, "--hicache-storage-page-tokens", str(BLOCK), "--admin-api-key", ADMIN,
                                  "--kv-events-config", events_config(pub, replay)], str(log_dir / f"w{i}.log"))
            out.append((proc, EventSource(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")))
        with ThreadPoolExecutor(len(out)) as pool:        # both start at once
            list(pool.map(lambda p: p.start(), [proc for proc, _ in out]))
        yield out
    finally:
        for proc, _ in out:
            proc.stop()


def generate(url: str, ids: list[int]) -> dict:
    r = requests.post(url + "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1}},
                      timeout=60)
    r.raise_for_status()
    return r.json()


def samples(url: str, name: str) -> list:
    text = requests.get(url + "/metrics", timeout=10).text
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples if s.name.startswith(name)]


def test_router_routes_to_the_worker_that_holds_the_prefix(evented, tmp_path):
    urls = [p.url for p, _ in evented]
    rng = random.Random(3)
    history = [rng.randrange(10, 200) for _ in range(6 * BLOCK)]
    with run_router(urls, tmp_path / "router.log", "--policy", "tier_aware") as router:
        # The history is served by worker 1 directly: the router never saw it, only worker 1's events did.
        generate(urls[1], history)
        wait_for(lambda: any(s.value >= 6 for s in samples(router.url, "kvstrata_router_kv_index_blocks")),
                 what="the router's index to learn worker 1's blocks")
        for _ in range(3):
            generate(router.url, history + [rng.randrange(10, 200) for _ in range(8)])
        sent = {s.labels["worker"]: s.value for s in samples(router.url, "kvstrata_router_requests_total")}
        reasons = {s.labels["reason"] for s in samples(router.url, "kvstrata_router_routing_decisions_total")}
    assert sent == {urls[1]: 3}, f"the returning conversation went to {sent}"
    assert reasons == {"exact"}
    published = {s.name: s.value for s in samples(urls[1], "kvstrata:kv_event")}
    assert published["kvstrata:kv_events_published_total"] > 0 and published["kvstrata:kv_events_dropped_total"] == 0


def test_subscriber_that_missed_events_detects_the_gap_and_resyncs(evented):
    proc, source = evented[0]
    index = KVIndex()
    sub = EventSubscriber(proc.url, source, index).start()
    try:
        wait_for(lambda: sub.stats["resyncs"] >= 1, what="the first sync")
        rng = random.Random(9)
        first = [rng.randrange(10, 200) for _ in range(4 * BLOCK)]
        generate(proc.url, first)
        wait_for(lambda: len(index.hashes(first)) == 4, what="the first prompt's blocks")
        sub.pause()
        time.sleep(0.3)
        missed = []
        for _ in range(6):              # more batches than the replay buffer keeps: a dump is needed
            missed.append([rng.randrange(10, 200) for _ in range(3 * BLOCK)])
            generate(proc.url, missed[-1])
        requests.post(proc.url + "/flush_cache", timeout=30).raise_for_status()   # the first prompt goes
        generate(proc.url, missed[-1])
        sub.resume()
        generate(proc.url, [rng.randrange(10, 200) for _ in range(2 * BLOCK)])   # the batch that shows the gap
        wait_for(lambda: sub.stats["gaps"] >= 1 and index.covers([proc.url]), what="gap detection and resync")
        # Never routable on stale state: what the flush removed is gone from the index.
        assert index.match(proc.url, index.hashes(first)).device == 0
        assert len(index.hashes(missed[-1])) == 3
        fresh = KVIndex()
        other = EventSubscriber(proc.url, source, fresh).start()
        wait_for(lambda: other.stats["resyncs"] >= 1, what="a fresh subscriber's dump")
        other.stop()
        assert sub.stats["resyncs"] + sub.stats["replays"] >= 2
    finally:
        sub.stop()


def test_a_restarted_publisher_is_resynced_even_when_its_first_batches_were_missed():
    pub, replay = free_port(), free_port()
    config = parse_kv_events_config(events_config(pub, replay))
    source = EventSource(config.endpoint, config.replay_endpoint)
    first = KVEventPublisher(config, 4, snapshot=lambda: [AllCleared()])
    index = KVIndex()
    sub = EventSubscriber("w", source, index).start()
    try:
        wait_for(lambda: sub.stats["resyncs"] >= 1, what="the first sync")
        for i in range(5):
            first.publish([BlocksStored("CPU", [100 + i], None, [i] * 4)])
        wait_for(lambda: len(index.hashes([4] * 4)) == 1, what="the first life's blocks")
        first.close()
        time.sleep(2.1)           # past the window in which a batch at or below the last seq is a duplicate
        second = KVEventPublisher(config, 4, snapshot=lambda: [AllCleared()])   # its batch 0 goes unseen
        try:
            def noticed() -> bool:  # batches 1, 2, ... (below the first life's last) until one lands
                second.publish([BlocksStored("CPU", [7], None, [9] * 4)])
                time.sleep(0.1)
                return index.hashes([9] * 4) == [7]

            wait_for(noticed, what="the restart to be noticed and resynced")
            assert index.hashes([0] * 4) == [] and sub.stats["restarts"] >= 1
        finally:
            second.close()
    finally:
        sub.stop()


def test_prefetch_needs_the_admin_key_and_refuses_bad_bodies(evented):
    url = evented[0][0].url
    auth = {"authorization": f"Bearer {ADMIN}"}
    assert requests.post(url + "/prefetch", json={"input_ids": [1, 2, 3]}, timeout=10).status_code == 401
    assert requests.post(url + "/prefetch", json={"input_ids": [1, 2, 3]}, timeout=10,
                         headers={"authorization": "Bearer wrong"}).status_code == 401
    for bad in [b"", b"[1]", b"{", json.dumps({"input_ids": []}).encode(), json.dumps({"input_ids": [-1]}).encode(),
                json.dumps({"input_ids": [1], "text": "a"}).encode(), json.dumps({"input_ids": [True]}).encode(),
                json.dumps({"input_ids": [10 ** 9]}).encode(), json.dumps({"bogus": 1}).encode(),
                json.dumps({"text": 5}).encode(), json.dumps({"input_ids": [1], "cache_namespace": 3}).encode()]:
        r = requests.post(url + "/prefetch", data=bad, headers=auth, timeout=10)
        assert r.status_code == 400, (bad, r.status_code, r.text)
        assert "error" in r.json()
    r = requests.post(url + "/prefetch", json={"input_ids": list(range(10, 50))}, headers=auth, timeout=10)
    assert r.status_code == 202 and r.json() == {"accepted": True, "tokens": 40}
    r = requests.post(url + "/prefetch", json={"text": "hello there"}, headers=auth, timeout=10)
    assert r.status_code == 202
    wait_for(lambda: requests.get(url + "/server_info", timeout=10).json()["internal_states"][0]["prefetch_hints"] >= 2,
             what="the scheduler to take the hints")
    assert requests.get(url + "/health", timeout=10).status_code == 200


def test_session_breaks_ties_and_is_read_from_header_session_params_or_user():
    from kvstrata.router.args import RouterArgs
    from kvstrata.router.policies import TierAwarePolicy
    from kvstrata.router.request_key import session_id
    from kvstrata.router.workers import Worker

    index = KVIndex()
    workers = [Worker("http://127.0.0.1:1"), Worker("http://127.0.0.1:2")]
    for w in workers:
        index.reset(w.url, in_sync=True)
    index.block_size = BLOCK
    policy = TierAwarePolicy(RouterArgs(), index)
    key = tuple(range(40))
    first = policy.select(workers, key, "conv-1")
    assert first.reason == "exact"
    first.worker.in_flight = 1               # the other worker now comes first on load alone
    assert policy.select(workers, key).worker is not first.worker
    again = policy.select(workers, key, "conv-1")
    assert again.worker is first.worker and again.reason == "session"
    assert session_id({"x-session-id": "abc"}, b"{}") == "abc"
    assert session_id({}, json.dumps({"session_params": {"id": "s1"}}).encode()) == "s1"
    assert session_id({}, json.dumps({"messages": [], "user": "u7"}).encode()) == "u7"
    assert session_id({}, b'{"user": 5}') is None and session_id({}, b"not json user") is None


def _exact_policy(prefetch_hints: bool = True):
    from kvstrata.kv_events import wire
    from kvstrata.router.args import RouterArgs
    from kvstrata.router.policies import TierAwarePolicy
    from kvstrata.router.workers import Worker

    index = KVIndex()
    workers = [Worker("http://127.0.0.1:1"), Worker("http://127.0.0.1:2")]
    for w in workers:
        index.reset(w.url, in_sync=True)
    held = list(range(10, 10 + 4 * BLOCK))       # 4 blocks in w0's host memory (another router put them there)
    index.apply(workers[0].url, wire.KVEventBatch(ts=0.0, events=[wire.BlockStored(
        block_hashes=[1, 2, 3, 4], parent_block_hash=None, token_ids=held, block_size=BLOCK, lora_id=None,
        medium="CPU_PINNED")]))
    return TierAwarePolicy(RouterArgs(prefetch_hints=prefetch_hints), index), workers, tuple(held) + (7,) * 10


def test_exact_decision_reports_the_cache_it_expects_and_queues_only_the_miss():
    policy, (w0, w1), key = _exact_policy()
    d = policy.select([w0, w1], key)
    assert d.worker is w0 and d.reason == "exact"
    assert (d.cached_tokens, d.best_cached_tokens, d.warm_tokens) == (4 * BLOCK, 4 * BLOCK, 4 * BLOCK)
    # The queueing charge is the expected miss by the index, not by this router's tree (which never saw it).
    assert policy.prefill_units(w0, key, d) == 10
    w0.pending_prefill = 10_000                  # far busier: the other worker, with less cache than the best
    d = policy.select([w0, w1], key)
    assert d.worker is w1 and (d.cached_tokens, d.best_cached_tokens) == (0, 4 * BLOCK)
    assert policy.prefill_units(w1, key, d) == len(key)


def test_prefetch_hints_can_be_switched_off():
    policy, workers, key = _exact_policy(prefetch_hints=False)
    d = policy.select(workers, key)
    assert d.worker is workers[0] and d.cached_tokens == 4 * BLOCK and d.warm_tokens == 0


def _disk_blocks(index: KVIndex, worker: str, tokens: list[int], first_hash: int) -> list[int]:
    from kvstrata.kv_events import wire

    hashes = list(range(first_hash, first_hash + len(tokens) // BLOCK))
    index.apply(worker, wire.KVEventBatch(ts=0.0, events=[wire.BlockStored(
        block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=BLOCK, lora_id=None,
        medium="DISK")]))
    return hashes


def test_a_shared_store_keeps_its_blocks_after_the_writer_forgets_them():
    from kvstrata.kv_events import wire

    index = KVIndex()
    for w in ("a", "b", "c"):
        index.reset(w, in_sync=True)
    index.set_storage("a", "file:/l3")
    index.set_storage("b", "file:/l3")           # c has no L3
    tokens = list(range(10, 10 + 3 * BLOCK))
    hashes = _disk_blocks(index, "a", tokens, 1)
    assert index.match("b", index.hashes(tokens)).storage == 3
    # a's tree drops the node (host eviction), then a flushes and restarts: the store still holds the objects.
    index.apply("a", wire.KVEventBatch(ts=0.0, events=[wire.BlockRemoved(block_hashes=hashes, medium="DISK")]))
    index.apply("a", wire.KVEventBatch(ts=0.0, events=[wire.AllBlocksCleared()]))
    index.reset("a", in_sync=True)
    assert index.hashes(tokens) == hashes
    assert index.match("b", hashes).storage == 3 and index.match("a", hashes).storage == 3
    assert index.match("c", hashes).storage == 0
    # Blocks announced before the worker's store was known join the store once it is.
    index.reset("d", in_sync=True)
    early = _disk_blocks(index, "d", list(range(500, 500 + BLOCK)), 100)
    index.set_storage("d", "file:/l3")
    index.reset("d", in_sync=False)
    assert index.match("b", early).storage == 1


def test_a_shared_store_is_bounded(monkeypatch):
    from kvstrata.router import kv_index

    monkeypatch.setattr(kv_index, "MAX_STORE_BLOCKS", 2)
    index = KVIndex()
    index.reset("a", in_sync=True)
    index.set_storage("a", "file:/l3")
    first = list(range(10, 10 + BLOCK))
    _disk_blocks(index, "a", first, 1)
    _disk_blocks(index, "a", list(range(100, 100 + 2 * BLOCK)), 2)
    index.reset("a", in_sync=True)                # only the store remembers now, its two newest blocks
    assert index.hashes(first) == [] and index.size() == 2


def test_a_readmitted_worker_counts_only_after_a_fresh_dump(monkeypatch):
    import asyncio

    import zmq

    from kvstrata.router.args import RouterArgs
    from kvstrata.router.kv_subscriber import KVFeeds
    from kvstrata.router.monitor import WorkerMonitor
    from kvstrata.router.workers import WorkerRegistry

    config = parse_kv_events_config(events_config(free_port(), free_port()))
    publishers = [KVEventPublisher(config, 4, snapshot=lambda: [AllCleared()])]
    publishers[0].publish([BlocksStored("CPU", [1], None, [5] * 4)])
    feeds = KVFeeds(KVIndex())
    try:
        registry = WorkerRegistry()
        w, _ = registry.add("http://127.0.0.1:1")
        feeds.start(w.url, EventSource(config.endpoint, config.replay_endpoint))
        wait_for(lambda: feeds.index.hashes([5] * 4) == [1] and feeds.index.covers([w.url]), what="the first dump")
        first = feeds.subscribers[w.url]
        # The worker was taken out and restarted; the new process has published nothing the router saw.
        publishers[0].close()
        for _ in range(50):                            # the old sockets release their ports asynchronously
            try:
                publishers.append(KVEventPublisher(config, 4, snapshot=lambda: [AllCleared()]))
                break
            except zmq.ZMQError:
                time.sleep(0.1)
        w.admitted_before, w.healthy, w.success_streak = True, False, 1
        monitor = WorkerMonitor(RouterArgs(health_success_threshold=2), registry, None, feeds)

        async def ok(*_args) -> bool:
            return True

        monkeypatch.setattr(monitor, "_get_ok", ok)

        async def readmit() -> None:
            assert await monitor.check(w) and w.healthy
            assert feeds.index.match(w.url, [1]).device == 0      # the old life's blocks route nothing
            await asyncio.sleep(0.5)

        asyncio.run(readmit())
        wait_for(lambda: feeds.subscribers[w.url] is not first and feeds.index.covers([w.url]), what="the new dump")
        assert feeds.index.hashes([5] * 4) == [] and feeds.subscribers[w.url].stats["resyncs"] == 1
    finally:
        feeds.close()
        for p in publishers:
            p.close()
