"""PD disaggregation with tensor parallelism on both sides: each rank writes its own KV shard (prefill rank r
into decode rank r) through the real Mooncake transfer engine; greedy output equals TP=1's; a TP=1 decode is
refused with an error naming both layouts; one rank's failed write fails the request on every rank, and
both servers' accounting comes back to where it started."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import requests
import torch

from kvstrata.bench.launcher import ServerProcess, free_port
from kvstrata.disagg.messages import ShardTarget
from kvstrata.disagg.shard import FAULT_RANK_ENV, EndpointQuery, ShardEndpoint, ShardGroup, ShardWrite, encode
from kvstrata.disagg.transfer import LoopbackTransfer, TransferError
from kvstrata.memory.device_pool import DeviceKVPool
from tests.disagg.conftest import ROUTER_FLAGS, SECRET, generate, greedy, pd_flags, state, wait_for, wait_idle

TP2 = ["--tp-size", "2"]
SHARED = "Tensor-parallel ranks each hold a shard of the KV cache and write it to their peer. "
PROMPTS = ["Hi", "The capital of France is", SHARED + "What is a radix tree?", SHARED + "What is a radix tree?",
           SHARED + "Why shard the heads?", "A long one: " + "the quick brown fox jumps over the lazy dog " * 6]


# ---------------------------------------------------------------------------------------------- shards, in-process
def _pool(seed: int) -> DeviceKVPool:
    pool = DeviceKVPool(num_pages=8, page_size=4, num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32,
                        device="cpu")
    g = torch.Generator().manual_seed(seed)
    for buf in (*pool.k_buffer, *pool.v_buffer):
        buf.copy_(torch.randn(buf.shape, generator=g))
    return pool


class _Ranks:
    """Two ranks of a prefill and of a decode in one process: rank r's engine reaches both rank-r pools."""

    def __init__(self):
        self.links = [LoopbackTransfer(f"127.0.0.1:{15000 + r}") for r in range(2)]
        self.prefill = [_pool(r) for r in range(2)]
        self.decode = [_pool(10 + r) for r in range(2)]
        self.decode_ends = [ShardEndpoint(self.links[r], self.decode[r], r, 2) for r in range(2)]

    def host(self, others: list[ShardEndpoint], pool: DeviceKVPool) -> SimpleNamespace:
        """A HandoffHost's call_ranks over rank 0's `local` and the other ranks' endpoints."""
        def call_ranks(request, local):
            return [local(request), *(e.answer(request) for e in others)]
        return SimpleNamespace(args=SimpleNamespace(tp_size=2), runner=SimpleNamespace(pool=pool),
                               call_ranks=call_ranks)


def test_every_rank_writes_its_own_shard_into_its_peer_rank():
    ranks = _Ranks()
    decode = ShardGroup(ranks.host(ranks.decode_ends[1:], ranks.decode[0]), ranks.links[0])
    targets = decode.targets()
    assert [t.session_id for t in targets] == ["127.0.0.1:15000", "127.0.0.1:15001"]
    assert decode.layout.tp_size == 2 and decode.layout.page_size == 4
    prefill_rank1 = ShardEndpoint(ranks.links[1], ranks.prefill[1], 1, 2)
    prefill = ShardGroup(ranks.host([prefill_rank1], ranks.prefill[0]), ranks.links[0])
    src, dst = [4, 5, 6, 9], [12, 13, 14, 20]
    written = prefill.write(targets, src, dst)
    assert written.rank_bytes == [2 * 2 * 4 * 4 * 4] * 2 and written.nbytes == sum(written.rank_bytes)
    for r in range(2):
        for s_buf, d_buf in zip((*ranks.prefill[r].k_buffer, *ranks.prefill[r].v_buffer),
                                (*ranks.decode[r].k_buffer, *ranks.decode[r].v_buffer)):
            assert torch.equal(d_buf[dst], s_buf[src])         # rank r's shard, not rank 0's


