"""The multi-turn benchmark's own accounting, without a model server.

Ideal hit rate on hand-built workloads, the prefix index against brute force, percentiles against numpy,
barrier pauses excluded from throughput, and failure counting through the real runner against a small
fault-injecting SSE endpoint (HTTP 500, a request that never answers) that a real server cannot produce
on demand.
"""

from __future__ import annotations

import asyncio
import json
import math
import random

import numpy as np
import pytest
from aiohttp import web

from kvstrata.bench import accounting
from kvstrata.bench.accounting import PrefixIndex, RequestRecord, ideal_cached_tokens
from kvstrata.bench.multiturn import parse_args
from kvstrata.bench.runner import MultiTurnRunner, RunConfig
from kvstrata.bench.workload import Conversation, build_conversations, max_prompt_tokens


def rec(client, rnd, prompt, output, send, finish, cached=0, ttft=0.1, error=None):
    return RequestRecord(client=client, round=rnd, prompt_ids=list(prompt), output_ids=list(output),
                         send_time=send, finish_time=finish, ttft=None if error else ttft,
                         latency=None if error else finish - send, prompt_tokens=len(prompt),
                         cached_tokens=cached, completion_tokens=len(output), error=error)


# ---------------------------------------------------------------------- ideal hit rate
def test_ideal_hit_rate_of_a_hand_built_conversation():
    q0, q1, q2 = list(range(10, 20)), list(range(20, 26)), list(range(30, 34))
    out0, out1 = [100, 101, 102], [200, 201, 202]
    p1 = q0 + out0 + q1                       # 19 tokens
    p2 = p1 + out1 + q2                       # 26 tokens
    records = [rec(0, 0, q0, out0, 0.0, 1.0), rec(0, 1, p1, out1, 1.5, 2.0), rec(0, 2, p2, [9], 2.5, 3.0)]
    # The KV of prompt + output minus its last token exists: 10 + 2, then 19 + 2.
    assert ideal_cached_tokens(records) == [0, 12, 21]
    summary = accounting.summarize(records, round_barrier=False)
    assert summary["ideal_cached_tokens"] == 33
    assert summary["ideal_hit_rate"] == pytest.approx(33 / (10 + 19 + 26))
    # Whole pages only: 12 -> 10, 21 -> 20 with pages of 5.
    assert ideal_cached_tokens(records, page_size=5) == [0, 10, 20]


def test_ideal_counts_only_requests_finished_before_the_send_and_keeps_one_token():
    shared = [5, 6, 7, 8]
    a = rec(0, 0, shared + [1], [50], 0.0, 1.0)
    concurrent = rec(1, 0, shared + [2], [60], 0.5, 1.2)      # sent while `a` was running
    later = rec(2, 0, shared + [1], [70], 2.0, 3.0)           # same prompt as `a`, sent after it finished
    failed = rec(3, 0, [9, 9, 9, 9], [], 0.0, 0.2, error="HTTP 500")
    after_failed = rec(4, 0, [9, 9, 9, 9, 1], [1], 1.0, 1.5)
    ideal_cached_tokens([a, concurrent, later, failed, after_failed])
    assert concurrent.ideal_cached_tokens == 0
    assert later.ideal_cached_tokens == len(later.prompt_ids) - 1   # never the whole prompt
    assert after_failed.ideal_cached_tokens == 0                     # a failed request cached nothing


def test_prefix_index_matches_brute_force():
    rng = random.Random(0)
    index, inserted = PrefixIndex(), []
    for _ in range(300):
        seq = [rng.randrange(4) for _ in range(rng.randrange(0, 12))]
        expected = max((_common(seq, s) for s in inserted), default=0)
        assert index.longest_prefix(seq) == expected
        if rng.random() < 0.5:
            index.insert(seq)
            inserted.append(seq)


