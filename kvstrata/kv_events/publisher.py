"""KVEventPublisher: the cache's per-step block events on a ZMQ PUB socket, with a replay ROUTER socket.

The scheduler thread only queues each step's events (`publish`, never blocks); a thread of its own
encodes them (wire.py), numbers them, sends them, keeps the last `buffer_steps` batches for replay and a
mirror of the announced state for the full-state dump. When the queue is full a step's events are
dropped and counted, and the next step queues a full snapshot first (AllBlocksCleared + every block), so a
subscriber is exact again without having seen the lost ones.

Nothing from the network is trusted: the PUB socket only sends; the replay socket accepts exactly
[identity, b"", 8-byte start] (ZMQ drops longer messages at MAXMSGSIZE) and drops anything else, counted.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

import msgspec
import zmq

from kvstrata.cache.events import AllCleared, BlockEvent, BlocksRemoved, BlocksStored
from kvstrata.kv_events import wire
from kvstrata.kv_events.config import KVEventsConfig

logger = logging.getLogger(__name__)

POLL_S = 0.02
MAX_REPLAY_REQUEST_BYTES = 64


class KVEventPublisher:
    """PUB + replay sockets and the thread that serves them."""

    def __init__(self, config: KVEventsConfig, block_size: int, snapshot: Callable[[], list[BlockEvent]],
                 data_parallel_rank: int = 0):
        self.config = config
        self.block_size = block_size
        self.snapshot = snapshot                  # the announced state as events (scheduler thread)
        self.rank = data_parallel_rank
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._mirror: dict[str, dict[int, tuple[int | None, tuple]]] = {}
        self._seq = 0
        self._resync = False
        self.stats = {"published_batches": 0, "published_events": 0, "dropped_events": 0, "snapshots": 0,
                      "replay_requests": 0, "bad_replay_requests": 0, "dumps": 0}
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        try:
            self._pub.bind(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.MAXMSGSIZE, MAX_REPLAY_REQUEST_BYTES)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._topic = config.topic.encode("utf-8")
        self._encoder = msgspec.msgpack.Encoder()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        # Batch 0 says "nothing cached": a restart shows as seq 0 at once, and a dump's seq is never -1.
        self.publish([AllCleared()])

    # ---- the scheduler's side ---------------------------------------------------------------------------

    def publish(self, events: list[BlockEvent]) -> None:
        """Queue one step's events (never blocks: a full queue drops them and schedules a snapshot)."""
        if self._resync:
            try:
                self._queue.put_nowait((time.time(), self.snapshot()))
                self._resync = False
                self.stats["snapshots"] += 1
                return        # the snapshot already holds this step's state
            except queue.Full:
                self.stats["dropped_events"] += len(events)
                return
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.stats["dropped_events"] += len(events)
            self._resync = True

    def close(self) -> None:
        """Send what is queued, stop the thread, close the sockets."""
        if not self._running:
            return
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout=5.0)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)

    # ---- the publisher thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                item = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return
            try:
                self._send(*item)
            except Exception:      # a bug here must not stop the stream: subscribers see the gap and resync
                logger.exception("publishing KV events failed")
                self._seq += 1

    def _send(self, ts: float, events: list[BlockEvent]) -> None:
        payload = self._encoder.encode(wire.KVEventBatch(ts, [self._wire(e) for e in events], self.rank))
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart([self._topic, wire.seq_bytes(seq), payload])   # at HWM: dropped, seen as a gap
        self._buffer.append((seq, payload))
        for e in events:
            self._apply(e)
        self.stats["published_batches"] += 1
        self.stats["published_events"] += len(events)

    def _wire(self, event: BlockEvent):
        if isinstance(event, BlocksStored):
            return wire.BlockStored(event.hashes, event.parent, event.token_ids, self.block_size, None, event.medium)
        if isinstance(event, BlocksRemoved):
            return wire.BlockRemoved(event.hashes, event.medium)
        return wire.AllBlocksCleared()

    def _apply(self, event: BlockEvent) -> None:
        """Keep the mirror of the announced state (for the dump) in step with what was sent."""
        if isinstance(event, AllCleared):
            self._mirror.clear()
        elif isinstance(event, BlocksRemoved):
            blocks = self._mirror.get(event.medium, {})
            for h in event.hashes:
                blocks.pop(h, None)
        else:
            blocks = self._mirror.setdefault(event.medium, {})
            parent, bs = event.parent, self.block_size
            for i, h in enumerate(event.hashes):
                blocks[h] = (parent, tuple(event.token_ids[i * bs:(i + 1) * bs]))
                parent = h

    def _serve_replay(self) -> None:
        """Answer one replay request (or drop a malformed one)."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != wire.REPLAY_REQUEST_BYTES:
            self.stats["bad_replay_requests"] += 1
            return
        client, start = frames[0], wire.seq_of(frames[2])
        self.stats["replay_requests"] += 1
        if start == wire.DUMP_SEQ:
            self.stats["dumps"] += 1
            self._replay.send_multipart([client, b"", wire.seq_bytes(self._seq - 1), self._dump()])
        elif start >= 0:
            for seq, payload in self._buffer:
                if seq >= start:
                    self._replay.send_multipart([client, b"", wire.seq_bytes(seq), payload])
        else:
            self.stats["bad_replay_requests"] += 1
        self._replay.send_multipart([client, b"", wire.END_SEQ, b""])

    def _dump(self) -> bytes:
        events: list = [wire.AllBlocksCleared()]
        for medium, blocks in self._mirror.items():
            for h, (parent, tokens) in blocks.items():
                events.append(wire.BlockStored([h], parent, list(tokens), self.block_size, None, medium))
        return self._encoder.encode(wire.KVEventBatch(time.time(), events, self.rank))

    def metrics(self) -> dict:
        """Counters for /metrics and /server_info."""
        return {**self.stats, "queued_batches": self._queue.qsize(), "last_seq": self._seq - 1}
