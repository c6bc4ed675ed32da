"""ModelConfig: the parts of a Hugging Face `config.json` (+ `generation_config.json`) that kvstrata uses.

Both config generations are read: transformers 4.x (`rope_theta`, `rope_scaling`, `torch_dtype`) and 5.x
(`rope_parameters` holding `rope_theta`, `dtype`). Everything is resolved once into a frozen object.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# Used when `architectures` is absent from config.json.
_MODEL_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                       "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_REQUIRED_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "vocab_size", "max_position_embeddings")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ModelLoadError(Exception):
    """A model folder that cannot be loaded; the message names the file, field or tensor at fault."""


@dataclass(frozen=True)
class ModelConfig:
    """Resolved architecture hyper-parameters of one checkpoint."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict]          # None for plain RoPE; else has "rope_type" ("linear" | "llama3")
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool                  # bias on q/k/v (and on o_proj for Llama-style attention_bias)
    qk_norm: bool                         # Qwen3: RMSNorm over head_dim on q and k before RoPE
    eos_token_ids: tuple[int, ...]
    torch_dtype: Optional[str]

    @property
    def o_proj_bias(self) -> bool:
        """Llama/Qwen3 put `attention_bias` on o_proj too; Qwen2 has bias on q/k/v only."""
        return self.attention_bias and self.architecture != "Qwen2ForCausalLM"

    @staticmethod
    def from_path(path: str) -> ModelConfig:
        """Read `config.json` (and `generation_config.json` if present) of a checkpoint folder."""
        if not os.path.isdir(path):
            raise ModelLoadError(f"model path {path!r} is not a directory")
        raw = _read_json(os.path.join(path, "config.json"), required=True)
        gen = _read_json(os.path.join(path, "generation_config.json"), required=False) or {}
        return ModelConfig.from_dict(raw, gen, source=os.path.join(path, "config.json"))

    @staticmethod
    def from_dict(raw: dict, generation_config: Optional[dict] = None, source: str = "config") -> ModelConfig:
        """Resolve a parsed config.json dict (plus optional generation_config.json dict)."""
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{source}: expected a JSON object")
        arch = _architecture(raw, source)
        missing = [f for f in _REQUIRED_FIELDS if raw.get(f) is None]
        if missing:
            raise ModelLoadError(f"{source}: missing required field(s) {', '.join(missing)}")
        if raw.get("mlp_bias"):
            raise ModelLoadError(f"{source}: mlp_bias=true is not supported")
        num_heads = int(raw["num_attention_heads"])
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise ModelLoadError(f"{source}: num_attention_heads={num_heads} is not a multiple of "
                                 f"num_key_value_heads={num_kv_heads}")
        head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // num_heads)
        rope_theta, rope_scaling = _rope(raw, source)
        return ModelConfig(
            architecture=arch,
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            vocab_size=int(raw["vocab_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_context_limit(raw, arch),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=_attention_bias(raw, arch),
            qk_norm=arch == "Qwen3ForCausalLM",
            eos_token_ids=_eos_ids(raw.get("eos_token_id"), (generation_config or {}).get("eos_token_id")),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        )


def _read_json(file: str, required: bool) -> Optional[Any]:
    if not os.path.isfile(file):
        if required:
            raise ModelLoadError(f"{file} not found: a model folder needs a config.json")
        return None
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{file} is not valid JSON: {e}") from e


def _architecture(raw: dict, source: str) -> str:
    archs = raw.get("architectures") or []
    if not archs and raw.get("model_type") in _MODEL_TYPE_TO_ARCH:
        archs = [_MODEL_TYPE_TO_ARCH[raw["model_type"]]]
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    shown = ", ".join(archs) if archs else f"model_type={raw.get('model_type')!r}"
    raise ModelLoadError(f"{source}: unsupported architecture {shown}; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def _rope(raw: dict, source: str) -> tuple[float, Optional[dict]]:
    """(rope_theta, rope_scaling) from either `rope_parameters` (transformers 5) or `rope_scaling`."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", None) or raw.get("rope_theta") or 10000.0)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"{source}: unsupported rope type {rope_type!r}; "
                             f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None
    params.pop("type", None)
    params["rope_type"] = rope_type
    needed = ("factor",) if rope_type == "linear" else ("factor", "low_freq_factor", "high_freq_factor")
    missing = [k for k in needed if params.get(k) is None]
    if missing:
        raise ModelLoadError(f"{source}: rope type {rope_type!r} needs {', '.join(missing)}")
    if rope_type == "llama3" and params.get("original_max_position_embeddings") is None:
        params["original_max_position_embeddings"] = int(raw["max_position_embeddings"])
    return theta, params


def _attention_bias(raw: dict, arch: str) -> bool:
    # transformers hard-codes these two: Qwen2 always has q/k/v bias, Mistral never has any.
    if arch == "Qwen2ForCausalLM":
        return True
    if arch == "MistralForCausalLM":
        return False
    return bool(raw.get("attention_bias", False))


def _context_limit(raw: dict, arch: str) -> int:
    """max_position_embeddings, capped at the sliding window when one is active.

    We attend over the full context; within the window that is exactly what sliding-window attention
    computes, so capping the context keeps outputs exact instead of silently diverging past it.
    """
    limit = int(raw["max_position_embeddings"])
    window = raw.get("sliding_window")
    active = arch == "MistralForCausalLM" or bool(raw.get("use_sliding_window"))
    if active and window and int(window) < limit:
        logger.warning("sliding_window=%s: capping the context at %s tokens (sliding-window attention "
                       "is not implemented)", window, window)
        return int(window)
    return limit


def _eos_ids(*values: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for value in values:
        for i in value if isinstance(value, list) else [value]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return tuple(ids)
