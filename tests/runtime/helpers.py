"""Helpers for runtime tests: engines on the tiny model and invariant checks."""

from __future__ import annotations

import kvstrata
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
