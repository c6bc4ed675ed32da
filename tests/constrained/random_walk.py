"""A "random model" decoding loop: random logits, grammar mask applied, sample until the grammar ends."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstrata.constrained import Grammar, GrammarBackend
from kvstrata.constrained.bitmask import unpack_bitmask

# Bias toward tokens that close things and away from whitespace-only tokens (JSON allows whitespace
# between any two elements, and this tokenizer has many indentation tokens), so that random walks end
# in a few dozen tokens. The bias only shifts probabilities: the grammar decides what is allowed.
CLOSING_CHARS = set('"}])@')
CLOSING_BIAS = 2.5
WHITESPACE_BIAS = -2.5
EOS_PROBABILITY = 0.5


@dataclass
class Walk:
    """The outcome of one random decode."""

    token_ids: list[int]
    text: str
    terminated: bool


def closing_bias(tokenizer, vocab_size: int) -> torch.Tensor:
    """Per-token logit bias favouring closing characters and disfavouring whitespace-only tokens."""
    bias = torch.zeros(vocab_size)
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        if CLOSING_CHARS & set(text):
            bias[token_id] = CLOSING_BIAS
        elif text and text.isspace():
            bias[token_id] = WHITESPACE_BIAS
    return bias


def random_walk(backend: GrammarBackend, grammar: Grammar, tokenizer, bias: torch.Tensor, seed: int,
                max_tokens: int = 200) -> Walk:
    """Sample allowed tokens from random logits until the grammar terminates or `max_tokens`."""
    generator = torch.Generator().manual_seed(seed)
    bitmask = backend.allocate_bitmask(1)
    eos_ids = backend.eos_token_ids
    tokens: list[int] = []
    for _ in range(max_tokens):
        grammar.fill_bitmask(bitmask, 0)
        allowed = unpack_bitmask(bitmask, backend.vocab_size)[0]
        assert not allowed[len(tokenizer):].any(), "padding ids beyond the tokenizer must be masked"
        eos_allowed = [t for t in eos_ids if allowed[t]]
        if eos_allowed and torch.rand((), generator=generator).item() < EOS_PROBABILITY:
            token = eos_allowed[0]
        else:
            logits = torch.randn(1, backend.vocab_size, generator=generator) + bias
            backend.apply_bitmask(logits, bitmask, torch.tensor([0]))
            token = int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=generator))
        assert allowed[token], "sampled a masked token"
        assert grammar.accept_token(token), f"grammar rejected token {token} that its mask allowed"
        if grammar.is_terminated():
            break
        tokens.append(token)
    return Walk(tokens, tokenizer.decode(tokens), grammar.is_terminated())


def run_walks(backend: GrammarBackend, kind: str, text: str, tokenizer, bias: torch.Tensor,
              num_walks: int, seed: int = 0) -> list[Walk]:
    """`num_walks` random decodes of one constraint (one compile, fresh matcher per walk)."""
    grammar = backend.compile(kind, text)
    walks = []
    for i in range(num_walks):
        walks.append(random_walk(backend, grammar.copy(), tokenizer, bias, seed=seed * 1000 + i))
    return walks
