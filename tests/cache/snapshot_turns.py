"""Conversations replayed turn by turn on an Engine with a small device pool over L2: the L2 snapshot tests
and the MoE engine test share them."""

from __future__ import annotations

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
OPENINGS = ["Agent A speaks first about caches and pages. ", "Bravo answers in turn, a different one. ",
            "Charlie speaks here, with a third story. "]
QUESTIONS = ["Tell me more about it, please.", "And what happens after that?"]
# Three conversations need more than the 96-token device pool, so most of each history is on the host only.
L2 = {"enable_hierarchical_cache": True, "hicache_ratio": 8, "max_total_tokens": 96, "chunked_prefill_size": 32}


def turn(engine, history: list[int], question: str) -> tuple[list[int], dict]:
    """One greedy turn: (the new history, meta_info)."""
    prompt = history + engine.tokenizer.encode(question, add_special_tokens=False)
    out = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    return prompt + out["output_ids"], out["meta_info"]


def openings(engine) -> list[list[int]]:
    """The token ids of each conversation's opening."""
    return [engine.tokenizer.encode(o, add_special_tokens=False) for o in OPENINGS]


def first_round(engine) -> list[list[int]]:
    """Each conversation after its first question and answer."""
    return [turn(engine, h, QUESTIONS[0])[0] for h in openings(engine)]
