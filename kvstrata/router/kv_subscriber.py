"""EventSubscriber: one worker's KV events into the router's KVIndex, with gap detection and resync.

A thread per worker reads the PUB stream ([topic, seq, payload], wire.py). Batch seq must follow the last
one applied:

    seq == last + 1     applied
    seq <= last         within DUPLICATE_WINDOW_S of a resync: a duplicate (the dump or replay had it),
                        skipped; later (or seq 0): the worker restarted (its first batches may have gone out
                        before this socket reconnected): resync
    seq > last + 1      a gap: the worker is out of sync (its blocks are not used) until the missed batches
                        are replayed from its replay endpoint, or, when they are gone, a full-state dump

The first sync is a dump too, so a router that starts after its workers is exact at once. Every frame is
validated (typed msgpack decode, sizes); a bad one is a gap.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass

import msgspec
import zmq

from kvstrata.kv_events import wire
from kvstrata.router.kv_index import KVIndex

logger = logging.getLogger(__name__)

POLL_MS = 100
REPLAY_TIMEOUT_MS = 3000
MAX_MESSAGE_BYTES = 64 << 20
DUPLICATE_WINDOW_S = 2.0       # live batches a dump or replay already covered arrive right after it


@dataclass(frozen=True)
class EventSource:
    """Where a worker publishes: its PUB endpoint, replay endpoint (None: no resync possible) and topic."""

    endpoint: str
    replay_endpoint: str | None
    topic: str = ""


class EventSubscriber:
    """The thread that keeps one worker's part of the index in step with its event stream."""

    def __init__(self, worker: str, source: EventSource, index: KVIndex):
        self.worker = worker
        self.source = source
        self.index = index
        self.last_seq = -1
        self._synced_at = 0.0               # monotonic time of the last dump or replay
        self.stats: Counter = Counter()
        self._running = True
        self._paused = threading.Event()
        self._ctx = zmq.Context.instance()
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{worker}", daemon=True)

    def start(self) -> EventSubscriber:
        """Start reading."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop reading and forget this worker's blocks."""
        self._running = False
        self._thread.join(timeout=2.0)
        self.index.reset(self.worker, in_sync=False)

    def pause(self) -> None:
        """Drop what arrives, unseen, until resume(): a lossy link, for tests (the next batch shows a gap)."""
        self._paused.set()

    def resume(self) -> None:
        """Read again after pause()."""
        self._paused.clear()

    # ---- the thread ---------------------------------------------------------------------------------------

    def _run(self) -> None:
        while self._running:
            sub = self._connect()
            try:
                self._resync("start")
                while self._running:
                    if sub.poll(POLL_MS):
                        frames = sub.recv_multipart()
                        if self._paused.is_set():
                            self.stats["dropped_while_paused"] += 1
                            continue
                        self._receive(frames)
            except Exception:                    # a bug must not end the thread: resync and go on
                logger.exception("KV event subscriber of %s failed", self.worker)
                self.index.set_in_sync(self.worker, False)
                time.sleep(0.5)
            finally:
                sub.close(linger=0)

    def _connect(self) -> zmq.Socket:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        sub.connect(self.source.endpoint)
        return sub

    def _receive(self, frames: list[bytes]) -> None:
        try:
            if len(frames) != 3:
                raise ValueError(f"{len(frames)} frames")
            seq = wire.seq_of(frames[1])
            batch = wire.decode_batch(frames[2])
        except (ValueError, msgspec.DecodeError) as e:
            self.stats["bad_messages"] += 1
            logger.warning("bad KV event message from %s (%s): resync", self.worker, e)
            self._resync("bad message")
            return
        if seq == self.last_seq + 1:
            self._apply(seq, batch)
        elif seq <= self.last_seq and (seq == 0 < self.last_seq
                                       or time.monotonic() - self._synced_at > DUPLICATE_WINDOW_S):
            self.stats["restarts"] += 1
            self._resync("restart")
        elif seq > self.last_seq + 1:
            self.stats["gaps"] += 1
            self.index.set_in_sync(self.worker, False)
            if not self._replay(self.last_seq + 1, seq):
                self._resync("gap")
            if seq == self.last_seq + 1:
                self._apply(seq, batch)
        else:
            self.stats["duplicates"] += 1

    def _apply(self, seq: int, batch: wire.KVEventBatch) -> None:
        try:
            self.index.apply(self.worker, batch)
        except ValueError as e:
            self.stats["bad_messages"] += 1
            logger.warning("bad KV event batch %d from %s (%s): resync", seq, self.worker, e)
            self._resync("bad batch")
            return
        self.last_seq = seq
        self.stats["batches"] += 1

    def _replay(self, start: int, upto: int) -> bool:
        """Apply batches [start, upto) from the replay endpoint; False if they are not all there."""
        got = self._ask(start)
        if got is None:
            return False
        wanted = [(s, p) for s, p in got if start <= s < upto]
        if [s for s, _ in wanted] != list(range(start, upto)):
            return False
        for seq, payload in wanted:
            self._apply(seq, wire.decode_batch(payload))
        self.stats["replays"] += 1
        self._synced_at = time.monotonic()
        self.index.set_in_sync(self.worker, True)
        return True

    def _resync(self, why: str) -> None:
        """Replace this worker's blocks with its full state (the replay endpoint's dump)."""
        self.index.reset(self.worker, in_sync=False)
        got = self._ask(wire.DUMP_SEQ)
        if not got:
            self.last_seq = -1 if why == "start" else self.last_seq
            logger.warning("KV events of %s: no state dump (%s); exact routing is off for it", self.worker, why)
            return
        seq, payload = got[0]
        self.index.apply(self.worker, wire.decode_batch(payload))
        self.last_seq = seq
        self._synced_at = time.monotonic()
        self.stats["resyncs"] += 1
        self.index.set_in_sync(self.worker, True)

    def _ask(self, start: int) -> list[tuple[int, bytes]] | None:
        """Send one replay request; the (seq, payload) answers up to END_SEQ, None on silence or garbage."""
        if self.source.replay_endpoint is None:
            return None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        dealer.connect(self.source.replay_endpoint)
        out: list[tuple[int, bytes]] = []
        try:
            dealer.send_multipart([b"", wire.seq_bytes(start)])
            while dealer.poll(REPLAY_TIMEOUT_MS):
                frames = dealer.recv_multipart()
                if len(frames) != 3 or frames[0] != b"":
                    return None
                seq = wire.seq_of(frames[1])
                if frames[1] == wire.END_SEQ:
                    return out
                out.append((seq, frames[2]))
            return None
        except ValueError:
            return None
        finally:
            dealer.close(linger=0)


