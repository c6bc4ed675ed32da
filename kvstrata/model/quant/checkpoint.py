"""Quantized Linears filled from a safetensors checkpoint (loader.py's side of a quantized load).

    plan     from the checkpoint's tensor names (before any weight is read): which projections are
             quantized, which fused Linear (and row range of it) each fills; those Linears' float weights
             are released on the meta device, so they are never allocated
    add      a projection's tensors are gathered as they stream past, decoded into the format's parts
             (int4 values + group scales and zero points, e4m3 + row scales, int8 + row scales), and cut
             to a tensor-parallel rank's rows or input columns (model.layout.cut) with their scales
    build    once every projection of a Linear has arrived, the parts are concatenated along the output
             dimension (q|k|v, gate|up: groups run along the input dimension, so any split of the output
             rows concatenates) into its one QuantizedWeight, and the parts are dropped

Under tensor parallelism an input split (o_proj, down_proj) must fall on a block boundary of the format
(`QuantSpec.input_block`): the plan refuses, before any weight is read, a checkpoint whose groups it would
cut. At most the parts of the Linears still being assembled are in flight (a rank reads each projection
whole, then keeps its cut). Quantized MoE experts are refused (the stacked expert weights have no quantized
layout yet); `--quantization int8` leaves them in --dtype.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

import torch
from torch import nn

from kvstrata.model.config import ModelLoadError
from kvstrata.model.layers import Linear
from kvstrata.model.parallel import Cut
from kvstrata.model.quant import awq, fp8, gptq, int4, int8
from kvstrata.model.quant.base import QuantizedWeight
from kvstrata.model.quant.int4 import Int4Weight
from kvstrata.model.quant.scheme import QuantSpec

LAYERS = "model.layers."
# Tensors of one projection `P` by format: (the names that mark P as quantized, all P.* it may have, the
# ones it must have).
_KINDS = {
    "awq": (("qweight",), awq.TENSORS, awq.TENSORS),
    "gptq": (("qweight",), gptq.TENSORS + gptq.OPTIONAL, gptq.TENSORS),
    "fp8": (fp8.SCALE_NAMES, ("weight", *fp8.SCALE_NAMES, *fp8.OPTIONAL), ("weight",)),
    "int8": (("weight",), ("weight",), ("weight",)),
}


class QuantizedLinears:
    """The quantized projections of one checkpoint load; see the module docstring."""

    def __init__(self, spec: QuantSpec, model: nn.Module, targets: dict[str, tuple], names: Iterable[str],
                 dtype: torch.dtype, device: torch.device):
        self.spec, self.dtype, self.device = spec, dtype, torch.device(device)
        self.layout = model.layout
        marker, self.kinds, required = _KINDS[spec.method]
        names = list(names)
        prefixes = (self._int8_prefixes(model, targets) if spec.method == "int8"
                    else {n.rsplit(".", 1)[0] for n in names if n.rsplit(".", 1)[-1] in marker})
        self.present: dict[str, set[str]] = {p: set() for p in prefixes}   # prefix -> its tensor kinds
        for n in names:
            prefix, _, kind = n.rpartition(".")
            if prefix in self.present and kind != "bias":
                self.present[prefix].add(kind)
        self.projections: dict[str, tuple[str, int, int]] = {}   # prefix -> (Linear path, first row, end row)
        for prefix in sorted(prefixes):
            lacking = [f"{prefix}.{k}" for k in required if k not in self.present[prefix]]
            if lacking:
                raise ModelLoadError(f"checkpoint is missing quantized tensor(s) {', '.join(lacking)} "
                                     f"({spec.method})")
            target = targets.get(f"{prefix}.weight")
            if target is None:
                raise ModelLoadError(f"quantized tensors {prefix}.* do not belong to any layer of this model")
            if len(target) > 3:
                raise ModelLoadError(f"{prefix}: quantized MoE expert weights ({spec.method}) are not supported")
            self.projections[prefix] = (target[0].rsplit(".", 1)[0], target[1], target[2])
            self.layout.check_block_split(f"{prefix}.weight", spec.input_block())
        self.linears: dict[str, Linear] = {}
        self.parts: dict[str, dict[int, tuple]] = {}       # Linear path -> {first row: decoded part}
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        self._check_whole_linears(model, targets)

    def _int8_prefixes(self, model: nn.Module, targets: dict[str, tuple]) -> set[str]:
        """Every projection of a Linear in the decoder layers except MoE routers (kept exact: they pick experts)."""
        from kvstrata.model.moe import SparseMoeBlock

        routers = {id(m.gate) for m in model.modules() if isinstance(m, SparseMoeBlock)}
        routers |= {id(m.shared_expert_gate) for m in model.modules() if isinstance(m, SparseMoeBlock)}
        prefixes = set()
        for name, target in targets.items():
            if not name.endswith(".weight") or len(target) > 3 or not target[0].startswith(LAYERS):
                continue
            module = model.get_submodule(target[0].rsplit(".", 1)[0])
            if isinstance(module, Linear) and id(module) not in routers:
                prefixes.add(name[:-len(".weight")])
        return prefixes

    def _check_whole_linears(self, model: nn.Module, targets: dict[str, tuple]) -> None:
        """Every projection of a quantized fused Linear must be quantized; release their float weights."""
        paths = {path for path, _, _ in self.projections.values()}
        for name, target in targets.items():
            path = target[0].rsplit(".", 1)[0]
            if path in paths and name.endswith(".weight") and name[:-len(".weight")] not in self.projections:
                raise ModelLoadError(f"{name} is not quantized but shares its fused layer {path} with quantized "
                                     f"projections")
        for path in paths:
            linear = model.get_submodule(path)
            if not isinstance(linear, Linear):
                raise ModelLoadError(f"{path} is not a linear layer: it cannot hold a quantized weight")
            self.linears[path] = linear
            self.parts[path] = {}
            linear.weight = nn.Parameter(torch.empty(0, dtype=linear.weight.dtype, device="meta"),
                                         requires_grad=False)

    def claims(self, name: str) -> bool:
        """Whether checkpoint tensor `name` is one of a quantized projection's (its bias is not)."""
        prefix, _, kind = name.rpartition(".")
        return prefix in self.projections and kind != "bias"

    def add(self, name: str, tensor: torch.Tensor, file: str) -> list[str]:
        """Take one claimed tensor; returns the HF weight names this completes (a whole Linear built)."""
        prefix, _, kind = name.rpartition(".")
        if kind not in self.kinds:
            raise ModelLoadError(f"{file}: unexpected tensor {name!r} for a {self.spec.method} projection "
                                 f"(expected {', '.join(prefix + '.' + k for k in self.kinds)})")
        tensors = self.pending.setdefault(prefix, {})
        tensors[kind] = tensor
        if set(tensors) != self.present[prefix]:
            return []
        del self.pending[prefix]
        path, start, end = self.projections[prefix]
        part = self._decode(tensors, prefix, self.layout.cut(f"{prefix}.weight"))
        if part[0].shape[0] != end - start:
            raise ModelLoadError(f"{file}: {prefix} has {part[0].shape[0]} output rows, expected {end - start}")
        self.parts[path][start] = part
        return self._build_if_complete(path)

    def _decode(self, tensors: dict[str, torch.Tensor], prefix: str, cut: Optional[Cut]) -> tuple[torch.Tensor, ...]:
        """The format's parts of one projection; `cut`: this tensor-parallel rank's rows or columns of them."""
        spec = self.spec
        if spec.method == "int8":
            return int8.quantize(tensors["weight"], cut)
        if spec.method == "awq":
            parts, shard = awq.decode(tensors, prefix, spec.group_size), int4.shard
        elif spec.method == "gptq":
            parts, shard = gptq.decode(tensors, prefix, spec.group_size, spec.zero_offset), int4.shard
        else:
            parts, shard = fp8.decode(tensors, prefix, spec.block), fp8.shard
        return parts if cut is None else shard(parts, cut)

    def _build_if_complete(self, path: str) -> list[str]:
        mine = sorted((start, end, prefix) for prefix, (p, start, end) in self.projections.items() if p == path)
        parts = self.parts[path]
        if set(parts) != {start for start, _, _ in mine}:
            return []
        linear = self.linears[path]
        ordered = [parts[start] for start, _, _ in mine]
        if any(p[0].shape[1] != linear.in_features for p in ordered):
            raise ModelLoadError(f"{path}: quantized weights have {ordered[0][0].shape[1]} input channels, the "
                                 f"layer has {linear.in_features}")
        linear.set_quantized(self._build(ordered))
        del self.parts[path]
        return [f"{prefix}.weight" for _, _, prefix in mine]

    def _build(self, parts: list[tuple[torch.Tensor, ...]]) -> QuantizedWeight:
        """The fused QuantizedWeight of a Linear's parts in output-row order."""
        def cat(i: int, dim: int) -> torch.Tensor:
            return parts[0][i] if len(parts) == 1 else torch.cat([p[i] for p in parts], dim=dim)

        method = self.spec.method
        if method in ("awq", "gptq"):
            return Int4Weight(cat(0, 0), cat(1, 1), cat(2, 1), self.dtype, self.device)
        if method == "fp8":
            return fp8.Fp8Weight(cat(0, 0), cat(1, 0), self.device)
        return int8.Int8Weight(cat(0, 0), cat(1, 0), self.dtype, self.device)

    def check_complete(self, path: str) -> None:
        """Raise naming the tensors of quantized projections that the checkpoint at `path` lacked."""
        if not self.parts:
            return
        missing = []
        for prefix, (linear, start, _) in sorted(self.projections.items()):
            if linear in self.parts and start not in self.parts[linear]:
                have = set(self.pending.get(prefix, {}))
                missing += [f"{prefix}.{k}" for k in sorted(self.present[prefix] - have)] or [f"{prefix}.*"]
        shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        raise ModelLoadError(f"{path}: checkpoint is missing quantized tensor(s) {shown}")


def quantize_int8_in_place(model: nn.Module, dtype: torch.dtype) -> None:
    """`--quantization int8` on weights already in memory (dummy weights): each decoder-layer Linear's weight
    replaced by its int8 form (the float weight is released as each is converted)."""
    from kvstrata.model.moe import SparseMoeBlock

    routers = {id(m.gate) for m in model.modules() if isinstance(m, SparseMoeBlock)}
    routers |= {id(m.shared_expert_gate) for m in model.modules() if isinstance(m, SparseMoeBlock)}
    for name, module in model.named_modules():
        if (isinstance(module, Linear) and name.startswith(LAYERS) and id(module) not in routers
                and module.quantized is None and module.weight.numel() and ".experts." not in name):
            q, scales = int8.quantize(module.weight.detach().cpu())
            module.set_quantized(int8.Int8Weight(q, scales, dtype, module.weight.device))
