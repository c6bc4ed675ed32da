"""Shared fixtures: a small byte-level BPE tokenizer trained here, and one xgrammar backend per session."""

from __future__ import annotations

import json
import os

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from kvstrata.constrained import create_grammar_backend
from tests.constrained.random_walk import closing_bias

EOS = "<|im_end|>"
# A special token that is not eos: grammars must never let it into the output (it is not detokenized).
IM_START = "<|im_start|>"
TOKENIZER_VOCAB = 1000
# The model's embedding table is larger than the tokenizer: the extra ids must never be allowed.
VOCAB_PADDING = 64


def _training_text() -> list[str]:
    """Local text with code, prose and JSON-ish records, so merges include quotes, braces and digits."""
    import argparse
    import email.message
    import json as json_module

    texts = [open(m.__file__, encoding="utf-8").read() for m in (argparse, email.message, json_module)]
    for i in range(300):
        texts.append(json.dumps({"name": f"user{i}", "age": i % 90, "email": f"u{i}@example.com",
                                 "tags": ["red", "blue"][: i % 3], "ok": i % 2 == 0, "score": i / 7,
                                 "date": f"2024-{i % 12 + 1:02d}-{i % 28 + 1:02d}"}))
    return texts


def build_tokenizer(vocab_size: int = TOKENIZER_VOCAB) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (every byte is a token) with eos `<|im_end|>` and `<|im_start|>`."""
    model = Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, IM_START],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    model.train_from_iterator(_training_text(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, eos_token=EOS)
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START]})
    return tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return build_tokenizer()


@pytest.fixture(scope="session")
def model_vocab_size(tokenizer) -> int:
    return len(tokenizer) + VOCAB_PADDING


@pytest.fixture(scope="session")
def backend(tokenizer, model_vocab_size):
    backend = create_grammar_backend("xgrammar", tokenizer, model_vocab_size, [tokenizer.eos_token_id])
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def bias(tokenizer, model_vocab_size):
    """The random model's logit bias toward closing characters (see random_walk)."""
    return closing_bias(tokenizer, model_vocab_size)