def source_from_config(raw: object, worker_url: str) -> EventSource | None:
    """Where the worker at `worker_url` publishes, from the `kv_events_config` of its /server_info (None: it
    does not, or the value is not a valid config). A wildcard host means the worker's own host."""
    from urllib.parse import urlsplit

    from kvstrata.config_cli import ConfigError
    from kvstrata.kv_events.config import parse_kv_events_config

    if not isinstance(raw, str):
        return None
    try:
        config = parse_kv_events_config(raw)
    except ConfigError as e:
        logger.warning("worker %s reports a bad kv_events_config (%s): no exact routing for it", worker_url, e)
        return None
    if config is None:
        return None
    host = urlsplit(worker_url).hostname or "127.0.0.1"

    def reachable(endpoint: str | None) -> str | None:
        if endpoint is None:
            return None
        for wildcard in ("://*:", "://0.0.0.0:", "://[::]:"):
            endpoint = endpoint.replace(wildcard, f"://{host}:")
        return endpoint

    return EventSource(reachable(config.endpoint), reachable(config.replay_endpoint), config.topic)


class KVFeeds:
    """The subscribers of all workers that publish KV events, feeding one KVIndex."""

    def __init__(self, index: KVIndex):
        self.index = index
        self.subscribers: dict[str, EventSubscriber] = {}
        self.probed: set[str] = set()          # workers whose /server_info was read

    def start(self, worker: str, source: EventSource) -> None:
        """Subscribe to `worker` (replacing an older subscription)."""
        self._unsubscribe(worker)
        self.probed.add(worker)
        logger.info("subscribing to the KV events of %s at %s", worker, source.endpoint)
        self.subscribers[worker] = EventSubscriber(worker, source, self.index).start()

    def resubscribe(self, worker: str) -> None:
        """Subscribe to `worker` afresh (its first sync is a dump): it came back after being taken out."""
        sub = self.subscribers.get(worker)
        if sub is not None:
            self.start(worker, sub.source)

    def stop(self, worker: str) -> None:
        """Unsubscribe from `worker` and forget its blocks (it was removed: a new one is probed again)."""
        self.probed.discard(worker)
        self._unsubscribe(worker)

    def _unsubscribe(self, worker: str) -> None:
        sub = self.subscribers.pop(worker, None)
        if sub is not None:
            sub.stop()

    def close(self) -> None:
        """Stop every subscriber."""
        for worker in list(self.subscribers):
            self.stop(worker)

    def stats(self) -> dict[str, Counter]:
        """Per-worker subscriber counters (batches, gaps, replays, resyncs, restarts, bad messages)."""
        return {w: s.stats for w, s in self.subscribers.items()}
