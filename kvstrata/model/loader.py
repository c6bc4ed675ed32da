"""Load a Hugging Face safetensors checkpoint into a LlamaForCausalLM.

The model is built on the meta device, then given uninitialised storage in the target dtype/device, and
every checkpoint tensor is copied straight into its parameter (or its row range of a fused parameter, or
its expert's slice of a stacked expert parameter): at most one checkpoint tensor is in flight, never a
second copy of the model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator

import torch
from safetensors import safe_open

from kvstrata.model.config import ModelConfig, ModelLoadError
from kvstrata.model.kv_scales import is_kv_scale
from kvstrata.model.llama import LlamaForCausalLM
from kvstrata.model.moe import bind_experts

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
LM_HEAD = "lm_head.weight"
# Buffers some exporters store that carry nothing we need (we recompute RoPE tables).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def load_model(path: str, config: ModelConfig, dtype: torch.dtype, device: torch.device,
               relayout: bool = True) -> torch.nn.Module:
    """Build the model for `config` and fill it from the safetensors files in `path`.

    `relayout`: end with `optimize_layout()` (a caller that first sets the layer kernels calls it itself).
    """
    device = torch.device(device)
    files = checkpoint_files(path)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    targets = model.checkpoint_targets()
    params = dict(model.named_parameters(remove_duplicate=False))
    filled: set[str] = set()
    for file, name, read in _checkpoint_tensors(path, files):
        if name == LM_HEAD and config.tie_word_embeddings:
            continue  # tied: lm_head is the embedding matrix whatever the file says
        if name.endswith(_IGNORED_SUFFIXES) or is_kv_scale(name):   # KV scales: model/kv_scales.py reads them
            continue
        target = targets.get(name)
        if target is None:
            raise ModelLoadError(f"{file}: unexpected tensor {name!r} for {config.architecture} "
                                 f"(is the config consistent with the weights?)")
        _copy_into(params, name, target, read(), file)
        filled.add(name)
    if config.tie_word_embeddings or LM_HEAD not in filled:
        model.tie_embeddings()
        filled.add(LM_HEAD)
    missing = sorted(set(targets) - filled)
    if missing:
        shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        raise ModelLoadError(f"{path}: checkpoint is missing tensor(s) {shown}")
    bind_experts(model)
    if relayout:
        model.optimize_layout()
    return model.eval()


DUMMY_SEED = 0
DUMMY_STD = 0.02     # transformers' usual initializer_range: activations stay finite through any depth


def load_dummy_model(config: ModelConfig, dtype: torch.dtype, device: torch.device,
                     relayout: bool = True, seed: int = DUMMY_SEED) -> torch.nn.Module:
    """The model for `config` with deterministic random weights (`--load-format dummy`): no weight files.

    Norm weights are ones, everything else uniform with std DUMMY_STD, drawn parameter by parameter in
    declaration order from one CPU generator seeded with `seed` (the same weights on every run).
    """
    device = torch.device(device)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(dtype=dtype).to_empty(device=device)
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
    bind_experts(model)
    if relayout:
        model.optimize_layout()
    return model.eval()


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
    """(file, tensor name, reader) for every tensor; a reader returns that tensor on CPU."""
    for file in files:
        full = os.path.join(path, file)
        try:
            handle = safe_open(full, framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error type for bad headers / short files
            raise ModelLoadError(f"{full}: corrupt or truncated safetensors file: {e}") from e
        with handle:
            for name in handle.keys():
                yield full, name, _reader(handle, full, name)


def _reader(handle, file: str, name: str) -> Callable[[], torch.Tensor]:
    def read() -> torch.Tensor:
        try:
            return handle.get_tensor(name)
        except Exception as e:
            raise ModelLoadError(f"{file}: cannot read tensor {name!r}: {e}") from e
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
