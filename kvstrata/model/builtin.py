"""Built-in models ('tiny', 'bench', 'bench-32k', 'bench-moe'): complete HF checkpoint folders with random
weights, made on first use."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional

from kvstrata.model.builtin_tokenizer import TokenizerSpec, build_tokenizer
from kvstrata.model.chat_templates import CHATML_TEMPLATE, LLAMA3_TEMPLATE
from kvstrata.platform import cache_dir

if TYPE_CHECKING:
    import torch

BUILTIN_MODELS = ("tiny", "bench", "bench-32k", "bench-moe")
# Bump when anything that changes the built files changes, so that stale caches are not reused.
BUILD_VERSION = "v1"
_STAGING_MARK = "-building-"


@dataclass(frozen=True)
class BuiltinSpec:
    """Shape, dtype and tokenizer of one built-in model."""

    architecture: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float
    tie_word_embeddings: bool
    qk_norm: bool
    dtype: str  # "float32" or "bfloat16"
    seed: int
    init_std: tuple[float, float, float, float]  # embeddings, input projections, output projections, lm_head
    tokenizer: TokenizerSpec
    rms_norm_eps: float = 1e-6
    # Mixture of experts (Qwen3-MoE): every layer's MLP is `num_experts` experts of `moe_intermediate_size`,
    # `top_k` per token (renormalized); 0 experts: a dense model.
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    rope_scaling: Optional[dict] = None   # HF config's rope_scaling (None: plain RoPE)

    @property
    def vocab_size(self) -> int:
        """Vocabulary size of the model (equal to the tokenizer's)."""
        return self.tokenizer.vocab_size


_TINY = BuiltinSpec(
    architecture="Qwen3ForCausalLM", model_type="qwen3", hidden_size=128, intermediate_size=384,
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=4096,
    rope_theta=1_000_000.0, tie_word_embeddings=True, qk_norm=True, dtype="float32", seed=1234,
    # With tied embeddings and small layer outputs the residual stream is mostly the input token's own
    # embedding and greedy decoding just repeats the last token. Layer outputs several times larger than
    # the embeddings make the next token depend on the whole context (what cache tests need), and an
    # embedding std of 0.1 gives logits of std ~1, so top-1 margins stay well above float noise.
    init_std=(0.1, 0.1, 0.3, 0.1),
    tokenizer=TokenizerSpec(
        vocab_size=1024,
        special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        eos_token="<|im_end|>", stop_tokens=("<|im_end|>", "<|endoftext|>"),
        pad_token="<|endoftext|>", bos_token=None, chat_template=CHATML_TEMPLATE,
    ),
)

_LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                    "<|eot_id|>", "<|eom_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>")

_BENCH = BuiltinSpec(
    architecture="LlamaForCausalLM", model_type="llama", hidden_size=512, intermediate_size=1536,
    num_layers=8, num_heads=8, num_kv_heads=2, head_dim=64, max_position_embeddings=8192,
    rope_theta=500_000.0, tie_word_embeddings=False, qk_norm=False, dtype="bfloat16", seed=4321,
    init_std=(0.1, 0.05, 0.2, 0.05),
    tokenizer=TokenizerSpec(
        vocab_size=32000, special_tokens=_LLAMA3_SPECIALS,
        eos_token="<|eot_id|>", stop_tokens=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
        pad_token="<|finetune_right_pad_id|>", bos_token="<|begin_of_text|>", chat_template=LLAMA3_TEMPLATE,
        # The shipped corpus alone yields a few thousand merges; seeded pseudo-words fill the rest of the
        # 32000 (no padding tokens needed). Repeating the corpus keeps English words as whole tokens.
        pseudo_text_chars=2_000_000, corpus_repeats=20, seed=4321,
    ),
)

