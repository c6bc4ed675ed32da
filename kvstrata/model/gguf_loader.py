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

Tensor parallelism (`tp`): a rank reads only its part of each tensor (`ShardLayout.cut`): its rows (one
contiguous span of each slab in the file: a head, feature or vocabulary range; llama.cpp's q/k row order is
undone within it), and with an input split (o_proj / down_proj) only the bytes of its whole blocks of each
row, at their offsets. An input split inside a block is refused from the header, before any tensor is read
(`check_block_split`). Vocabulary rows past the vocabulary (the last rank's padding) are zero. Under expert
parallelism (--ep-size) a rank reads only the slabs of the experts its placement gives it (a contiguous range
by default; expert_location.py), each whole from its offset; split inside
each expert (--tp-size alone) it reads its rows (gate, up) and whole blocks of columns (down; deterministic
mode: rows) of every slab.
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
from kvstrata.platform import huge_page_buffer, large_buffers_unmapped

if TYPE_CHECKING:
    from kvstrata.model.parallel import Cut, ShardLayout, TensorParallel
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
    `experts` > 0: this rank's slabs, the file's `expert_ids`, of a `[E, rows, K]` tensor), `row_values` values per
    row held; the file's tensor: `n_bytes` at byte `offset`, `file_rows` rows of `file_row_bytes` per slab.
    `heads`: undo llama.cpp's q/k row order; `cut`: the rank's rows and columns of it (None: all of them)."""

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
    file_rows: int
    file_row_bytes: int
    expert_ids: tuple[int, ...] = ()     # the file's slab for each of the rank's expert slots (empty: all)
    cut: Cut | None = None

    @property
    def quantized(self) -> bool:
        """Whether the tensor stays in a block format (else it is a float tensor)."""
        return self.fmt.type_id not in FLOAT_TYPES

    @property
    def shape(self) -> tuple[int, ...]:
        """The tensor's dimensions but the last (`[rows]`, `[E, rows]` for experts): its rows of bytes."""
        rows = self.end - self.start
        return (self.experts, rows) if self.experts else (rows,)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row held (a 1-D tensor: of one value): whole blocks of the rank's input columns."""
        if self.cut is None or not self.cut.splits_input:
            return self.file_row_bytes
        return self.fmt.row_bytes(self.row_values)

    def file_rows_read(self) -> tuple[np.ndarray | None, int]:
        """(the file's rows this rank holds, in the model's order: None for all of them in order; the zero rows
        after them: the last rank's vocabulary padding)."""
        order = _unpermute_rows(self.file_rows, self.heads) if self.heads is not None else None
        if self.cut is not None and self.cut.rows != slice(None):
            order = (np.arange(self.file_rows) if order is None else order)[self.cut.rows]
        held = self.file_rows if order is None else len(order)
        return order, self.end - self.start - held


@large_buffers_unmapped()
def load_gguf_model(path: str, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                    tp: TensorParallel | None = None) -> nn.Module:
    """Build the model for `config` from GGUF file `path`, every quantized tensor kept in its block format.

    A tensor whose type is not served, whose shape disagrees with the config, that the model has no place
    for, that the file lacks, whose bytes run past the end of the file or whose block scales are not finite
    is a ModelLoadError naming it. `tp`: the rank reads only its part of each tensor (module docstring); a
    split inside a quantization block is a ShardError naming the tensor, raised before any tensor is read.
    """
    from kvstrata.model.llama import LlamaForCausalLM
    from kvstrata.model.loader import to_empty
    from kvstrata.model.moe import bind_experts
    from kvstrata.model.parallel import vocab_parallel
    from kvstrata.model.quant.gguf_weight import GGUFEmbedding

    device = torch.device(device)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, tp).to(dtype=dtype)
        whole = model if model.layout.size == 1 else LlamaForCausalLM(config)   # the file's shapes
    groups, tied = _place(path, model, whole, config)
    del whole
    quantized = {name for name, parts in groups.items() if parts[0].quantized}
    for name in quantized | ({LM_HEAD} if tied else set()):
        _release(model, name)
    model = to_empty(model, device)
    params = dict(model.named_parameters(remove_duplicate=False))
    experts: dict[nn.Module, dict[str, list[QuantizedWeight]]] = defaultdict(dict)
    with open(path, "rb", buffering=0) as fh:
        for name, parts in groups.items():
            if name in quantized:
                weights = _quantized_weights(parts, fh, path, device)
                if name == EMBED:
                    table = weights[0]      # a tied lm_head shares it
                    model.model.embed_tokens = vocab_parallel(GGUFEmbedding(table, dtype), model.layout, tp)
                else:
                    _install(model, name, weights, experts, path)
            else:
                for part in parts:
                    _fill(params[name], part, _read(fh, part, path))
    for block, weights in experts.items():
        block.bind(gate_up=weights.get("gate_up_proj"), down=weights.get("down_proj"))
    if tied:      # no output.weight: the head is the embedding
        if EMBED in quantized:
            model.lm_head.set_quantized(table)
        else:
            model.tie_embeddings()
    bind_experts(model)     # the experts a float file stores
    return model.eval()


