"""xgrammar's vocabulary tables are the same whether the scheduler holds transformers' tokenizer or the
LightTokenizer that stands for it (the built-in tiny tokenizer and the real SmolLM2 one)."""

from __future__ import annotations

import pytest

from kvstrata.constrained.xgrammar_backend import _special_token_ids, tokenizer_info
from kvstrata.model.builtin import resolve_model_path
from kvstrata.model.light_tokenizer import LightTokenizer, fingerprint
from kvstrata.model.tokenizer import load_tokenizer
from tests.capabilities import requires_smollm2

PADDING = 64     # the model's embedding table may be larger than the vocabulary


@pytest.mark.parametrize("model", ["tiny", pytest.param("smollm2", marks=requires_smollm2)])
def test_light_tokenizer_gives_transformers_tables(model, tmp_path_factory):
    cache = None if model == "smollm2" else str(tmp_path_factory.getbasetemp() / "kvstrata-model-cache")
    folder = resolve_model_path(model, cache)
    hf, light = load_tokenizer(folder), LightTokenizer.from_folder(folder)
    assert fingerprint(hf) == fingerprint(light)      # what the scheduler checks before it uses a LightTokenizer
    vocab_size, eos = len(hf) + PADDING, [hf.eos_token_id]
    assert tokenizer_info(light, vocab_size, eos).serialize_json() == tokenizer_info(hf, vocab_size, eos).serialize_json()
    assert _special_token_ids(light, vocab_size, eos) == _special_token_ids(hf, vocab_size, eos)