def test_one_failed_rank_fails_the_whole_write_and_names_the_rank(monkeypatch):
    ranks = _Ranks()
    targets = [e.target() for e in ranks.decode_ends]
    monkeypatch.setenv(FAULT_RANK_ENV, "1")
    prefill = ShardGroup(ranks.host([ShardEndpoint(ranks.links[1], ranks.prefill[1], 1, 2)], ranks.prefill[0]),
                         ranks.links[0])
    with pytest.raises(TransferError, match="rank 1: injected failure") as e:
        prefill.write(targets, [4], [8])
    assert "rank 0" not in str(e.value)


def test_a_rank_answers_malformed_or_short_calls_without_raising():
    ranks = _Ranks()
    end = ranks.decode_ends[1]
    assert end.answer(b"\x93garbage") == b"" and end.answer(b"") == b""
    target = ShardTarget("127.0.0.1:15000", [0, 0], [0, 0])
    assert b"no shard target for rank 1" in end.answer(encode(ShardWrite([target], [1], [2])))
    assert b"pointers for 2 layers" in end.answer(encode(
        ShardWrite([target, ShardTarget("127.0.0.1:1", [1], [1])], [1], [2])))
    assert end.answer(encode(EndpointQuery())).startswith(b"\x83")      # a ShardTarget map
    failing = ranks.host([SimpleNamespace(answer=lambda request: b"")], ranks.decode[0])
    with pytest.raises(TransferError, match="rank 1 did not name"):
        ShardGroup(failing, ranks.links[0]).targets()


# ---------------------------------------------------------------------------------------------- real servers
@pytest.fixture(scope="module")
def tp_pd(mooncake_env, tmp_path_factory):
    """TP=2 prefill + TP=2 decode (and their router), a TP=1 decode (also the co-located reference: requests
    without bootstrap fields), and a TP=2 prefill whose rank 1 fails every write."""
    logs = tmp_path_factory.mktemp("pd-tp")
    ports = free_port(), free_port()
    s = SimpleNamespace(
        prefill=ServerProcess([*pd_flags("prefill", ports[0], SECRET), *TP2], str(logs / "prefill.log")),
        decode=ServerProcess([*pd_flags("decode", secret=SECRET), *TP2], str(logs / "decode.log")),
        decode_tp1=ServerProcess(pd_flags("decode", secret=SECRET), str(logs / "decode-tp1.log")),
        failing=ServerProcess([*pd_flags("prefill", ports[1], SECRET), *TP2], str(logs / "failing.log"),
                              env={FAULT_RANK_ENV: "1"}),
        ports=ports)
    s.router = ServerProcess(["--pd-disaggregation", "--prefill", s.prefill.url, str(ports[0]), "--decode",
                              s.decode.url, *ROUTER_FLAGS], str(logs / "router.log"), module="kvstrata.router")
    processes = [s.prefill, s.decode, s.decode_tp1, s.failing, s.router]   # all at once: the router waits
    try:
        with ThreadPoolExecutor(len(processes)) as pool:
            list(pool.map(lambda p: p.start(), processes))
        wait_for(lambda: generate(s.router.url, greedy("warm", 1)).status_code == 200, what="router ready")
        yield s
    finally:
        for p in processes:
            p.stop()


def both_halves(prefill_url: str, port: int, decode_url: str, body: dict) -> tuple[requests.Response, ...]:
    """What the PD router does (the same request with one fresh room to a prefill and a decode), the prefill's
    half first: its room is open before the decode's request arrives, so both halves get the outcome."""
    body = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": time.monotonic_ns()}
    with ThreadPoolExecutor(1) as pool:
        on_prefill = pool.submit(generate, prefill_url, body)
        wait_for(lambda: state(prefill_url)["disaggregation"]["rooms_open"] > 0, what="the prefill's room")
        on_decode = generate(decode_url, body)
        return on_prefill.result(), on_decode