# The bench model with a 32k context, for multi-turn runs whose last round outgrows 8k (the seed's 20k-token
# conversations): Llama 3.1's RoPE scaling (original 8k context, factor 4), the scaling that keeps RoPE valid
# at 4x the length it was set for. Same weights as 'bench' (same shapes and seed).
_BENCH_32K = replace(_BENCH, max_position_embeddings=32768, rope_scaling={
    "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192})

# The shape `../shared/peers/make_model.py --arch qwen3_moe` writes for the peers (its config, field by field):
# the bench model's attention and active MLP width per token (4 x 384 = 1536), 32 experts; ~190M parameters,
# ~60M active (embedding included).
_BENCH_MOE = BuiltinSpec(
    architecture="Qwen3MoeForCausalLM", model_type="qwen3_moe", hidden_size=512, intermediate_size=1536,
    num_layers=8, num_heads=8, num_kv_heads=2, head_dim=64, max_position_embeddings=4096,
    rope_theta=10_000.0, tie_word_embeddings=False, qk_norm=True, dtype="bfloat16", seed=4322,
    init_std=(0.1, 0.05, 0.2, 0.05), tokenizer=_BENCH.tokenizer, rms_norm_eps=1e-5,
    num_experts=32, top_k=4, moe_intermediate_size=384,
)

BUILTIN_SPECS = {"tiny": _TINY, "bench": _BENCH, "bench-32k": _BENCH_32K, "bench-moe": _BENCH_MOE}


def default_cache_dir() -> str:
    """$KVSTRATA_CACHE_DIR, else ~/.cache/kvstrata."""
    return str(cache_dir())


def resolve_model_path(name_or_path: str, cache_dir: str | None = None) -> str:
    """Folder of a model: built-in names are built once under the cache dir; other strings pass through.

    Safe when several processes resolve the same built-in at once: each builds in its own temporary
    folder and renames it into place; whoever loses the race discards its copy and uses the winner's.
    """
    models_dir = _models_dir(cache_dir)
    from kvstrata.model.gguf import gguf_model_folder, is_gguf

    if is_gguf(name_or_path):
        return gguf_model_folder(name_or_path, models_dir)
    if name_or_path not in BUILTIN_MODELS:
        return name_or_path
    return build_once(_builtin_folder(name_or_path, models_dir), lambda out_dir: build_builtin(name_or_path, out_dir))


def is_model_folder_ready(name_or_path: str, cache_dir: str | None = None) -> bool:
    """False when resolve_model_path would first build the folder (a built-in) or convert it (a GGUF file)."""
    models_dir = _models_dir(cache_dir)
    from kvstrata.model.gguf import gguf_folder, is_gguf

    if is_gguf(name_or_path):
        return os.path.isdir(gguf_folder(name_or_path, models_dir))
    return name_or_path not in BUILTIN_MODELS or os.path.isdir(_builtin_folder(name_or_path, models_dir))


def _models_dir(cache_dir: str | None) -> str:
    return os.path.join(cache_dir or default_cache_dir(), "models")


def _builtin_folder(name: str, models_dir: str) -> str:
    return os.path.join(models_dir, f"{name}-{BUILD_VERSION}")


def build_once(target: str, build: Callable[[str], None]) -> str:
    """`target`, made by `build(staging_dir)` unless it exists; the staging folder is renamed into place,
    so a process that loses a race discards its copy and uses the winner's."""
    if os.path.isdir(target):
        return target
    models_dir, name = os.path.split(target)
    os.makedirs(models_dir, exist_ok=True)
    _remove_stale_staging(models_dir)
    staging = tempfile.mkdtemp(prefix=f".{name}{_STAGING_MARK}", dir=models_dir)
    try:
        build(staging)
        os.chmod(staging, 0o755)  # mkdtemp makes it private; a model cache is ordinary readable data
        try:
            os.rename(staging, target)
        except OSError:
            if not os.path.isdir(target):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _remove_stale_staging(models_dir: str) -> None:
    # Staging folders of builds that were killed midway; an hour is far longer than any build.
    cutoff = time.time() - 3600
    for entry in os.scandir(models_dir):
        try:
            stale = _STAGING_MARK in entry.name and entry.stat().st_mtime < cutoff
        except OSError:  # removed meanwhile by the process that owned it
            continue
        if stale:
            shutil.rmtree(entry.path, ignore_errors=True)


def build_builtin(name: str, out_dir: str) -> None:
    """Write the complete HF checkpoint folder of built-in model `name` into `out_dir` (deterministic)."""
    if name not in BUILTIN_SPECS:
        raise ValueError(f"unknown built-in model {name!r}; choose one of {', '.join(BUILTIN_MODELS)}")
    spec = BUILTIN_SPECS[name]
    os.makedirs(out_dir, exist_ok=True)
    special_ids = build_tokenizer(spec.tokenizer, out_dir, spec.max_position_embeddings)
    _write_configs(spec, special_ids, out_dir)
    _write_weights(spec, out_dir)
    for file_name in os.listdir(out_dir):
        os.chmod(os.path.join(out_dir, file_name), 0o644)  # safetensors writes its file private (0600)


def _write_configs(spec: BuiltinSpec, special_ids: dict[str, int], out_dir: str) -> None:
    tok = spec.tokenizer
    eos_ids = [special_ids[t] for t in tok.stop_tokens]
    # Without a bos token (Qwen style) the model config names <|endoftext|>, as Qwen's configs do.
    bos_id = special_ids[tok.bos_token] if tok.bos_token else special_ids[tok.pad_token]
    config = {
        "architectures": [spec.architecture],
        "model_type": spec.model_type,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": dict(spec.rope_scaling) if spec.rope_scaling else None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "initializer_range": 0.02,
        "bos_token_id": bos_id,
        "eos_token_id": eos_ids if len(eos_ids) > 1 else eos_ids[0],
        "pad_token_id": special_ids[tok.pad_token],
        "torch_dtype": spec.dtype,
        "use_cache": True,
    }
    if spec.model_type in ("qwen3", "qwen3_moe"):
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=spec.num_layers)
    if spec.num_experts:
        config.update(num_experts=spec.num_experts, num_experts_per_tok=spec.top_k, norm_topk_prob=True,
                      moe_intermediate_size=spec.moe_intermediate_size, decoder_sparse_step=1, mlp_only_layers=[])
    generation = {"bos_token_id": bos_id, "eos_token_id": eos_ids, "pad_token_id": special_ids[tok.pad_token]}
    _write_json(os.path.join(out_dir, "config.json"), config)
    _write_json(os.path.join(out_dir, "generation_config.json"), generation)


def _write_weights(spec: BuiltinSpec, out_dir: str) -> None:
    import torch
    from safetensors.torch import save_file

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec.dtype]
    tensors = {name: t.to(dtype).contiguous() for name, t in random_weights(spec).items()}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


