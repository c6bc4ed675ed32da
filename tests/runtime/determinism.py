"""The batch-invariance check shared by the determinism tests (dense and MoE): one greedy request alone, then
inside batches of other requests, bit-identical every time (see tests/runtime/test_deterministic.py)."""

from __future__ import annotations

import os
import random

from tests.runtime.helpers import assert_idle_integrity

# Trials per dtype and page size (each: alone, then in batches of 2, 8 and 32). The acceptance run
# uses KVSTRATA_DETERMINISM_TRIALS=40.
TRIALS = int(os.environ.get("KVSTRATA_DETERMINISM_TRIALS", "3"))


def _target(rng: random.Random, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(rng.randrange(20, 90))]


def _others(rng: random.Random, target: list[int], count: int, vocab: int) -> list[list[int]]:
    out = []
    for _ in range(count):
        if rng.random() < 0.3:   # shares a prefix with the target
            cut = rng.randrange(1, len(target))
            out.append(target[:cut] + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 40))])
        else:
            out.append([rng.randrange(3, vocab) for _ in range(rng.randrange(2, 200))])
    return out


def _run(engine, prompts: list[list[int]], params: list[dict]) -> list[dict]:
    return engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=3)


def _signature(out: dict) -> tuple:
    meta = out["meta_info"]
    return (tuple(out["output_ids"]), tuple(map(tuple, meta["output_token_logprobs"])),
            tuple(tuple(map(tuple, t)) for t in meta["output_top_logprobs"]))


def check_alone_equals_in_batches(engine, rng: random.Random, dtype: str, trials: int = TRIALS, vocab: int = 250) -> None:
    """For `trials` target prompts: the target alone, then inside batches of 1, 7 and 31 other requests (some
    sharing its prefix, at a random place, the cache sometimes flushed), bit-identical every time. `vocab`:
    the ids drawn (the tiny tokenizer's byte-level ids by default)."""
    greedy = {"temperature": 0, "max_new_tokens": 16}
    for trial in range(trials):
        target = _target(rng, vocab)
        engine.flush_cache()
        alone = _signature(_run(engine, [target], [greedy])[0])
        # Greedy: the chosen token is always the first of the top logprobs.
        assert [top[0][1] for top in alone[2]] == list(alone[0])
        for count in (1, 7, 31):
            others = _others(rng, target, count, vocab)
            params = [{"temperature": 0, "max_new_tokens": rng.randrange(1, 24)} for _ in others]
            at = rng.randrange(count + 1)
            prompts = others[:at] + [target] + others[at:]
            params = params[:at] + [greedy] + params[at:]
            if rng.random() < 0.5:
                engine.flush_cache()
            got = _signature(_run(engine, prompts, params)[at])
            assert got == alone, f"trial {trial}, batch of {count + 1}, {dtype}: output differs"
    assert_idle_integrity(engine)
