"""Scheduler: continuous batching over the device KV pool.

Every step builds one mixed batch — one decode token for each running request, plus prefill chunks of
waiting (or partly prefilled) requests up to the chunked-prefill budget — runs it, and turns the sampled
tokens into ReqOutputs. When the pool runs short, the newest running requests are retracted (their
computed KV goes to the radix tree) and recomputed later, instead of failing. With a host tier, a request
still waiting for its first token may pause decodes to start at once (`_preempt_for_first_token`).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Optional

import torch

from kvstrata.args import ServerArgs
from kvstrata.cache.build import build_kv_cache
from kvstrata.model.builtin import resolve_model_path
from kvstrata.model.parallel import RankFailure
from kvstrata.model.tokenizer import load_checked_tokenizer
from kvstrata.runtime.batch import BatchEntry, ScheduledBatch, StepResult
from kvstrata.runtime.handoff import Handoff, HandoffFactory
from kvstrata.runtime.messages import (
    EXPERT_RECORD_ACTIONS,
    ControlOut,
    PrefetchReq,
    ReqOutput,
    TokenizedGenerateReq,
)
from kvstrata.runtime.model_runner import ModelRunner
from kvstrata.runtime.req import Req, ReqState, finish_abort
from kvstrata.runtime.sampler import top_token_ids
from kvstrata.runtime.stop import StopChecker
from kvstrata.runtime.utilization import UtilizationMeter

logger = logging.getLogger(__name__)

QUEUE_FULL_MESSAGE = "The request queue is full."   # SGLang's words (--max-queued-requests), with HTTP 503
LPM_MAX_QUEUE = 128          # beyond this many waiting requests, matching them all costs more than it saves
SHARED_PREFIX_TOKENS = 32    # defer a request whose uncached prefix is being computed in this batch
INIT_NEW_TOKEN_RATIO, MIN_NEW_TOKEN_RATIO, NEW_TOKEN_RATIO_DECAY = 0.7, 0.1, 0.001


class Scheduler:
    """Owns requests, the cache facade and the runner; `step()` advances everything by one forward."""

    def __init__(self, args: ServerArgs, runner: Optional[ModelRunner] = None,
                 handoff_factory: Optional[HandoffFactory] = None):
        """`handoff_factory`: the PD handoff of --disaggregation-mode prefill/decode (kvstrata.disagg.handoff_for);
        required in those modes, unused otherwise."""
        self.args = args
        self.runner = runner or ModelRunner(args, rank_side=handoff_factory.rank_side if handoff_factory else None)
        self.page_size = args.page_size
        self.context_len = self.runner.context_len
        self.cache = build_kv_cache(args.cache_config(), self.runner.pool, self.runner.model_path, self.context_len,
                                    copy_journal=self.runner.copy_journal, ranks=self.runner.rank_link)
        self.kv_events = self._kv_event_publisher()   # --kv-events-config (None: off)
        # The scheduler process's tokenizer: stop strings, grammars, and the fingerprint the HTTP process checks.
        # A LightTokenizer where transformers' was recorded to give the same results (server/launch.py records it).
        self.tokenizer = load_checked_tokenizer(resolve_model_path(args.tokenizer_path))
        self.stop = StopChecker(self.tokenizer, self.runner.config.eos_token_ids)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.step_count = 0
        self.metrics = {"prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0, "retractions": 0,
                        "preemptions": 0, "finished_requests": 0, "aborted_requests": 0, "prefetch_hints": 0,
                        "prefetch_loaded_back_tokens": 0}
        self.engine_meter = UtilizationMeter()   # share of wall clock spent in forwards
        self.scheduler_cpu_s = 0.0               # CPU seconds of step() outside the forward (thread time)
        # Steps with nothing to run (waiting on an L3 prefetch, a grammar or free pages) and their CPU time,
        # kept apart: they are polls, and counting them per forward step would blame the forward steps.
        self.empty_steps = 0
        self.empty_step_cpu_s = 0.0
        self._grammar = None
        self.grammar_backend()   # cheap: xgrammar and its vocabulary scan load in its compile pool on first use
        self.handoff: Optional[Handoff] = None   # PD disaggregation (None when co-located)
        if args.disaggregation_mode != "null":
            if handoff_factory is None:
                raise ValueError(f"--disaggregation-mode {args.disaggregation_mode} needs a handoff "
                                 "(kvstrata.disagg.handoff_for)")
            self.handoff = handoff_factory(self)

    def _kv_event_publisher(self):
        """The publisher of the cache's block events, fed once per step (None when events are off)."""
        config = self.args.kv_events()
        if config is None or self.cache.events is None:
            return None
        from kvstrata.kv_events.publisher import KVEventPublisher

        publisher = KVEventPublisher(config, self.cache.events.group_tokens, self.cache.events.snapshot)
        self.cache.publish_events = publisher.publish
        return publisher

    # ------------------------------------------------------------------ inputs
    def add_request(self, msg: TokenizedGenerateReq) -> Optional[ReqOutput]:
        """Queue a request; returns an error ReqOutput (and queues nothing) if it is invalid."""
        s = msg.sampling_params
        req = Req(rid=msg.rid, prompt_ids=list(msg.input_ids), sampling=s, return_logprob=msg.return_logprob,
                  logprob_start_len=msg.logprob_start_len, top_logprobs_num=msg.top_logprobs_num,
                  stream=msg.stream, namespace=msg.cache_namespace, priority=self._priority(msg.priority))
        if msg.priority is not None and self.args.abort_on_priority_when_disabled \
                and not self.args.enable_priority_scheduling:
            return self.error_for(req, "this server does not schedule by 'priority' "
                                  "(start it with --enable-priority-scheduling)")
        if s.sampling_seed is not None:
            req.generator = torch.Generator().manual_seed(s.sampling_seed)
        elif self.args.enable_deterministic_inference and not s.is_greedy:
            # Its own generator, seeded at arrival: its draws never depend on what else is in the batch.
            req.generator = torch.Generator().manual_seed(self.runner.sampler.next_seed())
        if msg.bootstrap is not None:
            if self.handoff is None:
                return self.error_for(req, "bootstrap_room was given but this server runs with "
                                      "--disaggregation-mode null")
            return self.handoff.add(req, msg.bootstrap)
        if self.args.max_queued_requests is not None and len(self.waiting) >= self.args.max_queued_requests:
            return self.error_for(req, QUEUE_FULL_MESSAGE, status=503)
        if s.constraint is not None:
            backend = self.grammar_backend()
            if backend is None:
                return self.error_for(req, "structured output is disabled (--grammar-backend none)")
            req.grammar_future = backend.compile_async(*s.constraint)
        self.queue(req)
        return None

    def _priority(self, given: Optional[int]) -> int:
        """A request's importance, higher first: its `priority` (or the default), negated when lower values
        come first (--schedule-low-priority-values-first)."""
        value = given if given is not None else (self.args.default_priority_value or 0)
        return -value if self.args.schedule_low_priority_values_first else value

    def grammar_backend(self):
        """The grammar backend, created on first use (None when disabled)."""
        if self._grammar is None and self.args.grammar_backend != "none":
            from kvstrata.constrained.registry import create_grammar_backend

            self._grammar = create_grammar_backend(
                self.args.grammar_backend, self.tokenizer, self.runner.vocab_size,
                sorted(self.stop.eos_token_ids),
                any_whitespace=not self.args.constrained_json_disable_any_whitespace,
                whitespace_pattern=self.args.constrained_json_whitespace_pattern)
            self.runner.grammar_backend = self._grammar
        return self._grammar

    def abort(self, rid: str) -> list[ReqOutput]:
        """Abort a waiting or running request (and its n-copies' prefixed rids); frees its KV."""
        outs = self.handoff.abort(rid) if self.handoff is not None else []
        for queue in (self.waiting, self.running):
            for req in [r for r in queue if r.rid == rid]:
                queue.remove(req)
                if req.row is not None:
                    self.cache.release(req, cache=True)
                req.finish_reason = finish_abort("aborted by client")
                req.state = ReqState.FINISHED
                self.metrics["aborted_requests"] += 1
                outs.append(self.output_for(req))
        return outs

    def prefetch(self, msg: PrefetchReq) -> None:
        """A prefetch hint (POST /prefetch): start the load-back / L3 read of the prompt's cached prefix."""
        if not self.cache.shares_prefixes:
            return
        self.cache.begin_step()           # acks first: the hint sees the tree as a step would
        result = self.cache.warm(msg.input_ids, msg.cache_namespace)
        self.metrics["prefetch_hints"] += 1
        self.metrics["prefetch_loaded_back_tokens"] += result["loaded_back_tokens"]
        self.cache.flush_events()

    def flush_cache(self) -> ControlOut:
        """Empty the radix tree; refused while requests are queued or running."""
        if self.waiting or self.running or self._handoff_busy():
            return ControlOut("flush_cache", False, f"cannot flush the cache while {len(self.running)} requests "
                              f"run and {len(self.waiting)} wait")
        self.cache.flush()
        return ControlOut("flush_cache", True, "cache flushed")

    def expert_distribution(self, action: str) -> ControlOut:
        """Start (clearing the counts), stop or dump the runner's expert recorder; the state is its dump.
        Refused (success False, the message says why) for an unknown action, and where nothing records: without
        --expert-distribution-recorder-mode, or on a model without MoE layers."""
        recorder = self.runner.expert_recorder
        if action not in EXPERT_RECORD_ACTIONS:
            return ControlOut("expert_distribution", False, f"unknown expert distribution action {action!r}; "
                              f"expected one of {list(EXPERT_RECORD_ACTIONS)}")
        if recorder is None:
            why = ("start the server with --expert-distribution-recorder-mode stat"
                   if self.args.expert_distribution_recorder_mode is None
                   else f"the model {self.args.model_path} has no MoE layers")
            return ControlOut("expert_distribution", False, f"no expert distribution is recorded: {why}")
        if action == "start":
            recorder.start()
        elif action == "stop":
            recorder.stop()
        verb = {"start": "started", "stop": "stopped", "dump": "dumped"}[action]
        return ControlOut("expert_distribution", True, f"expert distribution record {verb}", recorder.dump())

    def has_work(self) -> bool:
        """Whether step() would do anything."""
        return bool(self.waiting or self.running) or self._handoff_busy()

    def _handoff_busy(self) -> bool:
        return self.handoff is not None and self.handoff.has_work()

    # ------------------------------------------------------------------ one step
    def step(self) -> list[ReqOutput]:
        """Schedule, run one forward, process results. Returns outputs to send."""
        cpu_start = time.thread_time()
        outputs = self._poll_grammars()
        self.cache.begin_step()
        if self.handoff is not None:
            outputs.extend(self.handoff.poll())
        batch = self._schedule()
        batch.layer_wait = self.cache.take_layer_wait()
        if batch.is_empty():
            self.empty_step_cpu_s += time.thread_time() - cpu_start
            self.empty_steps += 1
            time.sleep(0.001)   # waiting on a grammar compile, an L3 prefetch or free pages
            return outputs
        # The scheduler's own CPU time (this thread, the forward excluded): what grows with the cache's size.
        self.scheduler_cpu_s += time.thread_time() - cpu_start
        try:
            with self.engine_meter.measure():
                result = self.runner.forward(batch, self.cache.forward_slots())
            cpu_start = time.thread_time()
            outputs.extend(self._process(batch, result))
            self.scheduler_cpu_s += time.thread_time() - cpu_start
        except RankFailure:     # the tensor-parallel group is broken: no later step can run
            raise
        except Exception as e:  # one bad batch (a bug, an odd shape, out of memory) must not end the server
            outputs.extend(self._fail_batch(batch, e))
        self.cache.flush_events()
        self.step_count += 1
        return outputs

    def idle(self) -> None:
        """What the loop does when there is no work: apply finished copies, keep the other ranks alive."""
        self.cache.begin_step()     # frees locks, queues L3 backups
        self.runner.idle()

    def _fail_batch(self, batch: ScheduledBatch, exc: Exception) -> list[ReqOutput]:
        """End the requests of a batch whose step raised: error outputs, KV freed without caching it."""
        reqs = list({id(e.req): e.req for e in batch.entries}.values())
        logger.exception("a step failed (%s); failing its requests %s", type(exc).__name__, [r.rid for r in reqs])
        message = f"internal error while running this request: {type(exc).__name__}: {exc}"
        outputs = []
        for req in reqs:
            if req.state == ReqState.FINISHED:     # finished (and released) by _process before the failure
                outputs.append(self.output_for(req))
                continue
            if req in self.running:
                self.running.remove(req)
            self.cache.release(req, cache=False)   # what this step wrote may be garbage: never cache it
            req.finish_reason = finish_abort(message)
            req.state = ReqState.FINISHED
            out = self.output_for(req)
            out.error, out.error_status = message, 500
            outputs.append(out)
        return outputs

    def _poll_grammars(self) -> list[ReqOutput]:
        outs = []
        for req in list(self.waiting):
            fut = req.grammar_future
            if fut is None or not fut.done():
                continue
            req.grammar_future = None
            try:
                req.grammar = fut.result()
            except Exception as e:  # GrammarError: the client's constraint does not compile
                self.waiting.remove(req)
                outs.append(error_output(req.rid, len(req.prompt_ids), str(e)))
        return outs

    def _prefill_budget(self) -> int:
        budget = self.args.chunked_prefill_size
        return self.args.max_prefill_tokens if budget == -1 else budget

    def _schedule(self) -> ScheduledBatch:
        entries: list[BatchEntry] = []
        budget = self._prefill_budget()
        self._order_waiting()
        self._preempt_for_first_token(budget)
        self._schedule_decodes(entries)
        left = self._continue_prefills(entries, budget)
        self._admit(entries, left, filled=budget - left)
        if not entries and self.running:
            # Partly prefilled requests hold the pool and none can go on: free the newest, retry next step.
            self._retract(self.running[-1])
        return ScheduledBatch(entries)

    def _schedule_decodes(self, entries: list[BatchEntry]) -> None:
        decoding = [r for r in self.running if r.kv_len == r.fill_len - 1]
        i = 0
        while i < len(decoding):
            got = self.cache.reserve_decodes(decoding[i:])
            entries.extend(BatchEntry(req, req.kv_len, 1, sample=True) for req in decoding[i:i + got])
            i += got
            if i < len(decoding):
                victim = decoding.pop()        # newest decoding request goes back to the queue
                self._retract(victim)
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)

    def _retract(self, req: Req) -> None:
        """The pool ran out: requeue req first and reserve more decode room from now on."""
        self._requeue(req, 0)
        self.metrics["retractions"] += 1
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        logger.debug("retracted %s (pool full)", req.rid)

    def _requeue(self, req: Req, position: int) -> None:
        """Send a running request back to the queue at `position`; its computed KV goes to the tree."""
        self.cache.release(req, cache=True)
        self.running.remove(req)
        req.state = ReqState.WAITING
        req.retractions += 1
        req.input_logprobs, req.input_top_logprobs = [], []
        self.waiting.insert(position, req)

    def _preempt_for_first_token(self, budget: int) -> None:
        """Pause decodes so that the request at the head of the queue gets its first token now.

        Only where a paused request resumes cheaply (a host tier keeps its KV: load-back, not recompute),
        only for a request that has produced nothing yet, and only for one request at a time: a paused
        request never pauses another and nothing is paused while one waits. Victims are the decoding
        requests with the most tokens left (they would hold the pool longest); they wait behind it.
        """
        if not self.args.preempt_for_first_token or not self.cache.has_host_tier or self.handoff is not None:
            return
        if not self.waiting or any(r.paused_for is not None for r in self.waiting):
            return
        req = self.waiting[0]
        if req.output_ids or req.retractions or req.grammar_future is not None or not self.cache.prefetch_settled(req):
            return
        headroom = self.decode_headroom_pages() + self._future_pages(req)
        if self.cache.available_pages() >= -(-req.fill_len // self.page_size) + headroom:
            return                  # fits even with nothing cached: no tree walk on the common path
        plan = self.cache.plan_admit(req, budget)
        if plan is None or plan.fits(headroom):
            return
        short = plan.pages + headroom - plan.available_pages
        freed = dict(zip(map(id, self.running), self.cache.pages_freed_by_release(self.running, req)))
        decoding = [r for r in self.running if r.output_ids and r.kv_len == r.fill_len - 1]
        victims = []
        for victim in sorted(decoding, key=lambda r: (-r.remaining_new_tokens(), -r.admitted_at_step)):
            if short <= 0:
                break
            victims.append(victim)
            short -= freed[id(victim)] + self._future_pages(victim) + 1
        if short > 0:
            return                  # pausing them all would not make room: wait, as without preemption
        for victim in victims:
            self._requeue(victim, 1)
            victim.paused_for = req
            self.metrics["preemptions"] += 1
        logger.debug("paused %s for %s's first token", [v.rid for v in victims], req.rid)

    def _continue_prefills(self, entries: list[BatchEntry], budget: int) -> int:
        for req in self.running:
            if budget <= 0:
                break
            if req.kv_len < req.fill_len - 1 and req.slot_len == req.kv_len:
                n = min(req.fill_len - req.kv_len, budget)
                if not self.cache.reserve(req, n):
                    break
                entries.append(self._prefill_entry(req, n))
                budget -= n
        return budget

    def _admit(self, entries: list[BatchEntry], budget: int, filled: int) -> None:
        """Move waiting requests into the step while `budget` prefill tokens last; `filled` prefill tokens are
        already in it (--prefill-admit-threshold stops admission early)."""
        if not self.waiting:
            return
        threshold = self.args.prefill_admit_threshold
        reserved_decode = self.decode_headroom_pages()
        started: list[list[int]] = []
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.args.max_running_requests or 0 < threshold <= filled:
                break
            if req.paused_for is not None and req.paused_for.state == ReqState.WAITING:
                continue            # paused for a request that has not started yet
            if req.grammar_future is not None or not self.cache.prefetch_ready(req):
                continue
            plan = self.cache.plan_admit(req, budget)
            if plan is None:
                break
            if self._shares_uncached_prefix(req, plan.cached_tokens, started):
                continue
            if not plan.fits(reserved_decode + self._future_pages(req)) or not self.cache.admit(req, plan):
                break
            n = plan.new_tokens
            if req.admitted_at_step < 0:
                req.cached_tokens = req.kv_len
                self._count_admission(req)
            req.paused_for = None
            self.waiting.remove(req)
            self._start_running(req)
            entries.append(self._prefill_entry(req, n))
            reserved_decode += self._future_pages(req)
            started.append(req.fill_ids[: SHARED_PREFIX_TOKENS])
            budget -= n
            filled += n

    def _order_waiting(self) -> None:
        """Sort the queue by priority (if enabled), then by --schedule-policy; stable, so fcfs among equals."""
        policy = self.args.schedule_policy
        if len(self.waiting) < 2 or (policy == "fcfs" and not self.args.enable_priority_scheduling):
            return
        if policy == "random":
            random.shuffle(self.waiting)
        if policy == "lpm" and self.cache.shares_prefixes and len(self.waiting) <= LPM_MAX_QUEUE:
            hits = {id(r): self.cache.cached_prefix_tokens(r) for r in self.waiting}
            self.waiting.sort(key=lambda r: -hits[id(r)])
        elif policy == "lof":
            self.waiting.sort(key=lambda r: -r.sampling.max_new_tokens)
        if self.args.enable_priority_scheduling or policy == "priority":
            self.waiting.sort(key=lambda r: -r.priority)

    def _shares_uncached_prefix(self, req: Req, cached_tokens: int, started: list[list[int]]) -> bool:
        """True if a request admitted in this step is computing req's (still uncached) prefix."""
        head = req.fill_ids[:SHARED_PREFIX_TOKENS]
        if not self.cache.shares_prefixes or cached_tokens >= SHARED_PREFIX_TOKENS or len(head) < SHARED_PREFIX_TOKENS:
            return False
        return any(h == head for h in started)

    def decode_headroom_pages(self) -> int:
        """Pages the running requests are expected to need for their remaining tokens."""
        tokens = sum(r.remaining_new_tokens() for r in self.running)
        return int(tokens * self.new_token_ratio) // self.page_size + len(self.running)

    def call_ranks(self, request: bytes, local: Callable[[bytes], bytes]) -> list[bytes]:
        """Every tensor-parallel rank's answer to a handoff's call, in rank order (HandoffHost)."""
        return self.runner.call_ranks(request, local)

    def _future_pages(self, req: Req) -> int:
        return int(req.remaining_new_tokens() * self.new_token_ratio) // self.page_size

    def _prefill_entry(self, req: Req, n: int) -> BatchEntry:
        start, end = req.kv_len, req.kv_len + n
        done = end == req.fill_len
        lo = hi = 0
        if req.wants_prompt_logprobs:
            lo = max(start, req.logprob_start_len)
            hi = min(end, len(req.prompt_ids) - 1)   # logits at position p score token p+1
            lo = min(lo, hi)
        sample = done and not (req.sampling.max_new_tokens == 0 and not req.output_ids)
        return BatchEntry(req, start, n, sample=sample, logprob_lo=lo, logprob_hi=hi)

    # ------------------------------------------------------------------ results
    def _process(self, batch: ScheduledBatch, result: StepResult) -> list[ReqOutput]:
        outputs: list[ReqOutput] = []
        k = 0
        for i, e in enumerate(batch.entries):
            req = e.req
            self.cache.advance(req, e.end)
            if i in result.prompt_logprob_rows:
                self._add_prompt_logprobs(req, e, result.prompt_logprob_rows[i])
            if e.sample:
                self._append_token(req, result, k)
                k += 1
            elif e.end == req.fill_len:          # max_new_tokens == 0: prefill only
                req.finish_reason = {"type": "length", "length": 0}
            if e.extend_len > 1 and not req.finished:
                self.cache.commit(req)           # share the prompt with other requests right away
            if req.finished:
                if self.handoff is not None and self.handoff.hold(req):
                    continue                     # a prefill's KV goes to its decode server first
                self._finish(req)
                outputs.append(self.output_for(req))
            elif req.stream and self._stream_due(req):
                outputs.append(self.output_for(req))
        return outputs

    def _stream_due(self, req: Req) -> bool:
        """A streaming request's update goes out with its first token, then every --stream-interval tokens."""
        unsent = len(req.output_ids) - req.sent_tokens
        return unsent > 0 and (req.sent_tokens == 0 or unsent >= self.args.stream_interval)

    def _append_token(self, req: Req, result: StepResult, k: int) -> None:
        logprobs = req.return_logprob and result.next_logprobs is not None
        self.accept_token(req, result.next_token_ids[k], result.next_logprobs[k] if logprobs else None,
                          result.next_top_logprobs[k] if logprobs else None)

    def accept_token(self, req: Req, token: int, logprob: Optional[float], top: Optional[list]) -> None:
        """Append one sampled token (and its logprobs when given) to req, then check its stop conditions."""
        req.output_ids.append(token)
        self.metrics["generated_tokens"] += 1
        if logprob is not None:
            req.output_logprobs.append((logprob, token))
            req.output_top_logprobs.append(top)
        if req.grammar is not None:
            req.grammar.accept_token(token)
        req.finish_reason = self.stop.check(req, self.context_len)

    def _add_prompt_logprobs(self, req: Req, e: BatchEntry, rows: torch.Tensor) -> None:
        if not req.input_logprobs and req.logprob_start_len >= 0:
            req.input_logprobs.append((None, req.prompt_ids[req.logprob_start_len]))
            req.input_top_logprobs.append(None)
        targets = torch.tensor(req.prompt_ids[e.logprob_lo + 1: e.logprob_hi + 1], dtype=torch.long)
        chosen = rows.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
        req.input_logprobs.extend(zip(chosen, targets.tolist()))
        n = req.top_logprobs_num
        if n > 0:
            ids = top_token_ids(rows, n)
            vals = rows.gather(1, ids)
            req.input_top_logprobs.extend(list(zip(v, t)) for v, t in zip(vals.tolist(), ids.tolist()))
        else:
            req.input_top_logprobs.extend([] for _ in range(len(chosen)))

    def _count_admission(self, req: Req) -> None:
        """Count a request's prompt and cached tokens, once (a retracted request is not counted again)."""
        self.metrics["prompt_tokens"] += len(req.prompt_ids)
        self.metrics["cached_tokens"] += req.cached_tokens

    def _start_running(self, req: Req) -> None:
        req.admitted_at_step = self.step_count
        req.state = ReqState.RUNNING
        self.running.append(req)

    def _finish(self, req: Req) -> None:
        """Free req's KV (its prefix stays cached) and count it finished; it may be running or parked."""
        self.cache.release(req, cache=True)
        if req in self.running:
            self.running.remove(req)
        req.state = ReqState.FINISHED
        self.metrics["finished_requests"] += 1

    # ------------------------------------------------------------------ HandoffHost (runtime/handoff.py)
    def queue(self, req: Req) -> None:
        """Queue req for prefill, its L3 prefetch started (every arrival; a handoff's prefill requests too)."""
        self.waiting.append(req)
        self.cache.start_prefetch(req)

    def park(self, req: Req) -> None:
        """Take a prefilled req out of the running list; its KV stays, its prompt is shared at once."""
        self.running.remove(req)
        self.cache.commit(req)

    def start_decoding(self, req: Req, token: int, logprob: Optional[float], top: list) -> list[ReqOutput]:
        """req's prompt KV arrived in its slots: give it its first token and let it decode (or finish)."""
        self._count_admission(req)
        self._start_running(req)
        self.accept_token(req, token, logprob if req.return_logprob else None, top)
        if req.finished:
            self._finish(req)
            return [self.output_for(req)]
        self.cache.commit(req)            # its prompt is shareable at once, as after a local prefill
        return [self.output_for(req)] if req.stream else []

    def finish_held(self, req: Req) -> ReqOutput:
        """A parked prefill request is done (its KV was sent): free it, return its final output."""
        self._finish(req)
        return self.output_for(req)

    def drop_queued(self, req: Req) -> None:
        """Take req out of the waiting queue or running list and free what it holds (idempotent)."""
        for queue in (self.waiting, self.running):
            if req in queue:
                queue.remove(req)
        self.cache.release(req, cache=True)

    def error_for(self, req: Req, message: str, status: int = 400) -> ReqOutput:
        """A final error output for req."""
        return error_output(req.rid, len(req.prompt_ids), message, status)

    def output_for(self, req: Req) -> ReqOutput:
        """req's output since its last one (new tokens, logprobs; the prompt's logprobs once)."""
        start = req.sent_tokens
        out = ReqOutput(
            rid=req.rid, new_token_ids=req.output_ids[start:], finished=req.finished,
            finish_reason=req.finish_reason, prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(req.output_ids), cached_tokens=req.cached_tokens)
        if req.return_logprob:
            out.output_token_logprobs = req.output_logprobs[start:]
            out.output_top_logprobs = req.output_top_logprobs[start:]
            if not req.sent_input_logprobs and (req.output_ids or req.finished):
                out.input_token_logprobs = req.input_logprobs
                out.input_top_logprobs = req.input_top_logprobs
                req.sent_input_logprobs = True
        req.sent_tokens = len(req.output_ids)
        return out

    def close(self) -> None:
        """Release background resources (copy workers, grammar compile threads, the other TP ranks)."""
        self.cache.close()
        if self.kv_events is not None:
            self.cache.flush_events()      # the last copies' residency, then the stream ends
            self.kv_events.close()
        if self.handoff is not None:
            self.handoff.close()
        if self._grammar is not None:
            self._grammar.close()
        self.runner.close()

    # ------------------------------------------------------------------ introspection
    def check_integrity(self) -> None:
        """Assert page and row accounting (callable between steps)."""
        held = self.handoff.held() if self.handoff is not None else []
        self.cache.check_integrity(self.running + held)

    def _kv_cache_state(self, state: dict) -> dict:
        """The KV format (--kv-cache-dtype) and what each tier holds of it, in tokens."""
        pool = self.runner.pool
        host_pages = (state.get("hicache") or {}).get("host_capacity_pages")
        return {"dtype": str(pool.dtype).removeprefix("torch."), "scales_digest": pool.kv_format.scales_digest,
                "bytes_per_token": pool.bytes_per_token, "device_capacity_tokens": self.runner.max_total_tokens,
                "host_capacity_tokens": None if host_pages is None else host_pages * pool.page_size}

    def get_state(self, full: bool = True) -> dict:
        """Internal state and metrics for /server_info; `full=False` skips the idle check and the tree's metrics."""
        m = dict(self.metrics)
        m["cache_hit_rate"] = m["cached_tokens"] / m["prompt_tokens"] if m["prompt_tokens"] else 0.0
        state = {"running_requests": len(self.running), "waiting_requests": len(self.waiting),
                 "max_total_tokens": self.runner.max_total_tokens, "context_length": self.context_len,
                 "step": self.step_count, "new_token_ratio": self.new_token_ratio, **self.cache.stats(), **m}
        state["kv_cache"] = self._kv_cache_state(state)
        state["engine_utilization"] = self.engine_meter.utilization()
        state["forward_busy_s"] = self.engine_meter.busy_s
        if self.kv_events is not None:
            state["kv_events"] = self.kv_events.metrics()
        state["scheduler_cpu_s"] = self.scheduler_cpu_s
        state["empty_steps"] = self.empty_steps
        state["empty_step_cpu_s"] = self.empty_step_cpu_s
        state.update(self.runner.parallel_state())
        if not full:
            return state
        if self.cache.shares_prefixes:
            state["radix_cache"] = self.cache.tree_metrics()
        if self.handoff is not None:
            state["disaggregation"] = self.handoff.state()
        if not self.running and not self.waiting and not self._handoff_busy():
            try:
                self.check_integrity()
                state["integrity_ok"] = True
            except AssertionError as e:
                state["integrity_ok"] = False
                state["integrity_error"] = str(e)
        return state

    def get_load(self) -> dict:
        """Queue lengths, pool occupancy and hits per tier from counters kept anyway (no walk, no check)."""
        return {"running_requests": len(self.running), "waiting_requests": len(self.waiting), **self.cache.pool_pages(),
                "prompt_tokens": self.metrics["prompt_tokens"], "cached_tokens": self.metrics["cached_tokens"],
                **self.cache.metrics, **self._tier_costs()}

    def _tier_costs(self) -> dict:
        """Measured seconds per token: computing one (forward time over tokens computed, prefill and
        decode alike), loading one back from L2, reading one from L3 (0.0 until measured)."""
        m = self.metrics
        computed = m["prompt_tokens"] - m["cached_tokens"] + m["generated_tokens"]
        busy = self.engine_meter.busy_s
        return {"compute_s_per_token": busy / computed if computed and busy else 0.0,
                **self.cache.copy_seconds_per_token()}


def error_output(rid: str, prompt_tokens: int, message: str, status: int = 400) -> ReqOutput:
    return ReqOutput(rid=rid, new_token_ids=[], finished=True, finish_reason=finish_abort(message),
                     prompt_tokens=prompt_tokens, completion_tokens=0, cached_tokens=0, error=message,
                     error_status=status)
