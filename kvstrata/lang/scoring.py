"""`select`: score each choice by the prompt logprobs of `prefix + choice` and pick one.

The prefix is pre-cached (`max_new_tokens: 0`), then all choices are scored in one batch request whose
`logprob_start_len` sits just before the first token where any choice's tokenization leaves the prefix's.
A choice's tokens are those of `prefix + choice` after the longest common token prefix with `prefix`
alone, so a choice whose first characters merge with the prefix's last token (token healing) is scored
with the merged token.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from kvstrata.lang.backends.base import Backend
from kvstrata.lang.choices import ChoicesMethod, mean_logprob


@dataclass
class Selection:
    """The chosen choice and what `get_meta_info(name)` reports for it."""

    index: int
    choice: str
    meta_info: dict[str, Any]


def select_choice(backend: Backend, prefix: str, choices: tuple[str, ...], method: ChoicesMethod,
                  temperature: float) -> Selection:
    """Score `choices` after `prefix` and pick one (argmax at temperature 0, else a softmax sample)."""
    prefix_ids = backend.encode(prefix)
    fulls = [backend.encode(prefix + c) for c in choices]
    commons = [_common_len(prefix_ids, ids) for ids in fulls]
    for choice, ids, k in zip(choices, fulls, commons):
        if k >= len(ids):
            raise ValueError(f"select choice {choice!r} adds no token to the prompt")
    if prefix:
        backend.cache_prefix(prefix)
    # The entry at logprob_start_len has no logprob (it is the first scored position), so start one
    # token before the earliest choice token.
    start = max(min(commons) - 1, 0)
    scored = backend.prompt_logprobs(fulls, start)
    conditional, entries = [], []
    for ids, k, got in zip(fulls, commons, scored):
        mine = got[k - start:]
        _check_alignment(mine, ids[k:])
        entries.append(mine)
        conditional.append([e[0] for e in mine])
    unconditional = _unconditional(backend, fulls, commons) if method.needs_unconditional else None
    decision = method.decide(conditional, unconditional)
    index = decision.index if temperature <= 1e-5 else _sample(decision.scores, temperature)
    tok = backend.tokenizer
    meta = {
        "choices": list(choices),
        "choices_method": method.name,
        "scores": decision.scores,
        "normalized_prompt_logprobs": [mean_logprob(c) for c in conditional],
        "input_token_logprobs": [[[e[0], e[1], tok.decode([e[1]])] for e in mine] for mine in entries],
        "unconditional_token_logprobs": unconditional,
        "prompt_tokens": [len(ids) for ids in fulls],
    }
    return Selection(index, choices[index], meta)


def _unconditional(backend: Backend, fulls: list[list[int]], commons: list[int]) -> list[list]:
    """Logprobs of each choice's tokens on their own (after BOS when the tokenizer adds one)."""
    bos = backend.auto_bos_ids()
    prompts = [bos + ids[k:] for ids, k in zip(fulls, commons)]
    scored = backend.prompt_logprobs(prompts, 0)
    return [[e[0] for e in got[len(bos):]] for got in scored]


def _check_alignment(entries: list, expected_ids: list[int]) -> None:
    got = [e[1] for e in entries]
    if got != expected_ids:
        raise RuntimeError(f"prompt logprobs do not line up with the choice tokens: got ids {got}, "
                           f"expected {expected_ids}")


def _common_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _sample(scores: list[float], temperature: float) -> int:
    top = max(scores)
    if top == -math.inf:
        return 0
    weights = [math.exp((s - top) / temperature) for s in scores]
    return random.choices(range(len(scores)), weights=weights)[0]
