"""Write tiny random-weight Hugging Face checkpoints with `transformers` (the numerical reference)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

# Tiny shapes that still exercise GQA (4 query heads over 2 KV heads) and each family's switches.
_BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, rms_norm_eps=1e-6,
             bos_token_id=1, eos_token_id=2)

# name -> (config class, model class, config overrides, save kwargs)
CASES: dict[str, tuple[str, str, dict, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
        rope_theta=500000.0), {}),
    "llama_linear_tied": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_scaling={"type": "linear", "factor": 2.0}, tie_word_embeddings=True, head_dim=32), {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None), {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(eos_token_id=[2, 3]), {}),
    "qwen3_sharded": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True),
                      {"max_shard_size": "40KB"}),
}
# Mixture-of-experts: 8 experts, top 2; a dense layer among the sparse ones (mlp_only_layers, or
# decoder_sparse_step 2: layer 0 dense), Qwen2-MoE's shared expert and unnormalized top-k weights. Kept apart
# from CASES: in bf16 a router's k-th choice can flip on a rounding difference (transformers' own bf16 run
# differs from its float32 one that way), so the bf16 comparisons of these live in tests/model/test_moe.py.
MOE_CASES: dict[str, tuple[str, str, dict, dict]] = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_hidden_layers=3, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        mlp_only_layers=[1]), {}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, shared_expert_intermediate_size=48,
        decoder_sparse_step=2), {}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=8, num_experts_per_tok=2,
                                                            sliding_window=None), {}),
}
# Router weights of this scale give peaked routing probabilities (top-k weights that differ clearly).
ROUTER_STD = 0.5


def make_hf_model(case: str, seed: int = 0) -> torch.nn.Module:
    """A float32 transformers model for `case` with random weights of a scale that gives peaked logits."""
    config_cls, model_cls, overrides, _ = {**CASES, **MOE_CASES}[case]
    config = getattr(transformers, config_cls)(**{**_BASE, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    # transformers initialises biases to 0 and norms to 1; randomise everything so that every tensor the
    # loader maps (biases, q/k norms) changes the output if it lands in the wrong place.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("mlp.gate.weight"):
                param.copy_(ROUTER_STD * torch.randn_like(param))
            else:
                param.copy_(0.05 * torch.randn_like(param))
    return model


def write_checkpoint(case: str, folder: str, seed: int = 0) -> str:
    """Save the model of `case` as safetensors into `folder` (sharded for the *_sharded cases)."""
    _, _, _, save_kwargs = {**CASES, **MOE_CASES}[case]
    make_hf_model(case, seed).save_pretrained(folder, safe_serialization=True, **save_kwargs)
    return folder


def write_servable_moe_checkpoint(folder: str) -> str:
    """A tiny Qwen3-MoE (8 experts, top 2, both layers sparse) that an Engine can serve: the built-in tiny
    model's tokenizer and vocabulary, weights of the tiny model's scales (outputs depend on the context)."""
    import json
    import os
    import shutil

    from kvstrata.model.builtin import resolve_model_path

    tiny = resolve_model_path("tiny")
    with open(os.path.join(tiny, "config.json"), encoding="utf-8") as fh:
        ids = {k: v for k, v in json.load(fh).items() if k.endswith("_token_id")}
    config = transformers.Qwen3MoeConfig(
        vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, moe_intermediate_size=64,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False, **ids)
    torch.manual_seed(7)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            elif name.endswith("mlp.gate.weight"):
                param.copy_(ROUTER_STD * torch.randn_like(param))
            elif name.endswith(("o_proj.weight", "down_proj")):
                param.copy_(0.3 * torch.randn_like(param))
            else:
                param.copy_(0.1 * torch.randn_like(param))
    model.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copy(os.path.join(tiny, name), os.path.join(folder, name))
    return folder


def edit_checkpoint(folder, put: dict | None = None, drop: tuple[str, ...] = ()) -> None:
    """Rewrite `folder`'s model.safetensors with tensors replaced or added (`put`) and removed (`drop`)."""
    from safetensors.torch import load_file, save_file

    file = Path(folder) / "model.safetensors"
    tensors = load_file(file)
    for name in drop:
        del tensors[name]
    tensors.update(put or {})
    save_file(tensors, file)
