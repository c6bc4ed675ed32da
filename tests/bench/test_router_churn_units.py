"""The churn bench's own accounting (kvstrata/bench/router_churn.py, residency.py): how traffic is split
between the two routers, what a worker could have served (the reachable hit), and hit vs reachable."""

from __future__ import annotations

from kvstrata.bench.accounting import RequestRecord
from kvstrata.bench.residency import Probe, probe_index
from kvstrata.bench.router_churn import reachability, second_router_carries
from kvstrata.kv_events import wire
from kvstrata.router.kv_index import KVIndex

BS = 4


def stored(ids: list[int], medium: str, parent: int | None = None, first_hash: int = 1) -> wire.KVEventBatch:
    n = len(ids) // BS
    return wire.KVEventBatch(ts=0.0, events=[wire.BlockStored(
        block_hashes=list(range(first_hash, first_hash + n)), parent_block_hash=parent, token_ids=ids,
        block_size=BS, lora_id=None, medium=medium)])


def test_request_split_sends_a_quarter_and_mixes_a_conversations_turns():
    picks = {(c, r): second_router_carries(c, r, "request") for c in range(48) for r in range(4)}
    assert picks == {(c, r): second_router_carries(c, r, "request") for c in range(48) for r in range(4)}
    assert 0.18 < sum(picks.values()) / len(picks) < 0.32
    mixed = [c for c in range(48) if len({picks[(c, r)] for r in range(4)}) == 2]
    assert len(mixed) > 10            # most conversations' turns go through both routers
    assert [second_router_carries(c, 0, "conversation") for c in range(8)] == [False, False, False, True] * 2


def test_probe_finds_the_best_holder_and_whether_part_of_it_is_off_device():
    index = KVIndex()
    for w in ("a", "b"):
        index.reset(w, in_sync=True)
    ids = list(range(100, 116))                               # 4 blocks
    index.apply("a", stored(ids[:8], "CPU"))                  # a: 2 blocks on the device
    index.apply("a", stored(ids[8:12], "CPU_PINNED", parent=2, first_hash=3))   # + 1 in host memory
    index.apply("b", stored(ids[:4], "CPU"))                  # b: 1 block
    p = probe_index(index, ["a", "b"], ids + [1, 2])
    assert p == Probe(reachable=12, device=8, in_sync=True) and p.warmable
    index.set_in_sync("b", False)
    assert not probe_index(index, ["a", "b"], ids).in_sync
    assert probe_index(index, ["b"], [9, 9, 9, 9]) == Probe(0, 0, False)


def test_shared_l3_blocks_are_reachable_from_every_worker_on_the_store():
    index = KVIndex()
    for w in ("a", "b"):
        index.reset(w, in_sync=True)
        index.set_storage(w, "file:/l3")
    ids = list(range(200, 208))
    index.apply("a", stored(ids, "DISK"))
    index.set_in_sync("a", True)
    assert probe_index(index, ["b"], ids) == Probe(8, 0, True)       # b reads what a wrote


def test_hit_vs_reachable_counts_whole_blocks():
    def rec(client: int, rnd: int, cached: int, ttft: float) -> RequestRecord:
        return RequestRecord(client=client, round=rnd, prompt_ids=[0] * 40, prompt_tokens=40, cached_tokens=cached,
                             ttft=ttft)

    recs = [rec(0, 1, 17, 1.0), rec(1, 1, 6, 3.0), rec(2, 0, 0, 5.0)]
    probes = {id(recs[0]): Probe(16, 16, True), id(recs[1]): Probe(8, 4, True), id(recs[2]): Probe(0, 0, False)}
    out = reachability(recs, probes, block=4)
    assert out["reachable_tokens"] == 24
    assert out["hit_vs_reachable"] == (16 + 4) / 24               # 17 -> 16, 6 -> 4 (whole blocks)
    assert out["best_share"] == 2 / 3                             # recs 0 and 2 got what was reachable
    assert out["warmable_requests"] == 1 and out["warmable_mean_ttft"] == 3.0
    assert out["probes_out_of_sync"] == 1


def test_render_reports_the_targets_per_l3_mode_and_the_logged_weights(tmp_path):
    from kvstrata.bench.router_churn import printed_weights, render

    log = tmp_path / "router.log"
    log.write_text("INFO tier_aware weights of worker-0: L2 load-back 0.500, L3 read 0.300 per token, relative to "
                   "computing one (1.00e-03 s/token measured; a weight not measured yet is the flag's value)\n"
                   "INFO tier_aware weights of worker-0: L2 load-back 0.050, L3 read 0.300 per token, relative to "
                   "computing one (2.00e-03 s/token measured; a weight not measured yet is the flag's value)\n")
    weights = printed_weights(str(log))
    assert weights == ["worker-0: L2 load-back 0.050, L3 read 0.300 per token, relative to computing one "
                       "(2.00e-03 s/token)"]

    def row(hit: float, ttft: float, warm_ttft: float) -> dict:
        return {"cache_hit_rate": hit, "ideal_hit_rate": 0.6, "hit_rate_vs_ideal": hit / 0.6, "reachable_tokens": 50,
                "prompt_tokens": 100, "hit_vs_reachable": hit / 0.5, "best_share": 0.9, "mean_ttft": ttft,
                "p90_ttft": ttft, "input_throughput": 1000.0, "warmable_mean_ttft": warm_ttft, "warmable_requests": 3,
                "failed": 0, "load": 12.0, "reasons": {"exact": 10}, "off_best": {"decisions": 2, "tokens": 512},
                "weights": weights}

    rows = [("tier_aware+events +L3", row(0.57, 0.4, 0.3)), ("tier_aware+events-pf +L3", row(0.57, 0.5, 0.5)),
            ("cache_aware +L3", row(0.38, 0.6, 0.6)), ("sglang-router +L3", row(0.36, 0.8, 0.8))]
    md = render(rows, None, "kvstrata bench router --churn", "machine", "now")
    assert "with events +L3: hit/ideal 95.0% (target >= 95%), hit/reachable 114.0%, 1.50x" in md
    assert "mean TTFT with events / SGLang router's +L3 = 0.50" in md
    assert "hints / no hints = 0.300 / 0.500 = 0.60" in md
    assert "| 2 (512) |" in md and "worker-0: L2 load-back 0.050" in md
