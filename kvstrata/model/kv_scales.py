"""Per-layer FP8 KV scales from a checkpoint, under the tensor names vLLM and SGLang read.

    model.layers.{i}.self_attn.k_scale / .v_scale            (llm-compressor, ModelOpt; also .attn.k_scale)
    model.layers.{i}.self_attn.kv_scale                      (older exports: one scale for K and V)
    model.layers.{i}.self_attn.k_proj.output_scale / v_proj  (AutoFP8, compressed-tensors)

Each is one number (a scalar or a one-element tensor). A layer without one gets 1.0, as in SGLang: values are
then stored as they are, so K/V entries beyond the format's range (448 for e4m3) saturate and small ones
lose relative precision (memory/kv_format.py). The loader skips these tensors (`is_kv_scale`).
"""

from __future__ import annotations

import os
import re
from typing import Optional

from safetensors import safe_open

from kvstrata.model.config import ModelLoadError

_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:attn\.)?(?:(k|v|kv)_scale|(k|v)_proj\.output_scale)$")


def is_kv_scale(name: str) -> bool:
    """Whether a checkpoint tensor is a KV cache scale (not a weight of the model)."""
    return _NAME.match(name) is not None


def read_kv_scales(path: str, files: list[str], num_layers: int
                   ) -> Optional[tuple[tuple[float, ...], tuple[float, ...]]]:
    """(K scales, V scales) per layer from the checkpoint `files` in `path`, 1.0 where a layer has none;
    None when the checkpoint has no KV scale at all."""
    k, v = [1.0] * num_layers, [1.0] * num_layers
    found = False
    for file in files:
        full = os.path.join(path, file)
        with safe_open(full, framework="pt", device="cpu") as handle:
            for name in handle.keys():
                match = _NAME.match(name)
                if match is None:
                    continue
                layer, which = int(match.group(1)), match.group(2) or match.group(3)
                if layer >= num_layers:
                    raise ModelLoadError(f"{full}: {name!r} names layer {layer} of a {num_layers}-layer model")
                value = handle.get_tensor(name)
                if value.numel() != 1:
                    raise ModelLoadError(f"{full}: {name!r} has {value.numel()} values; only one KV scale per "
                                         "layer is supported")
                scale = float(value.float().reshape(()))
                if not scale > 0 or scale == float("inf"):
                    raise ModelLoadError(f"{full}: {name!r} is {scale}; a KV scale must be a positive number")
                if which in ("k", "kv"):
                    k[layer] = scale
                if which in ("v", "kv"):
                    v[layer] = scale
                found = True
    return (tuple(k), tuple(v)) if found else None
