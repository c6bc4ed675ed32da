"""Helpers for runtime tests: engines on the tiny model and invariant checks."""

from __future__ import annotations

from collections.abc import Callable

import kvstrata
from tests.cache.drivers import SMALL_TIERS, run_conversations
from tests.device import TEST_DEVICE

GREEDY = {"temperature": 0, "max_new_tokens": 12}

PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away, there lived",
    "1 2 3 4 5 6 7 8",
    "Hello",
    "A longer prompt that talks about caches, pages, slots and prefixes, again and again, to be long.",
    "kv",
    "What is the capital of France? The capital of France is",
    "Streams of tokens flow",
]


# Tests that compare outputs across cache configurations run in both dtypes on every CPU: bf16 is the default
# on CPUs with AVX-512 BF16, float32 elsewhere, and a regression in either must show up on any machine.
NUMERIC_DTYPES = ["float32", "bfloat16"]


def make_engine(**kwargs) -> kvstrata.Engine:
    """A tiny-model engine with a deterministic seed, a small pool and batch-invariant inference unless told
    otherwise (tests compare outputs whose batches and cache hits differ)."""
    opts = {"model_path": "tiny", "max_total_tokens": 4096, "random_seed": 0, "dtype": "float32",
            "device": TEST_DEVICE.type,
            "enable_deterministic_inference": True}
    opts.update(kwargs)
    return kvstrata.Engine(**opts)


def assert_idle_integrity(engine: kvstrata.Engine) -> dict:
    """Every page back with exactly one owner once the engine is idle; returns the state."""
    state = engine.get_server_info()["internal_states"][0]
    assert state["running_requests"] == 0 and state["waiting_requests"] == 0, state
    assert state.get("integrity_ok"), state.get("integrity_error")
    return state


def engine_conversations(rounds: int = 2, check: Callable[[kvstrata.Engine], None] | None = None,
                         **kwargs) -> tuple[list[list[int]], dict]:
    """(outputs, idle state) of `rounds` rounds of the test conversations on a fresh engine (first given to
    `check`), shut down after."""
    engine = make_engine(**kwargs)
    try:
        if check is not None:
            check(engine)
        outputs, _ = run_conversations(engine, rounds=rounds)
        return outputs, assert_idle_integrity(engine)
    finally:
        engine.shutdown()


def assert_greedy_identical_across_tiers(l3_dir: str | None, rounds: int = 2,
                                         check: Callable[[kvstrata.Engine], None] | None = None,
                                         **kwargs) -> list[list[int]]:
    """Greedy outputs equal without a cache, with L1, with L1+L2 and (given `l3_dir`) from a file L3 read by a
    new engine, each tier actually hit; returns the reference outputs. `check` sees every engine."""
    reference, _ = engine_conversations(rounds, check, disable_radix_cache=True, **kwargs)
    assert len({tuple(o) for o in reference}) > 1, "outputs should depend on the prompt"
    l1, l1_state = engine_conversations(rounds, check, **kwargs)
    assert l1 == reference and l1_state["device_hit_tokens"] > 0
    l2, l2_state = engine_conversations(rounds, check, **SMALL_TIERS, **kwargs)
    assert l2 == reference and l2_state["host_hit_tokens"] > 0
    if l3_dir is not None:
        l3 = {**SMALL_TIERS, "hicache_storage_backend": "file", "hicache_storage_dir": l3_dir}
        engine_conversations(rounds, check, **l3, **kwargs)                     # fills L3
        again, l3_state = engine_conversations(rounds, check, **l3, **kwargs)   # a new engine: prompts found in L3
        assert again == reference and l3_state["storage_hit_tokens"] > 0
    return reference