def _place(path: str, model: nn.Module, whole: nn.Module, config: ModelConfig) -> tuple[dict[str, list[_Part]], bool]:
    """(parameter of `model` -> the GGUF tensors filling it, in row order; whether lm_head is tied), from the
    header; each tensor checked against `whole`, the model without tensor parallelism."""
    header = read_header(path)
    arch = str(header.fields.get("general.architecture") or "")
    targets = whole.checkpoint_targets()
    shapes = {name: tuple(p.shape) for name, p in whole.named_parameters(remove_duplicate=False)}
    rank_targets = model.checkpoint_targets()
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
        groups[part.param].append(_rank_part(part, names, rank_targets, model.layout, path))
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
    rows = shape[-2] if len(shape) > 1 else shape[0]
    return _Part(t.name, param, start, end, experts, shape[-1] if len(shape) > 1 else 1, fmt, t.offset, t.n_bytes,
                 heads, rows, t.n_bytes // (max(experts, 1) * rows))


def _rank_part(part: _Part, names: tuple[str, ...], targets: dict[str, tuple], layout: ShardLayout,
               path: str) -> _Part:
    """`part` (placed in the model without tensor parallelism) as this rank of `layout` reads it: its experts,
    its rows and columns, placed in the rank's parameter (`targets`)."""
    if layout.size == 1:
        return part
    held = [n for n in names if layout.holds(n)]     # expert parallelism: this rank's experts
    param, start, end = targets[held[0]][:3]
    cut = layout.cut(names[0])
    row_values = part.row_values
    if cut is not None and cut.splits_input and row_values > 1:
        if part.quantized:
            layout.check_block_split(names[0], part.fmt.block_size)
        row_values = cut.cols.stop - cut.cols.start
    elif cut is not None and cut.splits_input:
        # a row-parallel bias is added once after the sum; GGUF files (_LAYER_NAMES) carry none
        raise ModelLoadError(f"{path}: tensor {part.name!r}: a bias of a row-parallel layer is not served under --tp-size")
    # the rank's slot of each expert it holds (targets' 4th field) -> the expert's slab in the file
    expert_ids = tuple(names.index(n) for n in sorted(held, key=lambda n: targets[n][3])) if part.experts else ()
    return part._replace(param=param, start=start, end=end, experts=len(held) if part.experts else 0,
                         row_values=row_values, expert_ids=expert_ids, cut=cut)


def _release(model: nn.Module, name: str) -> None:
    """Replace parameter `name` by an empty one on the meta device: it is never allocated."""
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    empty = torch.empty(0, dtype=getattr(module, attr).dtype, device="meta")
    setattr(module, attr, nn.Parameter(empty, requires_grad=False))


def _read(fh: BinaryIO, part: _Part, path: str, out: np.ndarray | None = None) -> np.ndarray:
    """This rank's bytes of `part` as uint8 `[*part.shape, part.row_bytes]` (its slabs; its rows in the model's
    order, then zero padding rows; its blocks of each row), read into `out` (each slab C-contiguous) when
    given. Only those bytes are read: a span of whole rows per slab, or each row's blocks at their offset."""
    if out is None:
        out = np.empty((*part.shape, part.row_bytes), dtype=np.uint8)
    order, padding = part.file_rows_read()
    slab_bytes = part.file_rows * part.file_row_bytes
    held = part.end - part.start - padding
    for s, slab in enumerate(out.reshape(-1, *out.shape[-2:]) if part.experts else [out.reshape(-1, out.shape[-1])]):
        base = part.offset + (part.expert_ids[s] if part.expert_ids else s) * slab_bytes
        if padding:
            slab[held:] = 0
        if part.row_bytes != part.file_row_bytes:        # an input split: each row's whole blocks
            skip = part.fmt.row_bytes(part.cut.cols.start)
            for i, row in enumerate(range(part.file_rows) if order is None else order.tolist()):
                _read_at(fh, slab[i], base + row * part.file_row_bytes + skip, path, part.name)
            continue
        first = 0 if order is None else int(order.min())
        in_order = order is None or _is_range(order)
        span = slab[:held] if in_order else np.empty((held, part.row_bytes), np.uint8)
        _read_at(fh, span, base + first * part.file_row_bytes, path, part.name)
        if not in_order:      # llama.cpp's q/k rows: the rank's heads are one span, reordered within it
            np.take(span, order - first, axis=0, out=slab[:held])
    return out


def _is_range(order: np.ndarray) -> bool:
    """Whether `order` is consecutive increasing rows (read straight into place)."""
    return bool((np.diff(order) == 1).all())


def _read_at(fh: BinaryIO, out: np.ndarray, offset: int, path: str, name: str) -> None:
    """Fill C-contiguous `out` with the file's bytes at `offset`; a short file is a ModelLoadError naming `name`."""
    view = memoryview(out).cast("B")
    fh.seek(offset)
    done = 0
    while done < len(view):
        got = fh.readinto(view[done:])
        if not got:
            raise ModelLoadError(f"{path}: tensor {name!r} is truncated")
        done += got


def _unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's q/k permutation (transformers' reverse_permute_weights)."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(0, 2, 1).reshape(-1)


