"""A GGUF file's weights loaded into a LlamaForCausalLM, each tensor kept in its GGUF type.

    place     from the header alone (gguf_header.read_header; no tensor read yet): which parameter (row range,
              expert slabs) each GGUF tensor fills, its type and shape checked against the config; what the
              file lacks is named
    release   the float storage of every parameter that stays quantized (and of a tied lm_head) is dropped on
              the meta device, so it is never allocated: the model's float memory is its norms, biases
              and whatever the file stores as F32/F16/BF16
    read      each tensor with plain reads at its offset, straight into its final buffer where the layout
              allows (the file is never mapped: mapped pages would count in the RSS while mapped);
              quantized blocks become GGUFWeights (quant/gguf_weight.py), float tensors are copied into
              their parameters in the model dtype

A Qwen3-MoE file's expert tensors (`blk.N.ffn_{gate,up,down}_exps`, `[E, rows, K]`, one slab per expert) are
read into one buffer per projection (gate rows then up rows per expert, as FusedExperts stacks them), and
each expert's Linear gets a GGUFWeight over its slab (FusedExperts.bind), so an expert's products take the
same quantized kernels as any other projection. The router (`ffn_gate_inp`) is an ordinary Linear.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import TYPE_CHECKING, BinaryIO, NamedTuple

import numpy as np
import torch
from torch import nn

from kvstrata.model.config import ModelConfig, ModelLoadError, check_no_missing_tensors
from kvstrata.model.gguf_header import TensorInfo, read_header
from kvstrata.model.quant.gguf_blocks import FLOAT_TYPES, block_format, float_values
from kvstrata.platform import unmap_large_buffers

if TYPE_CHECKING:
    from kvstrata.model.quant.base import QuantizedWeight
    from kvstrata.model.quant.gguf_blocks import BlockFormat

# llama.cpp's converter permutes the rows of attn_q / attn_k for these architectures (rotary halves
# interleaved); transformers undoes it, and so do we.
_PERMUTED_ARCHS = ("llama", "mistral")
# GGUF tensor names -> Hugging Face names ({i}: the layer)
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight", "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
}
# Stacked expert tensors -> each expert's Hugging Face projection ({i}: the layer, {e}: the expert)
_EXPERT_NAMES = {"ffn_gate_exps.weight": "gate_proj.weight", "ffn_up_exps.weight": "up_proj.weight",
                 "ffn_down_exps.weight": "down_proj.weight"}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_IGNORED = ("rope_freqs.weight",)   # llama3 RoPE factors: the config's rope_scaling carries them
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def hf_names(gguf_name: str, num_experts: int) -> tuple[str, ...]:
    """The Hugging Face tensors a GGUF tensor stands for: one, or one per expert for a stacked `*_exps` tensor
    (of `num_experts`); () for a tensor we do not map."""
    if gguf_name in _GLOBAL_NAMES:
        return (_GLOBAL_NAMES[gguf_name],)
    parts = gguf_name.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return ()
    layer = f"model.layers.{parts[1]}"
    if parts[2] in _LAYER_NAMES:
        return (f"{layer}.{_LAYER_NAMES[parts[2]]}",)
    if parts[2] in _EXPERT_NAMES and num_experts:
        return tuple(f"{layer}.mlp.experts.{e}.{_EXPERT_NAMES[parts[2]]}" for e in range(num_experts))
    return ()


class _Part(NamedTuple):
    """A GGUF tensor placed in the model: rows [start, end) of parameter `param` (of every expert's slab when
    `experts` > 0: a `[experts, rows, K]` tensor), `K` = `row_values` values per row, `n_bytes` at byte
    `offset` of the file; `heads`: undo llama.cpp's q/k row order."""

    name: str
    param: str
    start: int
    end: int
    experts: int
    row_values: int
    fmt: BlockFormat
    offset: int
    n_bytes: int
    heads: int | None

    @property
    def quantized(self) -> bool:
        """Whether the tensor stays in a block format (else it is a float tensor)."""
        return self.fmt.type_id not in FLOAT_TYPES

    @property
    def shape(self) -> tuple[int, ...]:
        """The tensor's dimensions but the last (`[rows]`, `[E, rows]` for experts): its rows of bytes."""
        rows = self.end - self.start
        return (self.experts, rows) if self.experts else (rows,)


