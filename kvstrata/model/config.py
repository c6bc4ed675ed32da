"""ModelConfig: the parts of a Hugging Face `config.json` (+ `generation_config.json`) that kvstrata uses.

Both config generations are read: transformers 4.x (`rope_theta`, `rope_scaling`, `torch_dtype`) and 5.x
(`rope_parameters` holding `rope_theta`, `dtype`). Everything is resolved once into a frozen object.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Optional

logger = logging.getLogger(__name__)

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           *MOE_ARCHITECTURES)
# Used when `architectures` is absent from config.json.
_MODEL_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                       "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                       "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                       "mixtral": "MixtralForCausalLM"}
_REQUIRED_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "vocab_size", "max_position_embeddings")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ModelLoadError(Exception):
    """A model folder that cannot be loaded; the message names the file, field or tensor at fault."""


def check_no_missing_tensors(expected: Iterable[str], filled: set[str], source: str) -> None:
    """Raise ModelLoadError naming (the first five of) the tensors in `expected` that were never filled."""
    missing = sorted(set(expected) - filled)
    if missing:
        shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        raise ModelLoadError(f"{source} is missing tensor(s) {shown}")


@dataclass(frozen=True)
class MoeConfig:
    """The mixture-of-experts block of a Qwen3-MoE, Qwen2-MoE or Mixtral checkpoint (softmax top-k routing)."""

    num_experts: int
    top_k: int                            # experts per token (num_experts_per_tok)
    expert_intermediate_size: int         # each routed expert's gate/up width
    norm_topk_prob: bool                  # renormalize the top-k probabilities to sum to 1
    sparse_layers: tuple[int, ...]        # layers whose MLP is the expert block; the others are dense
    shared_expert_intermediate_size: int  # Qwen2-MoE's always-on expert behind a sigmoid gate; 0: none


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
    moe: Optional[MoeConfig] = None       # None: a dense model

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is the mixture-of-experts block."""
        return self.moe is not None and layer in self.moe.sparse_layers

    @property
    def o_proj_bias(self) -> bool:
        """Llama/Qwen3 put `attention_bias` on o_proj too; Qwen2 has bias on q/k/v only."""
        return self.attention_bias and self.architecture not in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")

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
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            eos_token_ids=_eos_ids(raw.get("eos_token_id"), (generation_config or {}).get("eos_token_id")),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            moe=_moe(raw, arch, source) if arch in MOE_ARCHITECTURES else None,
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


# Fields of other MoE families (DeepSeek, GLM, Llama 4, ...) that change the routing or add experts this
# engine does not compute: a checkpoint that sets one is refused rather than run wrong. Value: the neutral one.
_FOREIGN_MOE_FIELDS = {"scoring_func": "softmax", "topk_method": "greedy", "n_group": 1, "topk_group": 1,
                       "n_shared_experts": 0, "routed_scaling_factor": 1.0, "first_k_dense_replace": 0,
                       "moe_layer_freq": 1, "num_shared_experts": 0}


def _moe(raw: dict, arch: str, source: str) -> MoeConfig:
    """The expert block of a Qwen3-MoE / Qwen2-MoE / Mixtral config; unsupported variants name their field."""
    for name, neutral in _FOREIGN_MOE_FIELDS.items():
        if raw.get(name) not in (None, neutral):
            raise ModelLoadError(f"{source}: {name}={raw[name]!r} is not supported for {arch} "
                                 f"(only {name}={neutral!r}: softmax top-k routing)")
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{source}: hidden_act={raw['hidden_act']!r} is not supported (only silu)")
    num_layers = int(raw["num_hidden_layers"])
    if arch == "MixtralForCausalLM":
        if raw.get("sliding_window") is not None:
            raise ModelLoadError(f"{source}: sliding_window={raw['sliding_window']!r} is not supported for "
                                 f"{arch} (only null: sliding-window attention is not implemented)")
        num_experts, inter = _int_field(raw, "num_local_experts", source), int(raw["intermediate_size"])
        norm_topk, sparse, shared = True, tuple(range(num_layers)), 0
    else:
        # transformers 5 writes Qwen3-MoE's expert count as num_local_experts; Qwen's own configs say num_experts.
        key = "num_experts" if raw.get("num_experts") is not None else "num_local_experts"
        num_experts, inter = _int_field(raw, key, source), _int_field(raw, "moe_intermediate_size", source)
        norm_topk = bool(raw.get("norm_topk_prob", arch == "Qwen3MoeForCausalLM"))
        step = int(raw.get("decoder_sparse_step") or 1)
        dense = set(raw.get("mlp_only_layers") or [])
        sparse = tuple(i for i in range(num_layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0)
        shared = int(raw.get("shared_expert_intermediate_size") or 0)
        if shared and arch != "Qwen2MoeForCausalLM":
            raise ModelLoadError(f"{source}: shared_expert_intermediate_size={shared} is not supported for {arch} "
                                 "(shared experts: Qwen2MoeForCausalLM only)")
        if arch == "Qwen2MoeForCausalLM" and not shared:
            raise ModelLoadError(f"{source}: missing required field shared_expert_intermediate_size")
    top_k = _int_field(raw, "num_experts_per_tok", source)
    if sparse and not 0 < top_k <= num_experts:
        raise ModelLoadError(f"{source}: num_experts_per_tok={top_k} must be between 1 and the {num_experts} experts")
    return MoeConfig(num_experts=num_experts, top_k=top_k, expert_intermediate_size=inter, norm_topk_prob=norm_topk,
                     sparse_layers=sparse, shared_expert_intermediate_size=shared)


def _int_field(raw: dict, name: str, source: str) -> int:
    value = raw.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ModelLoadError(f"{source}: field {name} must be a non-negative integer, got {value!r}")
    return value


def _attention_bias(raw: dict, arch: str) -> bool:
    # transformers hard-codes these: Qwen2 always has q/k/v bias (Qwen2-MoE unless qkv_bias says otherwise),
    # Mistral and Mixtral never have any.
    if arch == "Qwen2ForCausalLM":
        return True
    if arch == "Qwen2MoeForCausalLM":
        return bool(raw.get("qkv_bias", True))
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
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
