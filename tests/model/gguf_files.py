"""Test fixtures: GGUF files written by the `gguf` package itself (its quantizer and GGUFWriter), of the built-in
`tiny` shape and of a small Qwen3-MoE, and the same weights de-quantized into a safetensors folder (the dense
path to compare with)."""

from __future__ import annotations

import json
import os
import shutil

import gguf
import numpy as np
import torch
from safetensors.torch import load_file, save_file

from kvstrata.model.builtin import resolve_model_path
from tests.model.gguf_blocks_gen import random_rows

# Hugging Face name (layer part) -> GGUF name
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def gguf_name(hf: str) -> str:
    """The GGUF name of a Hugging Face tensor name."""
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}"


def write_tiny_gguf(out_dir: str, type_name: str) -> tuple[str, str]:
    """(GGUF file, dense folder): the tiny model's weights, every matrix quantized to `type_name` by gguf's
    quantizer (norms stay F32); the folder holds the same matrices de-quantized by gguf, as float32."""
    tiny = resolve_model_path("tiny")
    with open(os.path.join(tiny, "config.json")) as fh:
        config = json.load(fh)
    state = load_file(os.path.join(tiny, "model.safetensors"))
    qtype = gguf.GGMLQuantizationType[type_name]
    path = os.path.join(out_dir, f"tiny-{type_name}.gguf")
    writer = _writer(path, "qwen3", config)
    dense = {}
    for name, tensor in state.items():
        values = tensor.float().numpy()
        dense[name] = _add(writer, gguf_name(name), values, qtype if values.ndim == 2 else None)
    _close(writer)
    folder = os.path.join(out_dir, f"tiny-{type_name}-dequantized")
    os.makedirs(folder)
    for f in os.listdir(tiny):
        if f != "model.safetensors":
            shutil.copy(os.path.join(tiny, f), folder)
    save_file(dense, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return path, folder


# A Qwen3-MoE small enough for a unit test whose rows still hold K-quant super-blocks (256 values): every layer
# sparse, 4 experts, top 2; the built-in tiny model's vocabulary (serve it with tokenizer_path="tiny").
MOE_CONFIG = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=1024, hidden_size=256,
    intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1000000.0, moe_intermediate_size=256,
    num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    tie_word_embeddings=False, bos_token_id=0, eos_token_id=2)
# The expert tensors: kind -> (GGUF name, Hugging Face projection)
_EXPERTS = {"gate": ("ffn_gate_exps.weight", "gate_proj"), "up": ("ffn_up_exps.weight", "up_proj"),
            "down": ("ffn_down_exps.weight", "down_proj")}


