"""Write tiny random-weight Hugging Face checkpoints with `transformers` (the numerical reference)."""

from __future__ import annotations

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


def make_hf_model(case: str, seed: int = 0) -> torch.nn.Module:
    """A float32 transformers model for `case` with random weights of a scale that gives peaked logits."""
    config_cls, model_cls, overrides, _ = CASES[case]
    config = getattr(transformers, config_cls)(**{**_BASE, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    # transformers initialises biases to 0 and norms to 1; randomise everything so that every tensor the
    # loader maps (biases, q/k norms) changes the output if it lands in the wrong place.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.05 * torch.randn_like(param))
    return model


def write_checkpoint(case: str, folder: str, seed: int = 0) -> str:
    """Save the model of `case` as safetensors into `folder` (sharded for the *_sharded cases)."""
    _, _, _, save_kwargs = CASES[case]
    make_hf_model(case, seed).save_pretrained(folder, safe_serialization=True, **save_kwargs)
    return folder
