"""Test fixtures: GGUF files of the built-in `tiny` shape written by the `gguf` package itself (its quantizer and
GGUFWriter), and the same weights de-quantized into a safetensors folder (the dense path to compare with)."""

from __future__ import annotations

import json
import os
import shutil

import gguf
import torch
from safetensors.torch import load_file, save_file

from kvstrata.model.builtin import resolve_model_path

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
    writer = gguf.GGUFWriter(path, "qwen3")
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
    dense = {}
    for name, tensor in state.items():
        values = tensor.float().numpy()
        if values.ndim == 2:
            data = gguf.quants.quantize(values, qtype)
            writer.add_tensor(gguf_name(name), data, raw_dtype=qtype)
            dense[name] = torch.from_numpy(gguf.quants.dequantize(data, qtype).copy())
        else:
            writer.add_tensor(gguf_name(name), values)
            dense[name] = tensor.float()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    folder = os.path.join(out_dir, f"tiny-{type_name}-dequantized")
    os.makedirs(folder)
    for f in os.listdir(tiny):
        if f != "model.safetensors":
            shutil.copy(os.path.join(tiny, f), folder)
    save_file(dense, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return path, folder


# A Q4_K_M-like mix of K-quant types per GGUF tensor role (the rest Q4_K): what llama.cpp's Q4_K_M writes,
# plus a Q5_K embedding table.
K_MIX = {"token_embd.weight": "Q5_K", "attn_v.weight": "Q6_K", "ffn_down.weight": "Q6_K"}


def write_kquant_gguf(path: str, config: dict, seed: int = 0) -> str:
    """A Llama GGUF file of `config` (a config.json dict, tied embeddings) whose matrices are valid random
    K-quant blocks (gguf_blocks_gen; K_MIX types) and whose norms are F32 ones; no tokenizer."""
    from tests.model.gguf_blocks_gen import random_rows

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
