"""KV events (--kv-events-config): a plain ZMQ + msgpack subscriber, written from the published wire format
(kvstrata/kv_events/wire.py's docstring, vLLM's KVEventBatch) and not with our decoder, rebuilds each tier's
block set, and it equals the tree's residency, computed here independently, after a workload with
evictions, demotions, L3 writes and prefetches, and a flush. Events off: no socket, no tracker.
"""

from __future__ import annotations

import random
import time

import msgpack
import pytest
import zmq

from kvstrata.cache.page_hash import page_keys, request_namespace
from kvstrata.kv_events.config import parse_kv_events_config
from kvstrata.kv_events.publisher import KVEventPublisher
from kvstrata.net import free_port
from kvstrata.runtime.req import Req
from kvstrata.runtime.sampling_params import SamplingParams
from tests.cache.drivers import serve, settle
from tests.cache.stack import make_cache

PAGE = 2
GROUP = 4          # tokens per block (L3 page group): two pages


class PlainSubscriber:
    """A KV event subscriber from the wire format alone: [topic, seq, msgpack [ts, events, rank]]."""

    def __init__(self, endpoint: str):
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.blocks: dict[str, set[int]] = {}
        self.chain: dict[int, tuple] = {}     # hash -> (parent, tokens), from BlockStored
        self.last_seq = -1

    def drain_until(self, seq: int, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.last_seq < seq:
            assert self.sock.poll(max(1, int(1000 * (deadline - time.monotonic())))), \
                f"no event batch {self.last_seq + 1} within {timeout_s} s"
            topic, seq_frame, payload = self.sock.recv_multipart()
            n = int.from_bytes(seq_frame, "big")
            # batch 0 ([AllBlocksCleared] at start) may go out before the subscription lands; no other
            if not (n == self.last_seq + 1 or self.last_seq == -1 and n == 1):
                raise AssertionError(f"sequence gap: {self.last_seq} then {n}")
            self.last_seq = n
            ts, events, rank = msgpack.unpackb(payload)
            assert isinstance(ts, float) and rank == 0
            for event in events:
                self.apply(event)

    def apply(self, event: list) -> None:
        tag = event[0]
        if tag == "BlockStored":
            hashes, parent, tokens, block_size, lora_id, medium = event[1:]
            assert block_size == GROUP and lora_id is None and len(tokens) == GROUP * len(hashes)
            for i, h in enumerate(hashes):
                self.blocks.setdefault(medium, set()).add(h)
                self.chain[h] = (parent if i == 0 else hashes[i - 1], tuple(tokens[i * GROUP:(i + 1) * GROUP]))
        elif tag == "BlockRemoved":
            hashes, medium = event[1:]
            missing = set(hashes) - self.blocks.get(medium, set())
            assert not missing, f"removed from {medium} what was never stored there: {missing}"
            self.blocks[medium] -= set(hashes)
        else:
            assert event == ["AllBlocksCleared"], event
            self.blocks.clear()

    def close(self) -> None:
        self.sock.close(linger=0)


def tree_residency(manager) -> tuple[dict[str, set[int]], dict[int, str]]:
    """Block hashes per medium from the tree, by its own records (not events.py), and each L3 block's key."""
    tree, storage = manager.tree, manager.storage
    out = {"CPU": set(), "CPU_PINNED": set(), "DISK": set()}
    l3_keys = {}
    for root in tree.roots():
        ns = request_namespace(storage.storage_namespace, root.namespace)
        stack = [(child, [], []) for child in root.children.values()]
        while stack:
            node, tokens, host = stack.pop()
            tokens = tokens + list(node.key)
            host = host + [node.host_ready] * len(node.key)
            keys = page_keys(tokens, GROUP, ns)
            start = len(tokens) - len(node.key)
            for g, key in enumerate(keys):
                end = (g + 1) * GROUP
                if end <= start:
                    continue          # the group ends in an ancestor
                h = int(key, 16) & ((1 << 64) - 1)
                if node.device_slots is not None:
                    out["CPU"].add(h)
                if all(host[end - GROUP:end]):
                    out["CPU_PINNED"].add(h)
                if node.storage is not None and node.storage.backed:
                    assert key in node.storage.keys
                    out["DISK"].add(h)
                    l3_keys[h] = key
            stack.extend((c, tokens, host) for c in node.children.values())
    return out, l3_keys


@pytest.fixture
def evented(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    port, replay = free_port(), free_port()
    config = f'{{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:{port}", ' \
             f'"replay_endpoint": "tcp://127.0.0.1:{replay}"}}'
    manager, _ = make_cache(PAGE, 24, 64, model_dir=str(model_dir), enable_hierarchical_cache=True,
                            hicache_ratio=2.0, hicache_storage_backend="file", hicache_storage_dir=str(tmp_path),
                            hicache_storage_page_tokens=GROUP, hicache_storage_prefetch_policy="best_effort",
                            kv_events_config=config)
    publisher = KVEventPublisher(parse_kv_events_config(config), GROUP, manager.events.snapshot)
    manager.publish_events = publisher.publish
    sub = PlainSubscriber(f"tcp://127.0.0.1:{port}")
    time.sleep(0.3)                          # the subscription reaches the PUB socket before the first event
    yield manager, publisher, sub
    sub.close()
    publisher.close()
    manager.close()


def serve_or_settle(manager, req: Req) -> None:
    """serve(), first letting in-flight copies land if the pool is short while they lock their pages."""
    if manager.admit(req) and manager.reserve(req, req.fill_len - req.kv_len):
        manager.take_layer_wait()
        manager.advance(req, req.slot_len)
        manager.release(req)
        return
    manager.release(req, cache=False)
    settle(manager)
    manager.begin_step()
    serve(manager, req)


def published_seq(publisher: KVEventPublisher) -> int:
    deadline = time.monotonic() + 10
    while publisher.metrics()["queued_batches"] and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    return publisher.metrics()["last_seq"]


def check_equal(manager, publisher, sub) -> None:
    manager.flush_events()
    sub.drain_until(published_seq(publisher))
    expected, l3_keys = tree_residency(manager)
    for medium, hashes in expected.items():
        assert sub.blocks.get(medium, set()) == hashes, f"{medium}: subscriber and tree differ"
    stored = manager.storage.io.backend
    assert stored.batch_exists([l3_keys[h] for h in sorted(expected["DISK"])]) == len(expected["DISK"])


def test_plain_subscriber_rebuilds_every_tier_under_pressure(evented):
    manager, publisher, sub = evented
    rng = random.Random(5)
    bases = [[rng.randrange(1, 50) for _ in range(12)] for _ in range(4)]
    for step in range(40):
        base = bases[rng.randrange(len(bases))]
        prompt = base + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 10))]
        req = Req(rid=str(step), prompt_ids=prompt, sampling=SamplingParams(max_new_tokens=1))
        manager.start_prefetch(req)
        manager.begin_step()
        serve_or_settle(manager, req)                 # inserts; evicts (demotes) when the pool is short
        manager.flush_events()
        if step % 7 == 3:
            manager.device.evict(10 ** 6)             # demote everything to L2
        if step % 11 == 5:
            settle(manager)
            manager.host.evict(6)                     # L2 evictions: those blocks remain in L3 only
        if step % 5 == 0:
            check_equal(manager, publisher, sub)      # with copies and L3 writes still in flight
    settle(manager)
    manager.begin_step()
    check_equal(manager, publisher, sub)
    assert sub.blocks["DISK"] and sub.blocks["CPU_PINNED"], "the workload must reach L2 and L3"
    assert manager.device.stats["demoted_pages"] and manager.host.stats["host_evicted_pages"]
    # chained and namespaced: each stored block names its parent, and its hash is its L3 page-group key
    h = next(iter(sub.blocks["DISK"]))
    assert h in sub.chain
    manager.flush()
    check_equal(manager, publisher, sub)
    assert not any(sub.blocks.values())
    assert publisher.metrics()["dropped_events"] == 0