def _common(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_workload_histories_have_the_ideal_the_brief_expects():
    convs = build_conversations(2, 3, request_length=8, sub_question_length=5,
                                make_prompts=lambda n, length: [[1000 + i] * length for i in range(n)])
    assert [len(c.questions) for c in convs] == [2, 2]
    assert max_prompt_tokens(8, 5, 2, 3) == 8 + 2 * (2 + 5)


# ---------------------------------------------------------------------- statistics
@pytest.mark.parametrize("q", [0, 10, 50, 90, 99, 100])
def test_percentiles_match_numpy(q):
    rng = random.Random(q)
    for n in (1, 2, 7, 100):
        xs = [rng.expovariate(1.0) for _ in range(n)]
        assert accounting.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert math.isnan(accounting.percentile([], q))


def test_throughput_excludes_barrier_pauses():
    # Round 0 runs 0..2 s, nothing runs 2..5 s (barrier), round 1 runs 5..6 s.
    records = [rec(0, 0, [1] * 100, [1], 0.0, 2.0), rec(1, 0, [2] * 100, [1], 0.5, 1.5),
               rec(0, 1, [1] * 200, [1], 5.0, 6.0, cached=100), rec(1, 1, [2] * 200, [1], 5.2, 5.8)]
    duration, pause = accounting.active_duration(records, round_barrier=True)
    assert (duration, pause) == (pytest.approx(3.0), pytest.approx(3.0))
    summary = accounting.summarize(records, round_barrier=True)
    assert summary["input_throughput"] == pytest.approx(600 / 3.0)
    assert summary["cache_hit_rate"] == pytest.approx(100 / 600)
    assert accounting.active_duration(records, round_barrier=False)[0] == pytest.approx(6.0)


def test_tier_metrics_report_counter_deltas_once_and_skip_the_rest():
    before = {"internal_states": [{"device_hit_tokens": 10, "cache_hit_rate": 0.1, "free_pages": 3,
                                   "radix_cache": {"tokens_hit": 5}, "hicache": {"tokens_hit": 5}}]}
    after = {"internal_states": [{"device_hit_tokens": 50, "cache_hit_rate": 0.4, "free_pages": 1,
                                  "radix_cache": {"tokens_hit": 25}, "hicache": {"tokens_hit": 25},
                                  "l3_hit_tokens": 7, "integrity_ok": True}]}
    assert accounting.tier_metrics(before, after) == {
        "device_hit_tokens": 40, "cache_hit_rate": 0.4, "hicache.tokens_hit": 20, "l3_hit_tokens": 7}


def test_cache_report_divides_scheduler_cpu_by_forward_steps_and_keeps_empty_steps_apart():
    before = {"internal_states": [{"scheduler_cpu_s": 1.0, "step": 100, "empty_steps": 5, "empty_step_cpu_s": 0.5}]}
    after = {"internal_states": [{"scheduler_cpu_s": 3.0, "step": 300, "empty_steps": 45, "empty_step_cpu_s": 2.5,
                                  "integrity_ok": True}]}
    report = accounting.cache_report(before, after)
    assert report["scheduler_cpu_ms_per_step"] == pytest.approx(10.0)
    assert report["empty_steps"] == 40 and report["empty_step_cpu_s"] == pytest.approx(2.0)
    assert report["integrity_ok"] is True


def test_server_flags_need_launch():
    args, extra = parse_args(["--launch", "--max-total-tokens", "4096", "--num-clients", "3"])
    assert extra == ["--max-total-tokens", "4096"] and args.num_clients == 3
    with pytest.raises(SystemExit):
        parse_args(["--max-total-tokens", "4096"])


# ---------------------------------------------------------------------- failures through the runner
FAIL_500, HANG = 1, 2      # the last prompt token tells the endpoint what to do


async def _scripted_generate(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    ids = body["input_ids"]
    if ids[-1] == FAIL_500:
        return web.Response(status=500, text="injected failure")
    if ids[-1] == HANG:
        await asyncio.sleep(3600)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    n = body["sampling_params"]["max_new_tokens"]
    for k in range(1, n + 1):
        meta = {"prompt_tokens": len(ids), "completion_tokens": k, "cached_tokens": len(ids) // 2}
        await resp.write(f"data: {json.dumps({'output_ids': [7] * k, 'meta_info': meta})}\n\n".encode())
        await asyncio.sleep(0.01)
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def _run_against_scripted(convs, cfg):
    app = web.Application()
    app.router.add_post("/generate", _scripted_generate)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        return await asyncio.wait_for(MultiTurnRunner(f"http://127.0.0.1:{port}/generate", convs, cfg).run(), 30)
    finally:
        await runner.cleanup()


def test_failures_are_counted_and_never_hold_the_round_barrier():
    convs = [
        Conversation(0, [10, 11, 12], [[13, 14], [15, 16]]),            # completes all three rounds
        Conversation(1, [20, 21, 22], [[23, FAIL_500], [25, 26]]),     # fails in round 1
        Conversation(2, [30, 31, HANG], [[33, 34], [35, 36]]),         # never answers in round 0
    ]
    cfg = RunConfig(output_length=3, max_parallel=4, request_rate=float("inf"), enable_round_barrier=True,
                    request_timeout_s=1.0, progress=False)
    outcome = asyncio.run(_run_against_scripted(convs, cfg))
    by_client = {c: sorted((r.round, r.ok) for r in outcome.records if r.client == c) for c in range(3)}
    assert by_client == {0: [(0, True), (1, True), (2, True)], 1: [(0, True), (1, False)], 2: [(0, False)]}
    assert outcome.skipped == 1 + 2
    errors = sorted(r.error for r in outcome.records if not r.ok)
    assert errors[0].startswith("HTTP 500") and "timed out" in errors[1]
    summary = accounting.summarize(outcome.records, round_barrier=True, skipped=outcome.skipped)
    assert (summary["completed"], summary["failed"], summary["skipped"]) == (4, 2, 3)
    # Round 2 of client 0 carries its whole history: prompt + 3 outputs + question, twice.
    last = next(r for r in outcome.records if r.client == 0 and r.round == 2)
    assert last.prompt_ids == [10, 11, 12, 7, 7, 7, 13, 14, 7, 7, 7, 15, 16]
    # The barrier held round 1 until the hung request had timed out.
    first_round1 = min(r.send_time for r in outcome.records if r.round == 1)
    assert first_round1 >= 1.0
