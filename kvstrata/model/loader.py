"""Load a Hugging Face safetensors checkpoint into a LlamaForCausalLM.

The model is built on the meta device, then given uninitialised storage in the target dtype/device, and
every checkpoint tensor is copied straight into its parameter (or its row range of a fused parameter, or
its expert's slice of a stacked expert parameter): at most one checkpoint tensor is in flight, never a
second copy of the model. Quantized layers (AWQ, GPTQ, FP8 checkpoints; `--quantization int8`) never get
float storage: their tensors go to quant/checkpoint.py, which builds each Linear's QuantizedWeight.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import Optional

import torch

from kvstrata.model.config import ModelConfig, ModelLoadError, check_no_missing_tensors
from kvstrata.model.kv_scales import is_kv_scale
from kvstrata.model.llama import LlamaForCausalLM
from kvstrata.model.moe import bind_experts
from kvstrata.model.parallel import TensorParallel
from kvstrata.model.quant.checkpoint import QuantizedLinears, quantize_int8_in_place
from kvstrata.model.quant.scheme import (
    CHECKPOINT_METHODS,
    QuantizationError,
    checkpoint_quantization,
    quant_spec,
)
from kvstrata.platform import large_buffers_unmapped

SAFETENSORS_METHODS = (*CHECKPOINT_METHODS, "int8")   # what this loader quantizes or reads quantized

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
LM_HEAD = "lm_head.weight"
# Buffers some exporters store that carry nothing we need (we recompute RoPE tables).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


@large_buffers_unmapped()
def load_model(path: str, config: ModelConfig, dtype: torch.dtype, device: torch.device,
               relayout: bool = True, tp: TensorParallel | None = None,
               quantization: Optional[str] = None) -> torch.nn.Module:
    """Build the model for `config` and fill it from the safetensors files in `path`.

    `relayout`: end with `optimize_layout()` (a caller that first sets the layer kernels calls it itself).
    `tp`: a tensor-parallel rank: each tensor is cut to the rank's shard (`model.layout.shard`) as it is read.
    `quantization`: the method ServerArgs resolved (quant/scheme.py): awq, gptq and fp8 checkpoints' layers
    are held in their format, int8 quantizes a float checkpoint's layers as they are read (quant/checkpoint.py);
    None or gguf (already converted to a float folder here) load the float weights.
    """
    device = torch.device(device)
    files = checkpoint_files(path)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, tp)
    targets = model.checkpoint_targets()
    quantized = _quantized_linears(path, files, quantization, model, targets, dtype, device)
    model = to_empty(model.to(dtype=dtype), device)
    params = dict(model.named_parameters(remove_duplicate=False))
    filled: set[str] = set()
    for file, name, read in _checkpoint_tensors(path, files):
        if name == LM_HEAD and config.tie_word_embeddings:
            continue  # tied: lm_head is the embedding matrix whatever the file says
        if name.endswith(_IGNORED_SUFFIXES) or is_kv_scale(name) or not model.layout.holds(name):
            continue     # not needed, read by model/kv_scales.py, or another tensor-parallel rank's expert
        if quantized is not None and quantized.claims(name):
            filled.update(quantized.add(name, read(), file))
            continue
        target = targets.get(name)
        if target is None:
            raise ModelLoadError(f"{file}: unexpected tensor {name!r} for {config.architecture} "
                                 f"(is the config consistent with the weights?)")
        _copy_into(params, name, target, model.layout.shard(name, read()), file)
        filled.add(name)
    if config.tie_word_embeddings or LM_HEAD not in filled:
        model.tie_embeddings()
        filled.add(LM_HEAD)
    if quantized is not None:
        quantized.check_complete(path)
    check_no_missing_tensors(targets, filled, f"{path}: checkpoint")
    bind_experts(model)
    if relayout:
        model.optimize_layout()
    return model.eval()


def _quantized_linears(path: str, files: list[str], quantization: Optional[str], model: torch.nn.Module,
                       targets: dict[str, tuple], dtype: torch.dtype, device: torch.device) -> Optional[QuantizedLinears]:
    """The quantized projections of this load (their float weights released before allocation), or None."""
    if quantization not in SAFETENSORS_METHODS:
        return None
    try:
        spec = quant_spec(quantization, checkpoint_quantization(path), path)
    except QuantizationError as e:
        raise ModelLoadError(str(e)) from None
    names = [name for _, name, _ in _checkpoint_tensors(path, files)]
    return QuantizedLinears(spec, model, targets, names, dtype, device)


DUMMY_SEED = 0
DUMMY_STD = 0.02     # transformers' usual initializer_range: activations stay finite through any depth


def load_dummy_model(config: ModelConfig, dtype: torch.dtype, device: torch.device,
                     relayout: bool = True, seed: int = DUMMY_SEED,
                     tp: TensorParallel | None = None, quantization: Optional[str] = None) -> torch.nn.Module:
    """The model for `config` with deterministic random weights (`--load-format dummy`): no weight files.

    Norm weights are ones, everything else uniform with std DUMMY_STD, drawn parameter by parameter in
    declaration order from one CPU generator seeded with `seed` (the same weights on every run). A
    tensor-parallel rank (`tp`) holds its shard of the same weights. `quantization` int8: the layers are then
    quantized in place (the float model is whole in memory first; a rank quantizes its shard as it is cut).
    """
    if tp is not None and tp.size > 1:
        return _shard_of_dummy(config, dtype, device, relayout, seed, tp, quantization)
    model = _draw_dummy(config, dtype, torch.device(device), seed)
    bind_experts(model)
    if quantization == "int8":
        quantize_int8_in_place(model, dtype)
    if relayout:
        model.optimize_layout()
    return model.eval()


def _draw_dummy(config: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int) -> torch.nn.Module:
    """The one-rank model of `config` with load_dummy_model's weights drawn, its experts still stacked (unbound)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = to_empty(model.to(dtype=dtype), device)
    if config.tie_word_embeddings:
        model.tie_embeddings()
    generator = torch.Generator().manual_seed(seed)
    half_width = DUMMY_STD * 3.0 ** 0.5
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                values = torch.rand(param.shape, generator=generator, dtype=torch.float32) * 2 - 1
                param.copy_(values.mul_(half_width))
    return model


