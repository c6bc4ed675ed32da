"""The multi-turn workload: one conversation per client, as token ids (synthetic or from ShareGPT).

A conversation is a first prompt and one question per later round. Round r's prompt is the whole history
(every earlier prompt part and output) followed by question r, so each round re-sends the previous round's
prompt and output as its prefix: what a prefix cache can serve.

Prompt sources follow SGLang's `bench_multiturn.py`: by default prompts are ShareGPT conversations (their
first turn, repeated or truncated to the requested length, in shuffled order); `--disable-random-sample`
(or no dataset) gives synthetic prompts of random token ids drawn from the vocabulary minus special tokens.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class Conversation:
    """One client's script: the first prompt and the questions of rounds 1..num_rounds-1."""

    client: int
    first_prompt: list[int]
    questions: list[list[int]]

    @property
    def num_rounds(self) -> int:
        """Requests this conversation sends."""
        return 1 + len(self.questions)


@dataclass(frozen=True)
class TokenSpace:
    """The token ids synthetic prompts may use (the vocabulary minus special tokens)."""

    vocab_size: int
    excluded_ids: frozenset[int]

    def allowed_ids(self) -> list[int]:
        """Every usable id, in order."""
        return [i for i in range(self.vocab_size) if i not in self.excluded_ids]


def token_space_from_tokenizer(tokenizer: Any) -> TokenSpace:
    """Vocabulary size and special ids (including added special tokens) of a Hugging Face tokenizer."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items():
        if getattr(added, "special", False):
            special.add(int(token_id))
    return TokenSpace(vocab_size=len(tokenizer), excluded_ids=frozenset(special))


def synthetic_prompts(count: int, length: int, space: TokenSpace, rng: random.Random) -> list[list[int]]:
    """`count` prompts of `length` random token ids from `space`."""
    ids = space.allowed_ids()
    if not ids:
        raise ValueError("the vocabulary has no non-special token to build synthetic prompts from")
    return [rng.choices(ids, k=length) for _ in range(count)]


def load_sharegpt_texts(path: str) -> list[str]:
    """First human turn of every ShareGPT conversation that has at least two turns."""
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a ShareGPT JSON list of conversations")
    texts = []
    for item in data:
        turns = item.get("conversations", item.get("conversation", [])) if isinstance(item, dict) else []
        if len(turns) >= 2 and isinstance(turns[0], dict) and turns[0].get("value"):
            texts.append(str(turns[0]["value"]))
    if not texts:
        raise ValueError(f"{path}: no conversation with at least two turns")
    return texts


def sharegpt_prompts(texts: list[str], count: int, length: int, tokenizer: Any,
                     rng: random.Random) -> list[list[int]]:
    """`count` prompts of exactly `length` tokens: shuffled ShareGPT turns, repeated or truncated."""
    order = list(texts)
    rng.shuffle(order)
    prompts: list[list[int]] = []
    for text in order:
        if len(prompts) == count:
            break
        ids = tokenizer.encode(text, add_special_tokens=False)
        if ids:
            repeats = -(-length // len(ids))
            prompts.append((ids * repeats)[:length])
    if not prompts:
        raise ValueError("every ShareGPT text tokenized to nothing")
    # Fewer usable texts than prompts needed: reuse them (the ideal hit rate accounts for the sharing).
    unique = len(prompts)
    while len(prompts) < count:
        prompts.append(list(prompts[len(prompts) % unique]))
    return prompts


def build_conversations(num_clients: int, num_rounds: int, request_length: int,
                        sub_question_length: int, make_prompts: Any) -> list[Conversation]:
    """Conversations from `make_prompts(count, length) -> list[list[int]]`.

    `sub_question_length` 0 means `request_length`, as in SGLang.
    """
    if num_clients < 1 or num_rounds < 1:
        raise ValueError("--num-clients and --num-rounds must be at least 1")
    if request_length < 1:
        raise ValueError("--request-length must be at least 1")
    question_length = sub_question_length or request_length
    firsts = make_prompts(num_clients, request_length)
    questions = make_prompts(num_clients * (num_rounds - 1), question_length) if num_rounds > 1 else []
    per = num_rounds - 1
    return [Conversation(client=c, first_prompt=firsts[c], questions=questions[c * per:(c + 1) * per])
            for c in range(num_clients)]


def make_prompt_source(dataset_path: Optional[str], disable_random_sample: bool, tokenizer: Any,
                       space: Optional[TokenSpace], rng: random.Random) -> tuple[str, Any]:
    """(description, make_prompts) for the flags given; ShareGPT needs a tokenizer, synthetic a token space."""
    if dataset_path and not disable_random_sample:
        if tokenizer is None:
            raise ValueError("a ShareGPT dataset needs the model's tokenizer (--model-path)")
        texts = load_sharegpt_texts(dataset_path)
        return (f"ShareGPT ({dataset_path}, {len(texts)} conversations)",
                lambda count, length: sharegpt_prompts(texts, count, length, tokenizer, rng))
    if space is None:
        raise ValueError("synthetic prompts need the vocabulary size (tokenizer or /server_info)")
    return (f"synthetic (random ids from {space.vocab_size - len(space.excluded_ids)} non-special tokens)",
            lambda count, length: synthetic_prompts(count, length, space, rng))


def max_prompt_tokens(request_length: int, sub_question_length: int, output_length: int,
                      num_rounds: int) -> int:
    """Length of the last round's prompt (the longest one)."""
    question_length = sub_question_length or request_length
    return request_length + (num_rounds - 1) * (output_length + question_length)
