"""Prefix cache through HTTP: cached_tokens, cache_salt isolation, /flush_cache safety, metrics."""

from __future__ import annotations

import threading

PROMPT = "A shared system prompt that many requests reuse, about caches and pages. " * 3
GREEDY = {"temperature": 0, "max_new_tokens": 4}


def gen(server, **body):
    r = server.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY, **body})
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]


def test_cache_salt_isolates_tenants(server):
    gen(server, cache_salt="tenant-x")
    assert gen(server, cache_salt="tenant-y")["cached_tokens"] == 0
    again = gen(server, cache_salt="tenant-x")
    assert again["cached_tokens"] >= again["prompt_tokens"] - 1
    bad = server.post("/generate", json={"text": "x", "cache_salt": 5})
    assert bad.status_code == 400 and "cache_salt" in bad.json()["error"]["message"]


def test_openai_usage_reports_cached_tokens(server, openai_client):
    messages = [{"role": "system", "content": PROMPT}, {"role": "user", "content": "hello"}]
    openai_client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0)
    second = openai_client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= second.usage.prompt_tokens - 1


def test_flush_refused_while_running_then_succeeds(server):
    done = {}

    def long_request():
        done["meta"] = gen(server, sampling_params={"temperature": 0, "max_new_tokens": 400, "ignore_eos": True})

    t = threading.Thread(target=long_request)
    t.start()
    try:
        refused = None
        for _ in range(200):
            state = server.scheduler_state()
            if state["running_requests"]:
                refused = server.post("/flush_cache")
                break
        assert refused is not None and refused.status_code >= 400, "flush must be refused mid-request"
    finally:
        t.join(timeout=120)
    assert done["meta"]["completion_tokens"] == 400     # the running request was not broken
    state = server.wait_idle()
    assert server.post("/flush_cache").status_code == 200
    state = server.scheduler_state()
    assert state["cache_pages"] == 0 and state["free_pages"] == state["capacity_pages"]
    assert state["integrity_ok"]
    assert {"tokens_requested", "tokens_hit", "hit_rate", "evictable_tokens", "protected_tokens"} \
        <= set(state["radix_cache"])