def to_empty(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`model.to_empty(device=device)` (a meta model given uninitialised storage), without importing sympy.

    torch.empty_like of a meta tensor runs torch's Python reference, which imports torch.fx's symbolic shapes
    and with them sympy: ~32 MB that would stay resident in every scheduler. torch.empty_strided allocates the
    same shape, strides and dtype without it.
    """
    return model._apply(lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device))


def checkpoint_files(path: str) -> list[str]:
    """Safetensors files of a checkpoint: the index's shards, else model.safetensors, else any *.safetensors."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {e}") from e
        files = sorted(set(weight_map.values()))
        absent = [f for f in files if not os.path.isfile(os.path.join(path, f))]
        if absent:
            raise ModelLoadError(f"{index} names shard(s) that do not exist: {', '.join(absent)}")
        return files
    if os.path.isfile(os.path.join(path, SINGLE_FILE)):
        return [SINGLE_FILE]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors")) if os.path.isdir(path) else []
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights found (only safetensors checkpoints load; "
                             f"--load-format dummy runs the model's shape on random weights)")
    return files


def _checkpoint_tensors(path: str, files: list[str]) -> Iterator[tuple[str, str, Callable[[], torch.Tensor]]]:
    """(file, tensor name, reader) for every tensor; a reader returns that tensor on CPU.

    Tensors are read with plain file reads, not through a memory map: the pages of a mapped file count in
    the process's RSS while it stays mapped, which would double the peak RSS of a load (the whole file
    mapped next to the weights copied out of it).
    """
    for file in files:
        full = os.path.join(path, file)
        header, data_start = _read_header(full)
        with open(full, "rb") as fh:
            for name, entry in header.items():
                yield full, name, _reader(fh, full, name, entry, data_start)


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _read_header(file: str) -> tuple[dict, int]:
    """(name -> {dtype, shape, data_offsets}, offset of the data) of a safetensors file, every entry checked
    against the file's size."""
    def corrupt(why: str) -> ModelLoadError:
        return ModelLoadError(f"{file}: corrupt or truncated safetensors file: {why}")
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as fh:
            length = int.from_bytes(fh.read(8), "little")
            if length <= 0 or 8 + length > size:
                raise corrupt(f"header length {length} does not fit a {size}-byte file")
            header = json.loads(fh.read(length))
    except (OSError, ValueError) as e:
        raise corrupt(str(e)) from e
    if not isinstance(header, dict):
        raise corrupt("the header is not a JSON object")
    header.pop("__metadata__", None)
    data_bytes = size - 8 - length
    for name, entry in header.items():
        try:
            start, end = entry["data_offsets"]
            count = 1
            for dim in entry["shape"]:
                count *= int(dim)
            itemsize = torch.empty(0, dtype=_DTYPES[entry["dtype"]]).element_size()
        except (KeyError, TypeError, ValueError) as e:
            raise corrupt(f"bad entry for {name!r}: {e}") from e
        if not 0 <= start <= end <= data_bytes or end - start != count * itemsize:
            raise corrupt(f"tensor {name!r} lies at bytes {start}..{end} of {data_bytes}")
    return header, 8 + length


def _reader(fh, file: str, name: str, entry: dict, data_start: int) -> Callable[[], torch.Tensor]:
    def read() -> torch.Tensor:
        start, end = entry["data_offsets"]
        dtype, shape = _DTYPES[entry["dtype"]], [int(d) for d in entry["shape"]]
        if end == start:
            return torch.empty(shape, dtype=dtype)
        buffer = bytearray(end - start)
        try:
            fh.seek(data_start + start)
            if fh.readinto(buffer) != len(buffer):
                raise OSError("short read")
        except OSError as e:
            raise ModelLoadError(f"{file}: cannot read tensor {name!r}: {e}") from e
        return torch.frombuffer(buffer, dtype=dtype).view(shape)
    return read


def _copy_into(params: dict[str, torch.nn.Parameter], name: str, target: tuple,
               tensor: torch.Tensor, file: str) -> None:
    """Copy `tensor` into rows [start, end) of its parameter (of expert `target[3]`'s slice, if given)."""
    param_name, start, end, *expert = target
    dest = params[param_name].data
    dest = (dest[expert[0]] if expert else dest)[start:end]
    if tuple(tensor.shape) != tuple(dest.shape):
        raise ModelLoadError(f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(dest.shape)}")
    dest.copy_(tensor)


def _shard_of_dummy(config: ModelConfig, dtype: torch.dtype, device: torch.device, relayout: bool, seed: int,
                    tp: TensorParallel, quantization: Optional[str]) -> torch.nn.Module:
    """A rank's shard of the one-rank dummy model: that model is drawn whole on CPU, then read back tensor by
    tensor under its checkpoint names and cut like a checkpoint (so every TP size serves the same weights;
    int8 layers are quantized as a checkpoint's are). Its experts stay stacked: they are read like the others."""
    whole = _draw_dummy(config, dtype, torch.device("cpu"), seed)
    whole_params = dict(whole.named_parameters(remove_duplicate=False))
    whole_targets = whole.checkpoint_targets()
    with torch.device("meta"):
        model = LlamaForCausalLM(config, tp)
    targets = model.checkpoint_targets()
    quantized = (QuantizedLinears(quant_spec("int8", None, "dummy weights"), model, targets, whole_targets, dtype,
                                  device) if quantization == "int8" else None)
    model = to_empty(model.to(dtype=dtype), torch.device(device))
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, (param_name, start, end, *expert) in whole_targets.items():
        if (name == LM_HEAD and config.tie_word_embeddings) or not model.layout.holds(name):
            continue
        tensor = whole_params[param_name].data
        tensor = (tensor[expert[0]] if expert else tensor)[start:end]
        if quantized is not None and quantized.claims(name):
            quantized.add(name, tensor, "dummy weights")
            continue
        _copy_into(params, name, targets[name], model.layout.shard(name, tensor), "dummy weights")
    if config.tie_word_embeddings:
        model.tie_embeddings()
    bind_experts(model)
    if relayout:
        model.optimize_layout()
    return model.eval()