def test_replay_and_dump_serve_a_late_subscriber(evented):
    manager, publisher, sub = evented
    for i in range(3):
        serve(manager, Req(rid=str(i), prompt_ids=[i + 1] * 9, sampling=SamplingParams(max_new_tokens=1)))
        manager.flush_events()
    last = published_seq(publisher)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(publisher.config.replay_endpoint)
    try:
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])          # replay from seq 1
        got = []
        while True:
            assert dealer.poll(5000)
            _, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                break
            got.append(int.from_bytes(seq, "big"))
        assert got == list(range(1, last + 1))
        dealer.send_multipart([b"", (-1).to_bytes(8, "big", signed=True)])   # full state
        assert dealer.poll(5000)
        _, seq, payload = dealer.recv_multipart()
        assert int.from_bytes(seq, "big", signed=True) == last
        late = PlainSubscriber.__new__(PlainSubscriber)
        late.blocks, late.chain = {}, {}
        for event in msgpack.unpackb(payload)[1]:
            late.apply(event)
        expected, _ = tree_residency(manager)
        assert {m: b for m, b in late.blocks.items() if b} == {m: b for m, b in expected.items() if b}
        dealer.send_multipart([b"", b"bad"])                           # malformed: dropped and counted
        dealer.send_multipart([b"x", b"y", b"z", b"w"])
        deadline = time.monotonic() + 5
        while publisher.metrics()["bad_replay_requests"] < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert publisher.metrics()["bad_replay_requests"] == 2
    finally:
        dealer.close(linger=0)


def test_events_off_means_no_tracker_and_no_socket():
    manager, _ = make_cache(PAGE, 24, 64)
    assert manager.events is None and manager.tree.events is None
    serve(manager, Req(rid="a", prompt_ids=[1] * 9, sampling=SamplingParams(max_new_tokens=1)))
    manager.flush_events()          # a no-op
    assert parse_kv_events_config(None) is None
    assert parse_kv_events_config('{"publisher": "null"}') is None
    assert parse_kv_events_config('{"enable_kv_cache_events": false, "publisher": "zmq"}') is None
