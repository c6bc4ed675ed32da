"""Write quantized checkpoints of the tiny model's shape, following each format's definition (not the
loader's code): AWQ (GEMM), GPTQ v1 (sym / asym), FP8 (block / per-tensor); plus the de-quantized float
checkpoint of the same tensors, the numerical reference."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kvstrata.model.builtin import resolve_model_path

GROUP = 128
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
FORMATS = ["awq", "gptq-sym", "gptq-asym", "fp8-block", "fp8-tensor"]
CONFIGS = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"},
    "gptq-sym": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True},
    "gptq-asym": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False,
                  "checkpoint_format": "gptq"},
    "fp8-block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                  "weight_block_size": [128, 128]},
    "fp8-tensor": {"quant_method": "fp8", "activation_scheme": "static"},
}


def _words(values: torch.Tensor) -> torch.Tensor:
    """Eight 4-bit values along the last dim -> one int32 word (value i in bits 4i..4i+3)."""
    v = values.long().view(*values.shape[:-1], -1, 8)
    word = sum(v[..., i] << (4 * i) for i in range(8))
    return ((word + 2**31) % 2**32 - 2**31).to(torch.int32)


def _int4(w: torch.Tensor, sym: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [N, K] 0..15, scales [K/g, N] fp16, zeros [K/g, N] 0..15) of w [N, K], per group of GROUP inputs."""
    n, k = w.shape
    groups = w.view(n, k // GROUP, GROUP)
    if sym:
        scales = (groups.abs().amax(-1) / 7).clamp(min=1e-6).half()
        zeros = torch.full_like(scales, 8, dtype=torch.long)
    else:
        lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
        scales = ((hi - lo) / 15).clamp(min=1e-6).half()
        zeros = torch.round(-lo / scales.float()).clamp(1, 15).long()    # GPTQ v1 cannot store 0
    q = torch.round(groups / scales.float()[..., None] + zeros[..., None]).clamp(0, 15).long().view(n, k)
    return q, scales.t().contiguous(), zeros.t().contiguous()


def _int4_dense(q, scales, zeros) -> torch.Tensor:
    s = scales.float().t().repeat_interleave(GROUP, 1)
    z = zeros.float().t().repeat_interleave(GROUP, 1)
    return (q.float() - z) * s


def _awq(w):
    q, scales, zeros = _int4(w, sym=False)
    interleave = lambda t: t.view(*t.shape[:-1], -1, 8)[..., list(AWQ_ORDER)].flatten(-2)   # noqa: E731
    tensors = {"qweight": _words(interleave(q.t().contiguous())), "qzeros": _words(interleave(zeros)),
               "scales": scales}
    return tensors, _int4_dense(q, scales, zeros)


def _gptq(w, sym: bool):
    q, scales, zeros = _int4(w, sym)
    k = w.shape[1]
    tensors = {"qweight": _words(q.t().contiguous().view(k // 8, 8, -1).transpose(1, 2).flatten(-2)),
               "qzeros": _words(zeros - 1), "scales": scales,
               "g_idx": (torch.arange(k) // GROUP).to(torch.int32)}
    return tensors, _int4_dense(q, scales, zeros)


def _fp8(w, block: bool):
    n, k = w.shape
    if block:
        bn, bk = -(-n // 128), -(-k // 128)
        padded = torch.nn.functional.pad(w, (0, bk * 128 - k, 0, bn * 128 - n))
        scale = padded.view(bn, 128, bk, 128).abs().amax(dim=(1, 3)).clamp(min=1e-6) / 448
        expanded = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
        q = (w / expanded).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale_inv": scale.float()}, q.float() * expanded
    scale = w.abs().amax().clamp(min=1e-6) / 448
    q = (w / scale).to(torch.float8_e4m3fn)
    return ({"weight": q, "weight_scale": scale.reshape(()).float(), "input_scale": torch.tensor(0.02)},
            q.float() * scale)


def write_quantized(fmt: str, folder: Path, source: Path | None = None) -> tuple[Path, Path]:
    """(quantized checkpoint, de-quantized float32 reference) of the tiny model (or of the float checkpoint
    folder `source`), written under `folder`."""
    tiny = Path(source or resolve_model_path("tiny"))
    quant_dir, dense_dir = folder / fmt, folder / f"{fmt}-dense"
    for d in (quant_dir, dense_dir):
        shutil.copytree(tiny, d)
    weights = load_file(tiny / "model.safetensors")
    quant, dense = {}, {}
    torch.manual_seed(0)
    for name, tensor in weights.items():
        prefix, _, _ = name.rpartition(".")
        if not name.endswith(".weight") or prefix.rsplit(".", 1)[-1] not in PROJECTIONS:
            quant[name] = dense[name] = tensor
            continue
        w = tensor.float()
        if fmt == "awq":
            parts, deq = _awq(w)
        elif fmt.startswith("gptq"):
            parts, deq = _gptq(w, sym=fmt == "gptq-sym")
        else:
            parts, deq = _fp8(w, block=fmt == "fp8-block")
        quant.update({f"{prefix}.{k}": v for k, v in parts.items()})
        dense[name] = deq.contiguous()
    save_file(quant, quant_dir / "model.safetensors")
    save_file(dense, dense_dir / "model.safetensors")
    config = json.loads((tiny / "config.json").read_text())
    config["quantization_config"] = CONFIGS[fmt]
    (quant_dir / "config.json").write_text(json.dumps(config))
    return quant_dir, dense_dir


def write_float_llama(folder: Path, config: dict, seed: int = 0) -> Path:
    """A float32 Llama checkpoint of `config` (a config.json dict) with random weights (norms ones; layer outputs
    large enough that the logits depend on the whole context), written into `folder`."""
    torch.manual_seed(seed)
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    shapes = {"self_attn.q_proj": (q, hidden), "self_attn.k_proj": (kv, hidden), "self_attn.v_proj": (kv, hidden),
              "self_attn.o_proj": (hidden, q), "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
              "mlp.down_proj": (hidden, inter)}
    weights = {"model.embed_tokens.weight": torch.randn(vocab, hidden) * 0.1,
               "model.norm.weight": torch.ones(hidden), "lm_head.weight": torch.randn(vocab, hidden) * 0.1}
    for i in range(config["num_hidden_layers"]):
        for name, shape in shapes.items():
            weights[f"model.layers.{i}.{name}.weight"] = torch.randn(shape) * shape[1] ** -0.5
        for norm in ("input_layernorm", "post_attention_layernorm"):
            weights[f"model.layers.{i}.{norm}.weight"] = torch.ones(hidden)
    folder.mkdir(parents=True)
    save_file(weights, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config))
    return folder
