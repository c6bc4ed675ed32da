"""Which quantization a server runs: `--quantization` checked against the checkpoint (torch-free).

    checkpoint                      no flag            --quantization X
    safetensors, quantization_config  its quant_method   X must equal it (else a start-up error naming both)
    safetensors, plain float          None (dense)       int8 (quantized at load); anything else is an error
    a .gguf file                      gguf               gguf; anything else is an error
    --load-format dummy               None (dense)       int8; anything else is an error (random weights are dense)

The checkpoint's parameters are checked here too (`quant_spec`), so an AWQ GEMV-layout or 3-bit GPTQ folder
is refused at start-up with the reason, before any weight is read. SGLang's method names.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

METHODS = ["awq", "gptq", "fp8", "gguf", "int8"]
CHECKPOINT_METHODS = ("awq", "gptq", "fp8")   # read from safetensors checkpoints' quantization_config
INT4_GROUP_SIZES = (32, 64, 128, 256)          # what torch's CPU int4 kernel takes


class QuantizationError(ValueError):
    """`--quantization` does not fit the checkpoint, or the checkpoint's quantization is not supported."""


@dataclass(frozen=True)
class QuantSpec:
    """A checkpoint's quantization, as the loader needs it.

    `group_size`: input channels per int4 scale (AWQ/GPTQ); `zero_offset`: what GPTQ v1 checkpoints store
    less than the zero point (1; 0 for AWQ and GPTQ v2); `block`: FP8 scale block `(out, in)`, None for one
    scale per tensor.
    """

    method: str
    group_size: int = 0
    zero_offset: int = 0
    block: Optional[tuple[int, int]] = None

    def input_block(self) -> int:
        """Consecutive input values sharing a scale: where a tensor-parallel split of the input may fall."""
        if self.method in ("awq", "gptq"):
            return self.group_size
        if self.method == "fp8" and self.block is not None:
            return self.block[1]
        return 1      # int8 and per-tensor FP8: one scale per output row


def checkpoint_quantization(model_path: str) -> Optional[dict]:
    """The `quantization_config` of a checkpoint folder's config.json (None: none, or not a folder)."""
    config = os.path.join(model_path, "config.json")
    if not os.path.isfile(config):
        return None
    try:
        with open(config, encoding="utf-8") as fh:
            raw = json.load(fh)
    except (OSError, ValueError) as e:
        raise QuantizationError(f"{config} is not valid JSON: {e}") from None
    found = raw.get("quantization_config") if isinstance(raw, dict) else None
    return found if isinstance(found, dict) else None


def effective_quantization(flag: Optional[str], model_path: str, load_format: str, is_gguf: bool) -> Optional[str]:
    """The method this server runs (None: dense weights), per the module's table; raises QuantizationError."""
    if is_gguf:
        if flag not in (None, "gguf"):
            raise QuantizationError(f"--quantization {flag} does not fit {model_path}: a GGUF file is quantized "
                                    f"by its own tensor types (use --quantization gguf, or no flag)")
        return "gguf"
    if flag == "gguf":
        raise QuantizationError(f"--quantization gguf needs a .gguf file as --model-path, got {model_path!r}")
    if load_format == "dummy":
        if flag not in (None, "int8"):
            raise QuantizationError(f"--quantization {flag} does not fit --load-format dummy: random weights are "
                                    f"dense (only --quantization int8, which quantizes them at load, applies)")
        return flag
    config = checkpoint_quantization(model_path)
    method = None if config is None else str(config.get("quant_method", "")).lower()
    if method is None:
        if flag in (None, "int8"):
            return flag
        raise QuantizationError(f"--quantization {flag} does not fit {model_path}: the checkpoint is not quantized "
                                f"(its config.json has no quantization_config; --quantization int8 quantizes a "
                                f"float checkpoint at load)")
    if method not in CHECKPOINT_METHODS:
        raise QuantizationError(f"{model_path}: quant_method {method!r} is not supported (supported: "
                                f"{', '.join(CHECKPOINT_METHODS)})")
    if flag is not None and flag != method:
        raise QuantizationError(f"--quantization {flag} does not fit {model_path}: the checkpoint is quantized "
                                f"with {method} (its config.json's quantization_config); use --quantization "
                                f"{method}, or no flag")
    quant_spec(method, config, model_path)   # its parameters are refused here, at start-up
    return method


def quant_spec(method: str, config: Optional[dict], source: str) -> QuantSpec:
    """The QuantSpec of `method` with the checkpoint's `quantization_config`; raises QuantizationError for
    parameters the loader does not implement."""
    config = config or {}
    if method == "int8":
        return QuantSpec("int8")
    if method in ("awq", "gptq"):
        return _int4_spec(method, config, source)
    if method == "fp8":
        return _fp8_spec(config, source)
    raise QuantizationError(f"{source}: no safetensors loader for quantization {method!r}")


def _refuse(source: str, what: str) -> QuantizationError:
    return QuantizationError(f"{source}: {what} is not supported")


def _int4_spec(method: str, config: dict, source: str) -> QuantSpec:
    bits = int(config.get("bits", config.get("w_bit", 0)))
    group = int(config.get("group_size", config.get("q_group_size", 0)))
    if bits != 4:
        raise _refuse(source, f"{method} with {bits} bits (only 4)")
    if group not in INT4_GROUP_SIZES:
        raise _refuse(source, f"{method} group_size {group} (only {', '.join(map(str, INT4_GROUP_SIZES))})")
    if method == "awq":
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise _refuse(source, f"AWQ version {version!r} (only the GEMM layout)")
        if config.get("zero_point") is False:
            raise _refuse(source, "AWQ without zero points")
        return QuantSpec("awq", group_size=group)
    if config.get("desc_act"):
        raise _refuse(source, "GPTQ with desc_act=true (act-order)")
    fmt = str(config.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse(source, f"GPTQ checkpoint_format {fmt!r}")
    return QuantSpec("gptq", group_size=group, zero_offset=1 if fmt == "gptq" else 0)


def _fp8_spec(config: dict, source: str) -> QuantSpec:
    fmt = str(config.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise _refuse(source, f"FP8 format {fmt!r} (only e4m3)")
    block = config.get("weight_block_size")
    if block is None:
        return QuantSpec("fp8")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise QuantizationError(f"{source}: weight_block_size must be two positive integers, got {block!r}")
    return QuantSpec("fp8", block=(block[0], block[1]))