def write_moe_gguf(out_dir: str, expert_types: dict[str, str], seed: int = 0) -> tuple[str, str]:
    """(GGUF file, dense folder) of a random Qwen3-MoE (MOE_CONFIG): expert tensors (`ffn_*_exps`, `[E, rows,
    K]`) in `expert_types` ("gate"/"up"/"down" -> type name; K-quants as random valid blocks, Q8_0 etc. by
    gguf's quantizer), the router and the other matrices in Q8_0, norms in F32. The folder holds the same
    weights de-quantized by gguf as a float32 Hugging Face Qwen3-MoE checkpoint (one tensor per expert)."""
    c = MOE_CONFIG
    h, inter, experts = c["hidden_size"], c["moe_intermediate_size"], c["num_experts"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    rng = np.random.default_rng(seed)
    q8 = gguf.GGMLQuantizationType.Q8_0
    path = os.path.join(out_dir, f"moe-{'-'.join(expert_types.values())}.gguf")
    writer = _writer(path, "qwen3moe", c)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(c["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(inter)
    dense = {"model.embed_tokens.weight": _add(writer, "token_embd.weight", _normal(rng, (c["vocab_size"], h), 1.0), q8),
             "model.norm.weight": _add(writer, "output_norm.weight", _norm(rng, h)),
             "lm_head.weight": _add(writer, "output.weight", _normal(rng, (c["vocab_size"], h), 0.1), q8)}
    for i in range(c["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        matrices = {"attn_q.weight": (q, h), "attn_k.weight": (kv, h), "attn_v.weight": (kv, h),
                    "attn_output.weight": (h, q)}
        for name, shape in matrices.items():
            dense[gguf_hf_name(i, name)] = _add(writer, f"blk.{i}.{name}", _normal(rng, shape, 0.1), q8)
        for name, size in (("attn_norm.weight", h), ("ffn_norm.weight", h), ("attn_q_norm.weight", c["head_dim"]),
                           ("attn_k_norm.weight", c["head_dim"])):
            dense[gguf_hf_name(i, name)] = _add(writer, f"blk.{i}.{name}", _norm(rng, size))
        dense[f"{layer}.mlp.gate.weight"] = _add(writer, f"blk.{i}.ffn_gate_inp.weight",
                                                 _normal(rng, (experts, h), 0.5), q8)
        for kind, (name, proj) in _EXPERTS.items():
            shape = (experts, h, inter) if kind == "down" else (experts, inter, h)
            type_name = expert_types[kind]
            values = _add(writer, f"blk.{i}.{name}", _expert_values(rng, shape, type_name),
                          gguf.GGMLQuantizationType[type_name])
            for e in range(experts):
                dense[f"{layer}.mlp.experts.{e}.{proj}.weight"] = values[e].clone()
    _close(writer)
    folder = os.path.join(out_dir, f"moe-{'-'.join(expert_types.values())}-dequantized")
    os.makedirs(folder)
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(c, fh)
    save_file(dense, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return path, folder


def gguf_hf_name(layer: int, gguf_part: str) -> str:
    """The Hugging Face name of a layer's GGUF tensor `blk.<layer>.<gguf_part>` (dense projections and norms)."""
    return f"model.layers.{layer}.{next(hf for hf, g in _LAYER.items() if g == gguf_part)}"


def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    return (rng.standard_normal(shape) * std).astype(np.float32)


def _norm(rng: np.random.Generator, size: int) -> np.ndarray:
    return (1.0 + 0.2 * rng.standard_normal(size)).astype(np.float32)


def _expert_values(rng: np.random.Generator, shape: tuple[int, ...], type_name: str) -> np.ndarray:
    """Float values to quantize (`[E, rows, K]` float32), or for a K-quant its random valid blocks (`[E, rows,
    row bytes]` uint8), their super-block scales shrunk so that the weights are ~0.1 in size."""
    if not type_name.endswith("_K"):
        return _normal(rng, shape, 0.1)
    experts, rows, values = shape
    blocks = random_rows(type_name, experts * rows, values, seed=int(rng.integers(2**31)))
    size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][1]
    per_block = blocks.reshape(-1, size)
    for at in (208,) if type_name == "Q6_K" else (0, 2):     # d (and dmin): float16 at these bytes
        scale = np.ascontiguousarray(per_block[:, at:at + 2]).view(np.float16) * np.float16(0.3)
        per_block[:, at:at + 2] = scale.view(np.uint8)
    return per_block.reshape(experts, rows, -1)


def _writer(path: str, arch: str, config: dict) -> gguf.GGUFWriter:
    """A GGUFWriter for `arch` with the header keys of a Llama-family `config` (config.json fields)."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(float((config.get("rope_parameters") or config)["rope_theta"]))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    return writer


def _add(writer: gguf.GGUFWriter, name: str, values: np.ndarray, qtype=None) -> torch.Tensor:
    """Write tensor `name`: float32 `values` quantized to `qtype` by gguf (F32 when None), or raw blocks
    (uint8) as they are; returns what gguf's de-quantizer reads back (float32)."""
    if qtype is None:
        writer.add_tensor(name, values)
        return torch.from_numpy(values.copy())
    data = values if values.dtype == np.uint8 else gguf.quants.quantize(values, qtype)
    writer.add_tensor(name, data, raw_dtype=qtype)
    return torch.from_numpy(gguf.quants.dequantize(data, qtype).copy())


def _close(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# A Q4_K_M-like mix of K-quant types per GGUF tensor role (the rest Q4_K): what llama.cpp's Q4_K_M writes,
# plus a Q5_K embedding table.
K_MIX = {"token_embd.weight": "Q5_K", "attn_v.weight": "Q6_K", "ffn_down.weight": "Q6_K"}


def write_kquant_gguf(path: str, config: dict, seed: int = 0) -> str:
    """A Llama GGUF file of `config` (a config.json dict, tied embeddings) whose matrices are valid random
    K-quant blocks (gguf_blocks_gen; K_MIX types) and whose norms are F32 ones; no tokenizer."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    shapes = {"attn_q.weight": (q, hidden), "attn_k.weight": (kv, hidden), "attn_v.weight": (kv, hidden),
              "attn_output.weight": (hidden, q), "ffn_gate.weight": (inter, hidden),
              "ffn_up.weight": (inter, hidden), "ffn_down.weight": (hidden, inter)}
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(float(config["rope_theta"]))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])

    def quantized(name: str, rows: int, values: int, salt: int) -> None:
        kind = K_MIX.get(name.split(".", 2)[-1] if name.startswith("blk.") else name, "Q4_K")
        writer.add_tensor(name, random_rows(kind, rows, values, seed=seed * 1000 + salt),
                          raw_dtype=gguf.GGMLQuantizationType[kind])

    quantized("token_embd.weight", config["vocab_size"], hidden, 0)
    writer.add_tensor("output_norm.weight", torch.ones(hidden).numpy())
    for i in range(config["num_hidden_layers"]):
        for j, (name, (rows, values)) in enumerate(shapes.items()):
            quantized(f"blk.{i}.{name}", rows, values, 1 + 10 * i + j)
        for norm in ("attn_norm.weight", "ffn_norm.weight"):
            writer.add_tensor(f"blk.{i}.{norm}", torch.ones(hidden).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