def random_weights(spec: BuiltinSpec) -> dict[str, torch.Tensor]:
    """float32 weights with HF names, drawn in a fixed order from one seeded generator; norms are ones.

    Values are uniform with the spec's standard deviations, made from PCG64 integers by exact IEEE
    arithmetic: unlike torch.randn (vectorized Box-Muller, CPU-dependent rounding) they are bit-identical
    on every machine, so every process that builds 'tiny-v1' gets the same model (L3 keys rely on it).
    """
    import numpy as np
    import torch

    rng = np.random.Generator(np.random.PCG64(spec.seed))
    h, inter, d = spec.hidden_size, spec.intermediate_size, spec.head_dim
    q_out, kv_out = spec.num_heads * d, spec.num_kv_heads * d
    embed_std, in_std, out_std, lm_head_std = spec.init_std

    def uniform(*shape: int, std: float = in_std) -> torch.Tensor:
        half_width = std * 3.0 ** 0.5  # U(-a, a) has std a / sqrt(3)
        values = (rng.random(shape, dtype=np.float64) * 2.0 - 1.0) * half_width
        return torch.from_numpy(values.astype(np.float32))

    weights = {"model.embed_tokens.weight": uniform(spec.vocab_size, h, std=embed_std)}
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}."
        weights[p + "input_layernorm.weight"] = torch.ones(h)
        weights[p + "self_attn.q_proj.weight"] = uniform(q_out, h)
        weights[p + "self_attn.k_proj.weight"] = uniform(kv_out, h)
        weights[p + "self_attn.v_proj.weight"] = uniform(kv_out, h)
        weights[p + "self_attn.o_proj.weight"] = uniform(h, q_out, std=out_std)
        if spec.qk_norm:
            weights[p + "self_attn.q_norm.weight"] = torch.ones(d)
            weights[p + "self_attn.k_norm.weight"] = torch.ones(d)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(h)
        if spec.num_experts:
            weights.update(_expert_weights(p + "mlp.", spec, uniform))
            continue
        weights[p + "mlp.gate_proj.weight"] = uniform(inter, h)
        weights[p + "mlp.up_proj.weight"] = uniform(inter, h)
        weights[p + "mlp.down_proj.weight"] = uniform(h, inter, std=out_std)
    weights["model.norm.weight"] = torch.ones(h)
    if not spec.tie_word_embeddings:
        weights["lm_head.weight"] = uniform(spec.vocab_size, h, std=lm_head_std)
    return weights


def _expert_weights(prefix: str, spec: BuiltinSpec, uniform: Callable) -> dict[str, torch.Tensor]:
    """One MoE layer's router and experts (HF's Qwen3-MoE names), drawn in a fixed order."""
    h, inter, out_std = spec.hidden_size, spec.moe_intermediate_size, spec.init_std[2]
    weights = {prefix + "gate.weight": uniform(spec.num_experts, h)}
    for e in range(spec.num_experts):
        expert = f"{prefix}experts.{e}."
        weights[expert + "gate_proj.weight"] = uniform(inter, h)
        weights[expert + "up_proj.weight"] = uniform(inter, h)
        weights[expert + "down_proj.weight"] = uniform(h, inter, std=out_std)
    return weights


def _write_json(path: str, value: dict) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(value, fh, indent=2)
        fh.write("\n")