def _fill(dest: torch.Tensor, part: _Part, raw: np.ndarray) -> None:
    """Copy float tensor `part` (its bytes `raw`) into its rows of parameter `dest`, converting to its dtype."""
    values = float_values(torch.from_numpy(raw), part.fmt)      # [*shape, K] in the file's float type (q/k reordered)
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
        # Page-aligned (or torch's 64 bytes; numpy's large buffers sit 16 bytes past a page), so the kernels'
        # block rows start on cache lines: a 1B Q4_K_M cold 2048-token prefill 4.10 -> 3.81 s (one run each);
        # on huge pages where the kernel allows (platform.huge_page_buffer: decode streams them).
        shape = (slabs, group[-1].end - first, fmt.row_bytes(in_features))
        region = huge_page_buffer(math.prod(shape)) if device.type == "cpu" else None
        held = (torch.frombuffer(region, dtype=torch.uint8).view(shape) if region is not None
                else torch.empty(shape, dtype=torch.uint8))
        out = held.numpy()
        for p in group:
            rows = out[:, p.start - first:p.end - first]
            _read(fh, p, path, rows if p.experts else rows[0])
            _check_scales(rows, p.fmt, path, p.name)
        return held.to(device)

    if len({p.fmt.type_id for p in parts}) == 1:
        stacked = blocks(parts)
        return [GGUFWeight(stacked[e], parts[0].fmt, in_features) for e in range(slabs)]
    each = [blocks([p]) for p in parts]
    return [GGUFStack([GGUFWeight(b[e], p.fmt, in_features) for b, p in zip(each, parts, strict=True)])
            for e in range(slabs)]


def _install(model: nn.Module, name: str, weights: list[QuantizedWeight],
             experts: dict[nn.Module, dict[str, list[QuantizedWeight]]], path: str) -> None:
    """Hold quantized parameter `name` as `weights`: a Linear's weight, or a FusedExperts' per-expert weights
    (collected into `experts` for FusedExperts.bind)."""
    from kvstrata.model.layers import Linear
    from kvstrata.model.moe import FusedExperts

    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    if isinstance(module, Linear):
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