def load_gguf_model(path: str, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Build the model for `config` from GGUF file `path`, every quantized tensor kept in its block format.

    A tensor whose type is not served, whose shape disagrees with the config, that the model has no place
    for, that the file lacks, whose bytes run past the end of the file or whose block scales are not finite
    is a ModelLoadError naming it.
    """
    from kvstrata.model.llama import LlamaForCausalLM
    from kvstrata.model.moe import bind_experts

    device = torch.device(device)
    unmap_large_buffers()
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(dtype=dtype)
    groups, tied = _place(path, model, config)
    quantized = {name for name, parts in groups.items() if parts[0].quantized}
    for name in quantized | ({LM_HEAD} if tied else set()):
        _release(model, name)
    model = model.to_empty(device=device)
    params = dict(model.named_parameters(remove_duplicate=False))
    experts: dict[nn.Module, dict[str, list[QuantizedWeight]]] = defaultdict(dict)
    with open(path, "rb", buffering=0) as fh:
        for name, parts in groups.items():
            if name in quantized:
                weights = _quantized_weights(parts, fh, path, device)
                _install(model, name, weights, dtype, experts, path)
            else:
                for part in parts:
                    _fill(params[name], part, _read(fh, part, path))
    for block, weights in experts.items():
        block.bind(gate_up=weights.get("gate_up_proj"), down=weights.get("down_proj"))
    if tied:      # no output.weight: the head is the embedding
        if EMBED in quantized:
            model.lm_head.set_quantized(model.model.embed_tokens.table)
        else:
            model.tie_embeddings()
    bind_experts(model)     # the experts a float file stores
    return model.eval()


def _place(path: str, model: nn.Module, config: ModelConfig) -> tuple[dict[str, list[_Part]], bool]:
    """(parameter -> the GGUF tensors filling it, in row order; whether lm_head is tied), from the header."""
    header = read_header(path)
    arch = str(header.fields.get("general.architecture") or "")
    targets = model.checkpoint_targets()
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
    num_experts = config.moe.num_experts if config.moe is not None else 0
    groups: dict[str, list[_Part]] = defaultdict(list)
    filled: set[str] = set()
    for t in header.tensors:
        if t.name in _IGNORED:
            continue
        names = hf_names(t.name, num_experts)
        if not names or any(n not in targets for n in names):
            moe = " (MoE GGUF files are served for qwen3moe only)" if "_exps" in t.name else ""
            raise ModelLoadError(f"{path}: unexpected tensor {t.name!r} for {config.architecture}{moe}")
        part = _part(t, names, targets, shapes, config, arch, path)
        groups[part.param].append(part)
        filled.update(names)
    tied = LM_HEAD not in filled
    check_no_missing_tensors(targets, filled | {LM_HEAD}, f"{path}: GGUF file")
    for name, parts in groups.items():
        parts.sort(key=lambda p: p.start)
        if len({p.quantized for p in parts}) > 1:
            raise ModelLoadError(f"{path}: the GGUF tensors of {name!r} mix float and quantized types: a fused "
                                 f"projection is served all float or all quantized")
    return groups, tied


def _part(t: TensorInfo, names: tuple[str, ...], targets: dict[str, tuple], shapes: dict[str, tuple], config: ModelConfig,
          arch: str, path: str) -> _Part:
    """The placement of GGUF tensor `t` (standing for HF tensors `names`), its type and shape checked."""
    fmt = block_format(t.type_id)
    if fmt is None:
        raise ModelLoadError(f"{path}: tensor {t.name!r} has GGUF type {t.type_name}, which is not "
                             f"served (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)")
    param, start, end = targets[names[0]][:3]
    experts = len(names) if t.name.split(".", 2)[-1] in _EXPERT_NAMES else 0
    rows = end - start
    shape = [rows] if len(shapes[param]) == 1 else [*([experts] if experts else []), rows, shapes[param][-1]]
    if list(t.shape) != shape or t.n_bytes != fmt.row_bytes(math.prod(shape)):
        raise ModelLoadError(f"{path}: tensor {t.name!r} has shape {list(t.shape)} ({t.n_bytes} bytes of "
                             f"{fmt.name}), expected {shape}")
    heads = None
    if arch in _PERMUTED_ARCHS and names[0].endswith(("q_proj.weight", "k_proj.weight")):
        heads = config.num_heads if names[0].endswith("q_proj.weight") else config.num_kv_heads
    return _Part(t.name, param, start, end, experts, shape[-1] if len(shape) > 1 else 1, fmt, t.offset, t.n_bytes,
                 heads)


def _release(model: nn.Module, name: str) -> None:
    """Replace parameter `name` by an empty one on the meta device: it is never allocated."""
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    empty = torch.empty(0, dtype=getattr(module, attr).dtype, device="meta")
    setattr(module, attr, nn.Parameter(empty, requires_grad=False))


def _read(fh: BinaryIO, part: _Part, path: str, out: np.ndarray | None = None) -> np.ndarray:
    """The bytes of `part` as uint8 `[*part.shape, row bytes]`, read into `out` (C-contiguous) when given."""
    if out is None:
        out = np.empty((*part.shape, part.n_bytes // math.prod(part.shape)), dtype=np.uint8)
    view = memoryview(out).cast("B")
    fh.seek(part.offset)
    done = 0
    while done < part.n_bytes:
        got = fh.readinto(view[done:])
        if not got:
            raise ModelLoadError(f"{path}: tensor {part.name!r} is truncated")
        done += got
    return out


def _unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's q/k permutation (transformers' reverse_permute_weights)."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(0, 2, 1).reshape(-1)


def _fill(dest: torch.Tensor, part: _Part, raw: np.ndarray) -> None:
    """Copy float tensor `part` (its bytes `raw`) into its rows of parameter `dest`, converting to its dtype."""
    values = float_values(torch.from_numpy(raw), part.fmt)      # [*shape, K] in the file's float type
    if part.heads is not None:
        values = values[torch.from_numpy(_unpermute_rows(values.shape[0], part.heads))]
    with torch.no_grad():
        if part.experts:
            dest.data[:, part.start:part.end].copy_(values)
        elif dest.dim() == 1:
            dest.data[part.start:part.end].copy_(values.reshape(-1))
        else:
            dest.data[part.start:part.end].copy_(values)


def _quantized_weights(parts: list[_Part], fh: BinaryIO, path: str, device: torch.device) -> list[QuantizedWeight]:
    """The weights of a (fused) projection, one per expert for expert slabs (else one): a GGUFWeight over one
    buffer when its parts share a type, each part's blocks read into its rows; else a GGUFStack of one
    GGUFWeight per part."""
    from kvstrata.model.quant.gguf_weight import GGUFStack, GGUFWeight

    slabs, in_features = max(parts[0].experts, 1), parts[0].row_values

    def blocks(group: list[_Part]) -> torch.Tensor:
        fmt, first = group[0].fmt, group[0].start
        out = np.empty((slabs, group[-1].end - first, fmt.row_bytes(in_features)), dtype=np.uint8)
        for p in group:
            rows = out[:, p.start - first:p.end - first]
            direct = p.heads is None and rows.flags.c_contiguous
            raw = _read(fh, p, path, rows if direct else None).reshape(rows.shape)
            _check_scales(raw, p.fmt, path, p.name)
            if p.heads is not None:
                np.take(raw, _unpermute_rows(raw.shape[1], p.heads), axis=1, out=rows)
            elif not direct:
                rows[...] = raw
        return torch.from_numpy(out).to(device)

    if len({p.fmt.type_id for p in parts}) == 1:
        stacked = blocks(parts)
        return [GGUFWeight(stacked[e], parts[0].fmt, in_features) for e in range(slabs)]
    each = [blocks([p]) for p in parts]
    return [GGUFStack([GGUFWeight(b[e], p.fmt, in_features) for b, p in zip(each, parts, strict=True)])
            for e in range(slabs)]


def _install(model: nn.Module, name: str, weights: list[QuantizedWeight], dtype: torch.dtype,
             experts: dict[nn.Module, dict[str, list[QuantizedWeight]]], path: str) -> None:
    """Hold quantized parameter `name` as `weights`: the embedding table, a Linear's weight, or a FusedExperts'
    per-expert weights (collected into `experts` for FusedExperts.bind)."""
    from kvstrata.model.layers import Linear
    from kvstrata.model.moe import FusedExperts
    from kvstrata.model.quant.gguf_weight import GGUFEmbedding

    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    if name == EMBED:
        model.model.embed_tokens = GGUFEmbedding(weights[0], dtype)
    elif isinstance(module, Linear):
        module.set_quantized(weights[0])
    elif isinstance(module, FusedExperts):
        experts[module][attr] = weights
    else:
        raise ModelLoadError(f"{path}: tensor for {name!r} must be a float type, not {weights[0]}")


def _check_scales(raw: np.ndarray, fmt: BlockFormat, path: str, name: str) -> None:
    """Every block's float16 scale(s) must be finite: a corrupt tensor is refused rather than served as NaN."""
    blocks = raw.reshape(-1, fmt.type_size)
    offsets = {"Q6_K": (208,)}.get(fmt.name, (0, 2) if fmt.name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else (0,))
    for at in offsets:
        scales = np.ascontiguousarray(blocks[:, at:at + 2]).view(np.float16)
        if not np.isfinite(scales).all():
            raise ModelLoadError(f"{path}: tensor {name!r} is corrupt: a block's scale is not finite")
