"""Units of the router without servers: prefix tree, routing keys, policies, RouterArgs and its CLI."""

from __future__ import annotations

import argparse
import random

import pytest

from kvstrata.args import ConfigError
from kvstrata.router.args import RouterArgs, check_worker_url
from kvstrata.router.policies import (
    CacheAwarePolicy,
    PowerOfTwoPolicy,
    RoundRobinPolicy,
    TierAwarePolicy,
    make_policy,
)
from kvstrata.router.prefix_tree import PrefixTree
from kvstrata.router.request_key import route_key
from kvstrata.router.workers import Worker, WorkerLoad, WorkerRegistry


# ---------------------------------------------------------------------- prefix tree
def test_tree_match_insert_split():
    t = PrefixTree()
    t.insert((1, 2, 3, 4))
    t.insert((1, 2, 5))
    assert t.match((1, 2, 3, 4, 9)) == 4
    assert t.match((1, 2, 5, 6)) == 3
    assert t.match((1, 2)) == 2
    assert t.match((7,)) == 0
    assert t.size == 5          # 1,2 shared; 3,4 and 5 on their own edges


def test_tree_text_keys():
    t = PrefixTree()
    t.insert("system: be brief\nuser: hi")
    assert t.match("system: be brief\nuser: hello") == len("system: be brief\nuser: h")
    assert t.match("other") == 0


def test_tree_matches_a_reference_on_random_sequences():
    rng = random.Random(0)
    t, seen = PrefixTree(), []
    for _ in range(300):
        base = rng.choice(seen) if seen and rng.random() < 0.7 else ()
        key = tuple(base[:rng.randint(0, len(base))]) + tuple(rng.randint(0, 3) for _ in range(rng.randint(1, 6)))
        expected = max((_common(key, s) for s in seen), default=0)
        assert t.match(key) == expected
        t.insert(key)
        seen.append(key)
    assert t.size == _distinct_prefixes(seen)


def test_tree_evicts_least_recently_used_leaves():
    t = PrefixTree()
    t.insert((1, 1, 1, 1))
    t.insert((2, 2, 2, 2))
    t.insert((3, 3, 3, 3))
    t.match((1, 1, 1, 1))       # 2,2,2,2 is now the least recently used
    assert t.evict(8) == 4
    assert t.match((2, 2, 2, 2)) == 0
    assert t.match((1, 1, 1, 1)) == 4 and t.match((3, 3, 3, 3)) == 4
    assert t.evict(100) == 0
    t.evict(0)
    assert t.size == 0 and t.match((1,)) == 0


def _common(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _distinct_prefixes(seqs) -> int:
    return len({s[:i] for s in seqs for i in range(1, len(s) + 1)})


# ---------------------------------------------------------------------- routing keys
@pytest.mark.parametrize("path,body,expected", [
    ("/generate", b'{"input_ids": [5, 6, 7]}', (5, 6, 7)),
    ("/generate", b'{"input_ids": [[5, 6], [8]]}', (5, 6)),
    ("/generate", b'{"text": "hello"}', "hello"),
    ("/generate", b'{"text": ["a b", "c"]}', "a b"),
    ("/v1/completions", b'{"prompt": "once upon"}', "once upon"),
    ("/v1/completions", b'{"prompt": [1, 2]}', (1, 2)),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}]}', "user\nhi\n"),
    ("/generate", b"not json", None),
    ("/generate", b'[1, 2]', None),
    ("/generate", b'{"text": 5}', None),
])
def test_route_key(path, body, expected):
    assert route_key(path, body) == expected


# ---------------------------------------------------------------------- policies
def _workers(n: int) -> list[Worker]:
    ws = [Worker(f"http://127.0.0.1:{9000 + i}") for i in range(n)]
    for w in ws:
        w.healthy = True
    return ws


def test_round_robin_alternates():
    p, ws = RoundRobinPolicy(), _workers(2)
    assert [p.select(ws, None).worker.url for _ in range(4)] == [ws[0].url, ws[1].url] * 2


def test_power_of_two_prefers_the_less_loaded():
    p, ws = PowerOfTwoPolicy(), _workers(2)
    ws[0].in_flight = 5
    assert all(p.select(ws, None).worker is ws[1] for _ in range(20))