def settled(url: str) -> dict:
    """The idle state of a TP=2 server, checked: integrity, every page free or cached (none held or locked),
    every rank executed the same plans."""
    s = wait_idle(url)
    assert s["integrity_ok"], s
    assert s["free_pages"] + s["cache_pages"] == s["capacity_pages"] and s["protected_tokens"] == 0, s
    assert s["tp_size"] == 2 and s["tp_ranks_agree"], s["tp_ranks"]
    d = s["disaggregation"]
    assert d.get("transfers_in_flight", 0) == d.get("rooms_open", 0) == d.get("quarantined", 0) == 0, d
    return s


def test_tp2_prefill_and_tp2_decode_match_tp1_greedy(tp_pd):
    cached = []
    for i, prompt in enumerate(PROMPTS):
        body = greedy(prompt, max_new_tokens=6 + i)
        via_pd = generate(tp_pd.router.url, body)
        alone = generate(tp_pd.decode_tp1.url, body)      # TP=1, no bootstrap fields: served co-located
        assert via_pd.status_code == 200 and alone.status_code == 200, (via_pd.text, alone.text)
        assert via_pd.json()["output_ids"] == alone.json()["output_ids"], prompt
        cached.append(via_pd.json()["meta_info"]["cached_tokens"])
    assert cached[3] > 16                 # the repeated prompt: the prefill's ranks served their cached shards
    prefill, decode = settled(tp_pd.prefill.url), settled(tp_pd.decode.url)
    writes = [r for r in prefill["disaggregation"]["recent_transfers"] if "bytes" in r][-len(PROMPTS):]
    assert len(writes) == len(PROMPTS)
    for w in writes:                      # both ranks wrote their shard, of equal size, for every request
        assert len(w["rank_bytes"]) == 2 and w["rank_bytes"][0] == w["rank_bytes"][1] > 0
        assert w["bytes"] == sum(w["rank_bytes"])
    assert prefill["disaggregation"]["transfers_failed"] == decode["disaggregation"]["transfers_failed"] == 0


def test_tp2_prefill_refuses_a_tp1_decode_naming_both_layouts(tp_pd):
    before = wait_idle(tp_pd.decode_tp1.url)
    on_prefill, on_decode = both_halves(tp_pd.prefill.url, tp_pd.ports[0], tp_pd.decode_tp1.url,
                                        greedy(PROMPTS[1], max_new_tokens=4))
    for answer in (on_prefill, on_decode):
        assert answer.status_code == 400, answer.text
        message = answer.json()["error"]["message"]
        assert "tensor-parallel KV layouts differ" in message and "prefill TP=2" in message, message
        assert "decode TP=1" in message, message
    settled(tp_pd.prefill.url)
    after = wait_idle(tp_pd.decode_tp1.url)
    assert after["integrity_ok"] and after["free_pages"] + after["cache_pages"] == after["capacity_pages"]
    assert after["free_pages"] == before["free_pages"]     # its reserved slots came back, nothing was cached


def test_one_ranks_failed_write_fails_the_request_on_every_rank(tp_pd):
    decode_before = settled(tp_pd.decode.url)
    on_prefill, on_decode = both_halves(tp_pd.failing.url, tp_pd.ports[1], tp_pd.decode.url,
                                        greedy(PROMPTS[2] + " (failing)", max_new_tokens=4))
    assert on_decode.status_code == 503, on_decode.text
    assert "rank 1: injected failure" in on_decode.json()["error"]["message"], on_decode.text
    assert on_prefill.status_code == 503 and "rank 1" in on_prefill.text, on_prefill.text
    failing, decode = settled(tp_pd.failing.url), settled(tp_pd.decode.url)
    assert failing["disaggregation"]["transfers_failed"] == 1 and failing["disaggregation"]["transfers_ok"] == 0
    assert decode["disaggregation"]["transfers_failed"] == decode_before["disaggregation"]["transfers_failed"] + 1
    assert decode["free_pages"] == decode_before["free_pages"]          # its reserved slots are free again
    assert generate(tp_pd.router.url, greedy("still serving", 3)).status_code == 200
    assert state(tp_pd.failing.url)["tp_ranks_agree"]
