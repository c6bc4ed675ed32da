"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3 and the MoE Qwen3-MoE, Qwen2-MoE, Mixtral) over the paged KV pool.

One class covers the family; the differences are config switches: q/k/v bias (Qwen2, or `attention_bias`),
q/k RMSNorm over head_dim before RoPE (Qwen3), tied embeddings, and a mixture-of-experts block (moe.py) in
place of the MLP on the config's sparse layers. Projections are fused (q|k|v in
`qkv_proj`, gate|up in `gate_up_proj`) so a layer runs two matmuls fewer; `checkpoint_targets()` tells the
loader where each Hugging Face tensor goes.
"""

from __future__ import annotations

import torch
from torch import nn

from kvstrata.model.attention import paged_attention, sdpa_backends
from kvstrata.model.config import ModelConfig
from kvstrata.model.forward_meta import ForwardMetadata
from kvstrata.model.layers import GatedMLP, Linear, RMSNorm, upcasts_on_cpu
from kvstrata.model.moe import SparseMoeBlock
from kvstrata.model.parallel import ShardLayout, TensorParallel, embedding, gather_logits, row_parallel_linear
from kvstrata.model.rope import RotaryEmbedding, Rotation, apply_rotary


class LlamaAttention(nn.Module):
    """Self-attention of one layer: fused qkv projection, optional q/k norm, RoPE, paged attention."""

    def __init__(self, config: ModelConfig, layer_id: int, layout: ShardLayout, tp: TensorParallel | None):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = layout.q_heads         # this rank's heads (all of them without tensor parallelism)
        self.num_kv_heads = layout.kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = row_parallel_linear(config.num_heads * config.head_dim, config.hidden_size,
                                          config.o_proj_bias, tp)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x: torch.Tensor, rotation: Rotation, meta: ForwardMetadata,
                kv_pool) -> torch.Tensor:
        """Attention output `[T, hidden]` for the batch's new tokens `x` `[T, hidden]`."""
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size:].view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(qkv[:, :self.q_size].view(tokens, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size:self.q_size + self.kv_size].view(tokens, self.num_kv_heads,
                                                                                 self.head_dim))
            q, k = apply_rotary(q, rotation), apply_rotary(k, rotation)
        else:
            # q and k are adjacent in the fused output: rotate both with one set of elementwise ops.
            qk = qkv[:, :self.q_size + self.kv_size].view(tokens, self.num_heads + self.num_kv_heads,
                                                          self.head_dim)
            q, k = apply_rotary(qk, rotation).split([self.num_heads, self.num_kv_heads], dim=1)
        out = paged_attention(q, k, v, self.layer_id, meta, kv_pool)
        return self.o_proj(out)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm decoder block; carries the residual stream separately so norms read the summed input."""

    def __init__(self, config: ModelConfig, layer_id: int, layout: ShardLayout, tp: TensorParallel | None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_id, layout, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.is_sparse_layer(layer_id):
            self.mlp = SparseMoeBlock(config.hidden_size, config.moe, layout, tp, layer_id)
        else:
            self.mlp = GatedMLP(config.hidden_size, layout.intermediate,
                                down_proj=row_parallel_linear(config.intermediate_size, config.hidden_size, False, tp))

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rotation: Rotation,
                meta: ForwardMetadata, kv_pool) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (block output, residual before it); their sum is the next layer's input."""
        hidden, residual = self.input_layernorm.add_norm(hidden, residual)
        hidden = self.self_attn(hidden, rotation, meta, kv_pool)
        hidden, residual = self.post_attention_layernorm.add_norm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's `model.*` tensors)."""

    def __init__(self, config: ModelConfig, layout: ShardLayout, tp: TensorParallel | None):
        super().__init__()
        self.embed_tokens = embedding(layout, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, layout, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM; `forward` returns float32 logits for the rows the caller asks for.

    `tp`: this process's rank of a tensor-parallel group (model/parallel.py): the model holds the rank's
    shard of every weight (`layout`), and `forward` still returns the full logits on every rank.
    """

    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None):
        super().__init__()
        self.config = config
        self.tp = tp
        self.layout = ShardLayout.of(config, tp)
        self.model = LlamaModel(config, self.layout, tp)
        # A bf16 lm_head left in bf16 (tied; see optimize_layout): converting the whole vocabulary matrix
        # to float32 only pays for many rows (prompt logprobs).
        vocab_rows = self.layout.vocab_rows if self.layout.size > 1 else config.vocab_size
        self.lm_head = Linear(config.hidden_size, vocab_rows, bias=False, upcast_min_rows=64)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling,
                                      config.max_position_embeddings)

    def tie_embeddings(self) -> None:
        """Make lm_head share the input embedding matrix."""
        self.lm_head.weight = self.model.embed_tokens.weight

    def optimize_layout(self) -> None:
        """Re-lay lm_head for the device once loaded (the values it computes are unchanged or more exact).

        On CPU, lm_head's `[vocab, hidden]` matrix is stored float32 column-major: MKL's float32 product
        for a few decode rows is ~2x faster reading it that way, and lm_head is the largest matrix a decode
        step reads. A bf16 model's untied lm_head is widened to float32 when the CPU has no native bf16
        (emulated bf16 GEMMs of several rows are several times slower; logits are float32 anyway). A tied
        bf16 matrix stays as it is (the embedding must stay bf16); tied float32 embedding lookups then
        gather strided rows, a small cost at prefill. A bf16 lm_head that the compiled decode GEMV serves
        (`use_decode_linear`) stays bf16 too: the GEMV reads it faster than MKL the float32 matrix.
        """
        weight = self.lm_head.weight
        if (weight.device.type != "cpu" or not weight.is_contiguous() or self.lm_head.decode_gemv is not None
                or self.lm_head.quantized is not None):
            return
        tied = weight is self.model.embed_tokens.weight
        if weight.dtype != torch.float32 and (tied or not upcasts_on_cpu(weight.dtype)):
            return
        column_major = torch.empty_strided(weight.shape, (1, weight.shape[0]), dtype=torch.float32)
        column_major.copy_(weight.data)
        weight.data = column_major

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMetadata,
                kv_pool) -> torch.Tensor:
        """Logits `[len(meta.logits_indices), vocab]` (float32) of a batch of new tokens `input_ids` `[T]`."""
        hidden = self.model.embed_tokens(input_ids)
        max_position = max(meta.seq_lens) - 1
        rotation = self.rotary.rotation(positions, max_position, hidden.dtype)
        residual = None
        with sdpa_backends(hidden.device):
            for layer in self.model.layers:
                hidden, residual = layer(hidden, residual, rotation, meta, kv_pool)
        # Only the requested rows go through the final norm and lm_head (prefill needs the last one).
        rows = meta.logits_indices
        hidden, _ = self.model.norm.add_norm(hidden[rows], residual[rows])
        return gather_logits(self.lm_head(hidden).float(), self.layout, self.tp)

    def checkpoint_targets(self) -> dict[str, tuple]:
        """Hugging Face tensor name -> (parameter name, first row, end row[, expert]) it fills.

        Fused parameters are filled by several checkpoint tensors, each a row range (of one expert's slice
        for the stacked expert weights). lm_head is listed even when tied; the loader decides whether to tie.
        """
        c, layout = self.config, self.layout
        q, kv, inter = layout.q_heads * c.head_dim, layout.kv_heads * c.head_dim, layout.intermediate
        targets: dict[str, tuple[str, int, int]] = {}
        for name, param in self.named_parameters(remove_duplicate=False):
            targets[name] = (name, 0, param.shape[0])
        for i in range(c.num_layers):
            attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
            kinds = ("weight", "bias") if c.attention_bias else ("weight",)
            for kind in kinds:
                fused = targets.pop(f"{attn}.qkv_proj.{kind}")[0]
                targets[f"{attn}.q_proj.{kind}"] = (fused, 0, q)
                targets[f"{attn}.k_proj.{kind}"] = (fused, q, q + kv)
                targets[f"{attn}.v_proj.{kind}"] = (fused, q + kv, q + 2 * kv)
            block = self.model.layers[i].mlp
            if isinstance(block, SparseMoeBlock):
                targets = {k: v for k, v in targets.items() if not k.startswith(f"{mlp}.")}
                mixtral = c.architecture == "MixtralForCausalLM"
                theirs = f"model.layers.{i}.block_sparse_moe" if mixtral else mlp
                targets.update(block.checkpoint_targets(mlp, theirs, mixtral))
                continue
            fused = targets.pop(f"{mlp}.gate_up_proj.weight")[0]
            targets[f"{mlp}.gate_proj.weight"] = (fused, 0, inter)
            targets[f"{mlp}.up_proj.weight"] = (fused, inter, 2 * inter)
        return targets