def test_cache_aware_follows_the_prefix_above_the_threshold():
    p, ws = CacheAwarePolicy(RouterArgs(cache_threshold=0.5)), _workers(2)
    convo = tuple(range(100))
    first = p.select(ws, convo)
    p.record(first.worker, convo)
    other = [w for w in ws if w is not first.worker][0]
    other.in_flight = 0
    first.worker.in_flight = 3           # busier, but not imbalanced past the thresholds
    again = p.select(ws, convo + (7, 8))
    assert again.worker is first.worker and again.reason == "cache_hit"
    short = p.select(ws, convo[:10] + tuple(range(500, 600)))   # 10% match: below the threshold
    assert short.worker is other and short.reason == "cache_miss"


def test_cache_aware_balances_when_imbalanced():
    p, ws = CacheAwarePolicy(RouterArgs(balance_abs_threshold=4, balance_rel_threshold=1.5)), _workers(2)
    p.record(ws[0], (1, 2, 3))
    ws[0].in_flight = 10
    d = p.select(ws, (1, 2, 3))
    assert d.worker is ws[1] and d.reason == "load_balance"


def test_tier_aware_keeps_affinity_but_spreads_a_hot_prefix():
    p, ws = TierAwarePolicy(RouterArgs()), _workers(2)
    hot = tuple(range(1000))
    counts = {w.url: 0 for w in ws}
    for i in range(40):
        key = hot + (10_000 + i,)
        d = p.select(ws, key)
        units = len(key) - d.worker.tree_for(key).match(key)
        p.record(d.worker, key)
        d.worker.begin(units)            # requests pile up (none finishes): queueing must spread them
        counts[d.worker.url] += 1
    assert min(counts.values()) >= 15, counts


def test_tier_aware_returning_turn_stays_when_load_is_even():
    p, ws = TierAwarePolicy(RouterArgs()), _workers(2)
    convs = [tuple(range(i * 1000, i * 1000 + 300)) for i in range(6)]
    home = {}
    for c in convs:
        d = p.select(ws, c)
        p.record(d.worker, c)
        home[c] = d.worker
    assert len({w.url for w in home.values()}) == 2      # new conversations spread over both
    for c in convs:
        assert p.select(ws, c + (1, 2, 3)).worker is home[c]


def test_tier_aware_weighs_a_shared_storage_tier():
    p, ws = TierAwarePolicy(RouterArgs(tier_storage_weight=0.3)), _workers(2)
    for w in ws:
        w.load = WorkerLoad(storage_id="file:/shared")
    key = tuple(range(1000))
    p.record(ws[0], key)
    ws[0].pending_prefill = 500          # busy: a worker that can load the prefix from L3 is cheaper
    assert p.select(ws, key + (1,)).worker is ws[1]
    ws[1].load = WorkerLoad()            # no shared L3: it would prefill everything
    assert p.select(ws, key + (1,)).worker is ws[0]


def test_make_policy_names():
    for name in ("random", "round_robin", "power_of_two", "cache_aware", "tier_aware"):
        assert make_policy(RouterArgs(policy=name)).name == name


def test_registry_add_remove():
    reg = WorkerRegistry()
    w, new = reg.add("http://127.0.0.1:1")
    assert new and not w.routable
    w.healthy = True
    assert reg.routable() == [w]
    w.draining = True
    assert reg.routable() == []
    assert reg.add("http://127.0.0.1:1") == (w, False) and not w.draining
    assert reg.remove("http://127.0.0.1:1") is w and reg.all() == []



def test_registry_ids_keys_and_stalls():
    reg = WorkerRegistry()
    a, _ = reg.add("http://127.0.0.1:1", api_key="s3cret")
    b, _ = reg.add("http://127.0.0.1:2")
    assert (a.id, b.id, a.api_key, b.api_key) == ("worker-0", "worker-1", "s3cret", None)
    assert "s3cret" not in repr(a) and "s3cret" not in str(a.summary())
    reg.remove(a.url)
    again, _ = reg.add(a.url)
    assert again.id == "worker-0" and again.api_key is None     # the id stays, a key is given per add
    again.healthy = again.stalled = True
    assert not again.routable and again.silent_for() == 0.0     # idle: silence is not counted
    again.begin(0)
    again.progress()
    assert again.routable and again.silent_for() < 1.0


