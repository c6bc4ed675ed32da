"""Built-in models: complete HF folders, loadable by transformers, deterministic, cached safely."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import kvstrata
from kvstrata.model.builtin import BUILD_VERSION, BUILTIN_MODELS, build_builtin, resolve_model_path

REPO_ROOT = str(Path(kvstrata.__file__).resolve().parent.parent)
CHECKPOINT_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                    "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="session")
def model_cache_dir(tmp_path_factory) -> str:
    # Same folder as in test_tokenizer.py, so each built-in is built once per test session.
    return str(tmp_path_factory.getbasetemp() / "kvstrata-model-cache")


@pytest.fixture(scope="module")
def tiny_dir(model_cache_dir) -> str:
    return resolve_model_path("tiny", model_cache_dir)


@pytest.fixture(scope="module")
def tiny_hf(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    return model.eval(), tokenizer


def _read_json(folder: str, name: str) -> dict:
    with open(os.path.join(folder, name), encoding="utf-8") as fh:
        return json.load(fh)


def test_other_names_pass_through(tmp_path):
    assert BUILTIN_MODELS == ("tiny", "bench", "bench-32k", "bench-moe")
    for value in ("/models/Llama-3-8B", "./tiny", "Tiny", "Qwen/Qwen3-0.6B"):
        assert resolve_model_path(value, str(tmp_path)) == value
    assert not (tmp_path / "models").exists()


def test_unknown_builtin_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown built-in"):
        build_builtin("huge", str(tmp_path))


def test_tiny_folder_is_a_complete_checkpoint(tiny_dir, model_cache_dir):
    assert tiny_dir == os.path.join(model_cache_dir, "models", f"tiny-{BUILD_VERSION}")
    for name in CHECKPOINT_FILES:
        assert os.path.isfile(os.path.join(tiny_dir, name)), name
    config = _read_json(tiny_dir, "config.json")
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    expected = {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096,
                "rope_theta": 1_000_000.0, "tie_word_embeddings": True, "attention_bias": False,
                "torch_dtype": "float32"}
    assert {k: config[k] for k in expected} == expected
    tok_config = _read_json(tiny_dir, "tokenizer_config.json")
    assert tok_config["eos_token"] == "<|im_end|>" and tok_config["pad_token"] == "<|endoftext|>"
    assert "<|im_start|>" in tok_config["chat_template"]
    assert _read_json(tiny_dir, "special_tokens_map.json")["eos_token"] == "<|im_end|>"


def test_tiny_weights_have_hf_names(tiny_dir):
    with safe_open(os.path.join(tiny_dir, "model.safetensors"), "pt") as f:
        names = set(f.keys())
        dtypes = {f.get_tensor(n).dtype for n in names}
        embed = f.get_tensor("model.embed_tokens.weight")
    per_layer = ["input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                 "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    expected = {f"model.layers.{i}.{p}.weight" for i in range(2) for p in per_layer}
    expected |= {"model.embed_tokens.weight", "model.norm.weight"}  # tied: no lm_head.weight
    assert names == expected
    assert dtypes == {torch.float32}
    assert embed.shape == (1024, 128)


def test_tiny_tokenizer_and_eos_ids(tiny_dir, tiny_hf):
    _, tokenizer = tiny_hf
    assert len(tokenizer) == _read_json(tiny_dir, "config.json")["vocab_size"] == 1024
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert _read_json(tiny_dir, "generation_config.json")["eos_token_id"] == [im_end, endoftext]
    assert tokenizer.eos_token_id == im_end
    text = "The cache keeps pages close: 你好 😀"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode("utf-8"))  # trained merges, not one token per byte


def test_tiny_chat_template_renders_chatml(tiny_hf):
    _, tokenizer = tiny_hf
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
                      "<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_tiny_generates_varied_context_dependent_text(tiny_hf, tiny_dir):
    model, tokenizer = tiny_hf
    eos = set(_read_json(tiny_dir, "generation_config.json")["eos_token_id"])
    rng = random.Random(7)

    def greedy(ids: list[int], n: int) -> list[int]:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        return out[0, len(ids):].tolist()

    outputs = [greedy([rng.randrange(3, 1024) for _ in range(rng.randrange(3, 30))], 16) for _ in range(20)]
    assert len({tuple(o) for o in outputs}) >= 18
    assert sum(o[0] in eos for o in outputs) <= 3
    assert sum(len(set(o)) for o in outputs) / len(outputs) >= 8  # not one token repeated
    # The continuation depends on more than the last tokens: prefix caching bugs must show up.
    tail = [rng.randrange(3, 1024) for _ in range(3)]
    continuations = {tuple(greedy([rng.randrange(3, 1024) for _ in range(10)] + tail, 6)) for _ in range(6)}
    assert len(continuations) >= 4


def test_tiny_build_is_byte_identical(tiny_dir, tmp_path):
    build_builtin("tiny", str(tmp_path))
    for name in CHECKPOINT_FILES:
        assert (tmp_path / name).read_bytes() == Path(tiny_dir, name).read_bytes(), name


def test_resolve_reuses_the_cached_folder(tiny_dir, model_cache_dir):
    before = os.stat(os.path.join(tiny_dir, "model.safetensors"))
    start = time.perf_counter()
    assert resolve_model_path("tiny", model_cache_dir) == tiny_dir
    assert time.perf_counter() - start < 0.05  # no rebuild
    after = os.stat(os.path.join(tiny_dir, "model.safetensors"))
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert os.listdir(os.path.join(model_cache_dir, "models")).count(f"tiny-{BUILD_VERSION}") == 1


def test_default_cache_dir_comes_from_environment(monkeypatch, model_cache_dir, tiny_dir):
    monkeypatch.setenv("KVSTRATA_CACHE_DIR", model_cache_dir)
    assert resolve_model_path("tiny") == tiny_dir


def test_concurrent_threads_resolve_to_one_folder(tmp_path):
    barrier = threading.Barrier(3)
    results: list[str] = []

    def resolve() -> None:
        barrier.wait()
        results.append(resolve_model_path("tiny", str(tmp_path)))

    threads = [threading.Thread(target=resolve) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 3 and len(set(results)) == 1
    # Losers discarded their staging folders; the winner's folder is complete.
    assert os.listdir(tmp_path / "models") == [f"tiny-{BUILD_VERSION}"]
    for name in CHECKPOINT_FILES:
        assert os.path.isfile(os.path.join(results[0], name))


_RACER = """
import os, sys, time
import torch  # imported before the barrier so that both processes reach the build together
from kvstrata.model.builtin import resolve_model_path
cache_dir, ready, go = sys.argv[1:4]
open(ready, "w").close()
deadline = time.time() + 120
while not os.path.exists(go) and time.time() < deadline:
    time.sleep(0.005)
