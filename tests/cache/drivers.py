"""Drivers of the cache in tests: the facade driven as the scheduler drives it, and conversations through
an Engine. Test modules share these (never each other's)."""

from __future__ import annotations

import zlib
from pathlib import Path

from kvstrata.cache.manager import KVCacheManager
from kvstrata.memory.device_pool import DeviceKVPool
from kvstrata.runtime.req import Req
from kvstrata.runtime.sampling_params import SamplingParams
from tests.cache.stack import LAYERS, make_cache

# Engine settings that push a short multi-turn workload through L1 evictions into L2 (tiny model).
SMALL_TIERS = {"enable_hierarchical_cache": True, "hicache_ratio": 6, "max_total_tokens": 160,
               "chunked_prefill_size": 32}


def make_manager(page_size: int, device_pages: int, context: int = 128, **fields) -> KVCacheManager:
    """A cache facade over a small CPU pool; `fields`: ServerArgs fields (tiers, --kv-run-spare-tokens)."""
    return make_cache(page_size, device_pages, context, **fields)[0]


def new_req(rid: str, tokens: list[int]) -> Req:
    return Req(rid=rid, prompt_ids=tokens, sampling=SamplingParams(max_new_tokens=4))


def run_prefill(manager: KVCacheManager, req: Req, budget: int = 64) -> None:
    """Plan, admit, 'compute' the chunk and commit it, as the scheduler does."""
    plan = manager.plan_admit(req, budget)
    assert plan is not None and plan.fits() and manager.admit(req, plan)
    manager.advance(req, req.slot_len)
    manager.commit(req)


def cache_on_host_only(manager: KVCacheManager, history: list[int]) -> None:
    """Compute `history` (plus one token) into the cache, then demote it all to the host tier."""
    req = new_req("history", history + [99])
    run_prefill(manager, req, budget=len(history) + 1)
    manager.release(req)
    manager.host.wait_idle()                          # the write-through backups land
    manager.device.evict(10**6)                       # demote everything to the host


def kv_value(tokens: list[int]) -> float:
    """The fake K value of the last token of `tokens` (a function of its whole prefix)."""
    return float(zlib.crc32(bytes(tokens)) % 10007)


def compute(manager: KVCacheManager, pool: DeviceKVPool, req: Req) -> None:
    """Pretend to run the forward: wait for load-backs, check cached KV, write KV of the new tokens."""
    wait = manager.take_layer_wait()
    for layer in range(LAYERS):
        if wait is not None:
            wait(layer)
    tokens = req.fill_ids
    slots = manager.slots_of(req, 0, req.slot_len)
    for i in range(req.kv_len):
        got = pool.k_buffer[0][slots[i], 0, 0].item()
        assert got == kv_value(tokens[: i + 1]), f"cached KV of token {i} is wrong: a page was lost or mixed up"
    for i in range(req.kv_len, req.slot_len):
        for layer in range(LAYERS):
            pool.k_buffer[layer][slots[i]] = kv_value(tokens[: i + 1])
    manager.advance(req, req.slot_len)


# ---- L1 + L2 + file L3, a served history and its follow-up ---------------------------------------------

PAGE = 4
DEVICE_PAGES = 33


def make_file_l3_manager(storage_dir: Path) -> KVCacheManager:
    """L1 + L2 + a file L3 in `storage_dir`, 4-token pages and L3 objects, the timeout prefetch policy."""
    model_dir = storage_dir / "model"              # names the L3 namespace; no weights are needed
    model_dir.mkdir(exist_ok=True)
    return make_cache(PAGE, DEVICE_PAGES, model_dir=str(model_dir), enable_hierarchical_cache=True, hicache_ratio=2.0,
                      hicache_storage_backend="file", hicache_storage_dir=str(storage_dir),
                      hicache_storage_page_tokens=PAGE, hicache_storage_prefetch_policy="timeout")[0]


def serve(manager: KVCacheManager, req: Req) -> None:
    """Admit, 'compute' and release `req`, caching its prompt (KV values do not matter here)."""
    assert manager.admit(req) and manager.reserve(req, req.fill_len - req.kv_len)
    manager.take_layer_wait()
    manager.advance(req, req.slot_len)
    manager.release(req)


def settle(manager: KVCacheManager) -> None:
    """Let every host copy and L3 write/read land and be applied."""
    manager.host.wait_idle()
    manager.storage.wait_idle()


HISTORY_TOKENS = 40


def serve_history(manager: KVCacheManager) -> Req:
    """Serve a 40-token history (L1, L2 and L3 then hold it); returns its follow-up, not yet started."""
    history = list(range(1, HISTORY_TOKENS + 1))
    serve(manager, Req(rid="r0", prompt_ids=history, sampling=SamplingParams(max_new_tokens=1)))
    settle(manager)
    return Req(rid="r1", prompt_ids=history + list(range(100, 120)), sampling=SamplingParams(max_new_tokens=1))


def follow_up_after_history(manager: KVCacheManager) -> Req:
    """Serve a 40-token history, then start the prefetch of a follow-up."""
    nxt = serve_history(manager)
    manager.start_prefetch(nxt)        # only the new question is looked up in L3: it is not there
    return nxt


# ---- conversations through an Engine ----------------------------------------------------------------

CONVERSATION_GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
QUESTIONS = ["Tell me about caches and pages in a serving engine.",
             "Why does prefix sharing help multi-turn chat so much?",
             "And what does the host tier add on top of that?"]
CONVERSATIONS = ["Agent A speaks first. ", "Bravo answers in turn, a different one. ",
                 "Charlie speaks here. ", "Delta. "]


def run_conversations(engine, rounds: int = 3) -> tuple[list[list[int]], list[dict]]:
    """Interleave conversations round by round; each turn's prompt is the history plus a new question."""
    histories = [engine.tokenizer.encode(c, add_special_tokens=False) for c in CONVERSATIONS]
    outputs, metas = [], []
    for r in range(rounds):
        for i, hist in enumerate(histories):
            prompt = hist + engine.tokenizer.encode(QUESTIONS[r % len(QUESTIONS)], add_special_tokens=False)
            out = engine.generate(input_ids=prompt, sampling_params=CONVERSATION_GREEDY)
            outputs.append(out["output_ids"])
            metas.append({"round": r, "history": len(hist), **out["meta_info"]})
            histories[i] = prompt + out["output_ids"]
    return outputs, metas


# ---- eviction order ------------------------------------------------------------------------------------

def assert_next_eviction_is_policy_min(tree, candidate, tier: str) -> None:
    """The tier's kept eviction order offers first what a fresh walk of the whole tree would: the candidate
    with the smallest (policy key, node id). Peeking leaves the order as it was."""
    from kvstrata.cache.eviction import eviction_key

    key = eviction_key(tree.eviction_policy)
    brute = min(((key(n), n.id, n) for n in tree.nodes() if candidate(n)), default=None)
    order = tree.eviction_order(candidate, tier)
    first = next(order, None)
    order.close()
    assert (first is None) == (brute is None), f"{tier}: kept order offers {first}, a walk finds {brute}"
    assert first is None or first is brute[2], f"{tier}: kept order offers {first}, the policy minimum is {brute[2]}"
