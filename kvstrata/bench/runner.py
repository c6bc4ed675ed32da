"""Drive multi-turn conversations against a server: ready queue, parallelism cap, arrivals, round barrier.

Each client sends its rounds in order; round r+1 is queued once round r answered, with the output and the
next question appended to the history. With the round barrier, round r+1 of every client waits until every
request of round r is done. A failed request (error, timeout, dropped stream) is recorded and ends its
conversation: its later rounds are counted as skipped, and it counts as done for the barrier, so a failure
never stalls a round.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import aiohttp

from kvstrata.bench.accounting import RequestRecord
from kvstrata.bench.client import GenerateResult, stream_generate
from kvstrata.bench.workload import Conversation


@dataclass(frozen=True)
class RunConfig:
    """How requests are issued (SGLang's bench_multiturn flags)."""

    output_length: int = 64
    max_parallel: int = 128
    request_rate: float = 1.0              # requests/s; inf: no gap between sends
    distribution: str = "poisson"          # poisson | uniform gaps between sends
    ready_queue_policy: str = "random"     # random | fifo
    enable_round_barrier: bool = False
    request_timeout_s: float = 600.0
    retry_failed: bool = False             # send a failed round again instead of ending its conversation
    api: str = "generate"                  # generate | completions (the url's endpoint; see client.API_PATHS)
    seed: int = 1
    progress: bool = True


@dataclass
class RunOutcome:
    """Every request sent, how many were never sent (after a failure), and the wall time."""

    records: list[RequestRecord]
    skipped: int
    wall_s: float


class MultiTurnRunner:
    """Sends the conversations to `url` (/generate) under `config`; `run()` returns the records."""

    def __init__(self, url: str, conversations: list[Conversation], config: RunConfig,
                 headers: Optional[dict] = None, url_for: Optional[Callable[[int, int], str]] = None,
                 before_send: Optional[Callable[[RequestRecord], None]] = None):
        self.url = url
        self.url_for = url_for              # (client, round) -> URL, when requests go to several routers
        self.before_send = before_send      # called with each record just before its request is sent
        self.convs = {c.client: c for c in conversations}
        self.cfg = config
        self.headers = headers
        self.rng = random.Random(config.seed)
        self.history = {c.client: list(c.first_prompt) for c in conversations}
        self.ready: list[tuple[int, int]] = [(c.client, 0) for c in conversations]
        self.held: list[tuple[int, int]] = []              # next round's requests, behind the barrier
        self.open_in_round = len(conversations)            # requests of the current round not yet done
        self.remaining = sum(c.num_rounds for c in conversations)
        self.in_flight = 0
        self.skipped = 0
        self.records: list[RequestRecord] = []
        self.t0 = 0.0
        self.cond: Optional[asyncio.Condition] = None
        self.pbar = None

    async def run(self) -> RunOutcome:
        """Run every conversation to its end (or its first failure)."""
        from tqdm import tqdm

        self.cond = asyncio.Condition()
        self.pbar = tqdm(total=self.remaining, disable=not self.cfg.progress, desc="requests", unit="req")
        self.t0 = time.perf_counter()
        tasks: set[asyncio.Task] = set()
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                while True:
                    async with self.cond:
                        await self.cond.wait_for(self._can_send_or_done)
                        if self.remaining == 0:
                            break
                        client, rnd = self._pop_ready()
                        self.in_flight += 1
                    task = asyncio.create_task(self._send(session, client, rnd))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    gap = self._arrival_gap()
                    if gap > 0:
                        await asyncio.sleep(gap)
        finally:
            for task in list(tasks):
                task.cancel()
            self.pbar.close()
        return RunOutcome(self.records, self.skipped, time.perf_counter() - self.t0)

    # ------------------------------------------------------------------ scheduling
    def _can_send_or_done(self) -> bool:
        return self.remaining == 0 or (bool(self.ready) and self.in_flight < self.cfg.max_parallel)

    def _pop_ready(self) -> tuple[int, int]:
        if self.cfg.ready_queue_policy == "fifo":
            return self.ready.pop(0)
        return self.ready.pop(self.rng.randrange(len(self.ready)))

    def _arrival_gap(self) -> float:
        rate = self.cfg.request_rate
        if rate <= 0 or rate == float("inf"):
            return 0.0
        if self.cfg.distribution == "uniform":
            return self.rng.uniform(0, 2 / rate)
        return self.rng.expovariate(rate)

    def _now(self) -> float:
        return time.perf_counter() - self.t0

    # ------------------------------------------------------------------ one request
    async def _send(self, session: aiohttp.ClientSession, client: int, rnd: int) -> None:
        prompt = self.history[client]
        rec = RequestRecord(client=client, round=rnd, prompt_ids=prompt, send_time=self._now())
        if self.before_send is not None:
            self.before_send(rec)
        url = self.url_for(client, rnd) if self.url_for is not None else self.url
        try:
            res = await stream_generate(session, url, prompt, self.cfg.output_length,
                                        self.cfg.request_timeout_s, self.headers, self.cfg.api)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug here must not hang the run: record it as a failed request
            res = GenerateResult(error=f"{type(e).__name__}: {e}")
        rec.finish_time = self._now()
        self._fill(rec, res)
        assert self.cond is not None
        async with self.cond:
            self._complete(rec)
            self.cond.notify_all()

    @staticmethod
    def _fill(rec: RequestRecord, res: GenerateResult) -> None:
        rec.error = res.error
        rec.ttft, rec.latency = res.ttft, res.latency
        rec.output_ids = res.output_ids
        meta = res.meta_info
        rec.prompt_tokens = int(meta.get("prompt_tokens") or len(rec.prompt_ids))
        rec.cached_tokens = int(meta.get("cached_tokens") or 0)
        rec.completion_tokens = int(meta.get("completion_tokens") or len(res.output_ids))

    def _complete(self, rec: RequestRecord) -> None:
        """Account for a finished request and queue its client's next round (or end the conversation)."""
        self.records.append(rec)
        self.in_flight -= 1
        self.remaining -= 1
        self.pbar.update(1)
        conv = self.convs[rec.client]
        later = conv.num_rounds - rec.round - 1
        if not rec.ok and self.cfg.retry_failed and not self.cfg.enable_round_barrier:
            self.remaining += 1                 # the same round goes back in the queue
            self.pbar.total += 1
            self.ready.append((rec.client, rec.round))
            return
        if not rec.ok:
            self.skipped += later
            self.remaining -= later
            self.pbar.update(later)
            if later:
                self.pbar.write(f"client {rec.client} round {rec.round} failed ({rec.error}); "
                                f"its {later} later round(s) are skipped")
        elif later:
            self.history[rec.client] = rec.prompt_ids + rec.output_ids + conv.questions[rec.round]
            nxt = (rec.client, rec.round + 1)
            (self.held if self.cfg.enable_round_barrier else self.ready).append(nxt)
        if self.cfg.enable_round_barrier:
            self.open_in_round -= 1
            if self.open_in_round == 0:         # the round is over: release the next one
                self.ready.extend(self.held)
                self.open_in_round = len(self.held)
                self.held = []