print(resolve_model_path("tiny", cache_dir))
"""


def test_concurrent_processes_resolve_to_identical_folder(tmp_path, tiny_dir):
    cache_dir, go = tmp_path / "cache", tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "OMP_NUM_THREADS": "1"}
    procs = []
    try:
        for i in range(2):
            # Different hash seeds: the build must not depend on dict/set ordering.
            procs.append(subprocess.Popen(
                [sys.executable, "-c", _RACER, str(cache_dir), str(tmp_path / f"ready{i}"), str(go)],
                env={**env, "PYTHONHASHSEED": str(100 + i)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True))
        deadline = time.time() + 120
        while not all((tmp_path / f"ready{i}").exists() for i in range(2)) and time.time() < deadline:
            time.sleep(0.01)
        go.touch()
        outputs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outputs]
    folder = cache_dir / "models" / f"tiny-{BUILD_VERSION}"
    assert {out.strip() for out, _ in outputs} == {str(folder)}
    assert os.listdir(cache_dir / "models") == [folder.name]
    # Built in other processes, with other hash seeds: still byte-identical to this session's build.
    for name in CHECKPOINT_FILES:
        assert (folder / name).read_bytes() == Path(tiny_dir, name).read_bytes(), name


def test_bench_model(model_cache_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    folder = resolve_model_path("bench", model_cache_dir)
    build_s = time.perf_counter() - start
    assert build_s < 180, f"bench took {build_s:.0f} s to build"
    config = _read_json(folder, "config.json")
    expected = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
                "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
                "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
                "max_position_embeddings": 8192, "rope_theta": 500000.0, "tie_word_embeddings": False,
                "torch_dtype": "bfloat16"}
    assert {k: config[k] for k in expected} == expected
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        assert "lm_head.weight" in f.keys()
        assert {f.get_slice(n).get_dtype() for n in f.keys()} == {"BF16"}

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert len(tokenizer) == 32000
    assert tokenizer.backend_tokenizer.get_vocab_size(with_added_tokens=True) == 32000
    ids = tokenizer.encode("Hello, world! 你好")
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|begin_of_text|>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Hello, world! 你好"
    eot, eos = tokenizer.convert_tokens_to_ids(["<|eot_id|>", "<|end_of_text|>"])
    assert tokenizer.eos_token_id == eot
    assert {eot, eos} <= set(_read_json(folder, "generation_config.json")["eos_token_id"])
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                      "<|start_header_id|>assistant<|end_header_id|>\n\n")

    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype="auto").eval()
    assert model.dtype == torch.bfloat16
    assert not model.config.tie_word_embeddings
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 32000) and torch.isfinite(logits).all()
    assert logits[0, -1].float().std() > 0.1
