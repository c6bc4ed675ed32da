"""Tokenizer loading, chat templates and incremental detokenization against the built-in tiny tokenizer."""

from __future__ import annotations

import os
import random
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstrata.model.builtin import resolve_model_path
from kvstrata.model.tokenizer import (
    ChatTemplateError,
    IncrementalDetokenizer,
    TokenizerLoadError,
    apply_chat_template,
    load_tokenizer,
)

TEXTS = [
    "Hello, world! The cache keeps hot pages close.",
    "你好，世界。今天天气很好，我们去公园散步吧。",
    "Emoji: 😀😂👍🎉🚀 ❤️ 🌍 — family 👨‍👩‍👧‍👦, flag 🇵🇹",
    "Mixed: naïve café Привет こんにちは 안녕하세요 مرحبا\n\tcode = {'k': [1, 2]}  \n",
    "   leading and trailing spaces   ",
]


@pytest.fixture(scope="session")
def model_cache_dir(tmp_path_factory) -> str:
    # Same folder as in test_builtin.py, so each built-in is built once per test session.
    return str(tmp_path_factory.getbasetemp() / "kvstrata-model-cache")


@pytest.fixture(scope="module")
def tiny_dir(model_cache_dir) -> str:
    return resolve_model_path("tiny", model_cache_dir)


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return load_tokenizer(tiny_dir)


def stream(tokenizer, ids: list[int], chunk_sizes: list[int] | None = None, **kwargs) -> tuple[list[str], str]:
    """Feed ids to an IncrementalDetokenizer in chunks; return the add() deltas and the flushed rest."""
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    deltas, i, sizes = [], 0, iter(chunk_sizes or [])
    while i < len(ids):
        n = next(sizes, 1)
        deltas.append(detok.add(ids[i:i + n]))
        i += n
    rest = detok.flush()
    assert detok.text == "".join(deltas) + rest
    return deltas, rest


def test_load_tokenizer_from_folder_and_builtin_name(tok, tiny_dir, monkeypatch, model_cache_dir):
    assert tok.eos_token == "<|im_end|>"
    assert len(tok) == 1024
    monkeypatch.setenv("KVSTRATA_CACHE_DIR", model_cache_dir)
    assert load_tokenizer("tiny").encode("cache") == tok.encode("cache")


def test_missing_folder_is_a_clear_error(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(TokenizerLoadError, match="no-such-model"):
        load_tokenizer(missing)


def test_folder_without_tokenizer_files(tmp_path, tiny_dir):
    shutil.copy(os.path.join(tiny_dir, "config.json"), tmp_path)
    with pytest.raises(TokenizerLoadError, match=f"no tokenizer files .* in '{tmp_path}'"):
        load_tokenizer(str(tmp_path))


def test_corrupt_tokenizer_files(tmp_path, tiny_dir):
    for name in ("config.json", "tokenizer_config.json", "tokenizer.json"):
        shutil.copy(os.path.join(tiny_dir, name), tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": [')
    with pytest.raises(TokenizerLoadError, match=str(tmp_path)):
        load_tokenizer(str(tmp_path))


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_valid_text_never_emits_half_characters(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    deltas, rest = stream(tok, ids)
    assert "".join(deltas) == text and rest == ""
    assert all("\ufffd" not in d for d in deltas)
    # Multi-byte characters are split across tokens here, so some steps must have held text back.
    if len(text.encode("utf-8")) > len(text) + 10:
        assert "" in deltas


def test_streaming_in_random_chunks_with_prompt_context(tok):
    rng = random.Random(3)
    prompt = tok.encode("User asks: 😀", add_special_tokens=False)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        sizes = [rng.randint(1, 4) for _ in ids]
        deltas, rest = stream(tok, ids, sizes, prompt_ids=prompt)
        assert "".join(deltas) + rest == tok.decode(ids) == text


def test_prompt_ending_inside_a_character(tok):
    ids = tok.encode("前后", add_special_tokens=False)
    assert len(ids) >= 3  # split below the character level by the small vocabulary
    prompt, output = ids[:1], ids[1:]
    deltas, rest = stream(tok, output, prompt_ids=prompt)
    assert "".join(deltas) + rest == tok.decode(output)


def test_skip_special_tokens(tok):
    ids = tok.encode("Hi there", add_special_tokens=False) + tok.convert_tokens_to_ids(
        ["<|im_end|>", "<|im_start|>"]) + tok.encode("again 你好", add_special_tokens=False)
    deltas, rest = stream(tok, ids, skip_special_tokens=True)
    assert "".join(deltas) + rest == tok.decode(ids, skip_special_tokens=True) == "Hi thereagain 你好"
    deltas, rest = stream(tok, ids, skip_special_tokens=False)
    text = "".join(deltas) + rest
    assert text == tok.decode(ids, skip_special_tokens=False) == "Hi there<|im_end|><|im_start|>again 你好"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, 1023), max_size=40), sizes=st.lists(st.integers(1, 5), max_size=40),
       skip=st.booleans())
def test_streaming_equals_full_decode_for_any_ids(tok, ids, sizes, skip):
    # Random ids include lone UTF-8 lead and continuation bytes: invalid text must stream identically too.
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    pos, sizes_iter = 0, iter(sizes)
    while pos < len(ids):
        n = next(sizes_iter, 1)
        delta = detok.add(ids[pos:pos + n])
        pos += n
        assert not delta.endswith("\ufffd")  # held back until the character completes (or flush)
        assert tok.decode(ids[:pos], skip_special_tokens=skip).startswith(detok.text)
    detok.flush()
    assert detok.text == tok.decode(ids, skip_special_tokens=skip)


class _CountingTokenizer:
    """The real tokenizer, with the length of every decode recorded."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decoded_lengths: list[int] = []

    def decode(self, ids, **kwargs):
        self.decoded_lengths.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def test_streaming_decodes_a_bounded_window(tok):
    text = " ".join(TEXTS) * 20
    ids = tok.encode(text, add_special_tokens=False)
    counting = _CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting, prompt_ids=ids[:50])
    for i in ids:
        detok.add([i])
    assert detok.text == text
    assert len(ids) > 1000
    assert max(counting.decoded_lengths) <= 16
    assert len(counting.decoded_lengths) <= 2 * len(ids) + 2


def test_chat_template_chatml(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]
    assert apply_chat_template(tok, messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n")
    assert apply_chat_template(tok, messages[:2], add_generation_prompt=False).endswith("2+2?<|im_end|>\n")
    assert apply_chat_template(tok, messages[:3], continue_final_message=True).endswith(
        "<|im_start|>assistant\n4")


def test_chat_template_flattens_text_parts(tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " you"}]}]
    assert apply_chat_template(tok, parts) == apply_chat_template(tok, [{"role": "user", "content": "Hello you"}])
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]
    with pytest.raises(ChatTemplateError, match="image_url"):
        apply_chat_template(tok, image)


def test_chat_template_tools(tok):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "b", "content": "rain"},
    ]
    prompt = apply_chat_template(tok, messages, tools=tools)
    assert prompt.startswith("<|im_start|>system\n# Tools\n")
    assert '"name": "get_weather"' in prompt.split("\n</tools>")[0]
    assert ("<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
            "</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n"
            "</tool_call><|im_end|>\n") in prompt
    assert prompt.endswith("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n"
                           "</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_tokenizer_without_chat_template(tiny_dir):
    tokenizer = load_tokenizer(tiny_dir)  # a private copy: the module's tokenizer stays untouched
    tokenizer.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        apply_chat_template(tokenizer, [{"role": "user", "content": "hi"}])