# ---------------------------------------------------------------------- args and CLI
def test_cli_is_generated_from_router_args():
    parser = argparse.ArgumentParser()
    RouterArgs.add_cli_args(parser)
    ns = parser.parse_args(["--worker-urls", "http://127.0.0.1:1", "http://127.0.0.1:2", "--policy",
                            "cache_aware", "--eviction-interval", "30", "--cache-threshold", "0.5",
                            "--max-tree-size", "1000", "--api-key", "k", "--max-concurrent-requests", "8",
                            "--admin-api-key", "a", "--worker-first-byte-timeout-secs", "7.5"])
    args = RouterArgs.from_cli_args(ns)
    assert args.admin_api_key == "a" and args.worker_first_byte_timeout_secs == 7.5
    assert args.worker_urls == ("http://127.0.0.1:1", "http://127.0.0.1:2")
    assert args.policy == "cache_aware" and args.eviction_interval_secs == 30 and args.cache_threshold == 0.5
    assert args.max_tree_size == 1000 and args.api_key == "k" and args.max_concurrent_requests == 8
    defaults = RouterArgs.from_cli_args(parser.parse_args([]))
    assert defaults == RouterArgs() and defaults.policy == "tier_aware"


@pytest.mark.parametrize("url", [
    "foo", "127.0.0.1:80", "ftp://h:1", "http://h", "http://h:1/x", "http://h:99999", "http://h:0",
    "http://<img src=x onerror=alert(1)>:80", "http://a\"b:1", "http://user:pw@h:1", "http://h:1?q", "http://h:1#f",
    "http://h:1//", "http://-h:1", "http://h-:1", "http://a..b:1", "http://" + "a" * 64 + ":1", "http://999.0.0.1:1",
    "http://1.2.3:1", "http://[::1%25lo]:1", "http://[nope]:1", "HTTP://h:1", "http://h:1\n", " http://h:1",
    "http://h :1", "http://h:+1"])
def test_bad_worker_urls(url):
    with pytest.raises(ConfigError):
        check_worker_url(url)


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "https://w-0.w.default.svc.cluster.local:30000/",
                                 "http://[::1]:80", "http://[fd00::1:2]:1", "http://localhost:65535"])
def test_good_worker_urls(url):
    assert check_worker_url(url) == url.rstrip("/")


def test_bad_settings():
    with pytest.raises(ConfigError):
        RouterArgs(policy="nope")
    with pytest.raises(ConfigError):
        RouterArgs(cache_threshold=2)
    with pytest.raises(ConfigError):
        RouterArgs(max_concurrent_requests=0)
    with pytest.raises(ConfigError):
        RouterArgs(worker_first_byte_timeout_secs=0)
    assert check_worker_url("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"


# ---------------------------------------------------------------------- commands
def test_cli_registers_router_and_its_benchmark(capsys):
    from kvstrata.bench import BENCHMARKS
    from kvstrata.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["router", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--worker-urls", "--policy", "--cache-threshold", "--balance-abs-threshold",
                 "--balance-rel-threshold", "--eviction-interval-secs", "--eviction-interval", "--max-tree-size",
                 "--api-key", "--request-timeout-secs", "--max-concurrent-requests", "--log-level"):
        assert flag in out
    assert BENCHMARKS["router"] == "kvstrata.bench.router_bench"


def test_bench_report_and_targets():
    from kvstrata.bench.router_bench import render

    def run(hit: float, ttft: float, per_worker: dict) -> dict:
        s = {"cache_hit_rate": hit, "ideal_hit_rate": 0.6, "mean_ttft": ttft, "p90_ttft": ttft * 2,
             "input_throughput": 100.0, "failed": 0}
        return {"multiturn": dict(s), "hot": {**s, "per_worker": per_worker}}

    rows = [{"policy": "round_robin", **run(0.3, 1.0, {"a": 20, "b": 20})},
            {"policy": "cache_aware", **run(0.6, 0.8, {"a": 36, "b": 4})},
            {"policy": "tier_aware", **run(0.59, 0.6, {"a": 21, "b": 19})}]
    overhead = {"direct_ttft": 0.0300, "routed_ttft": 0.0305, "generate_rps_direct": 100.0,
                "generate_rps_routed": 99.0, "info_rps_direct": 3000.0, "info_rps_routed": 1500.0}
    md = render(rows, overhead, "kvstrata bench router", "test machine", "today")
    assert "| cache_aware | 60.0% |" in md and "9.00" in md          # 36/4 concentrated
    assert "98.3% of cache_aware's (>= 98%): met" in md
    assert "60.0% of round_robin's (<= 70%): met" in md
    assert "= 1.11 (<= 1.3): met" in md and "= 0.50 ms (<= 1 ms): met" in md
