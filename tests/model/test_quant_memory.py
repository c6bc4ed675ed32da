"""One copy of every weight: the bf16 product path each CPU kind takes (from the runtime's probes) holds each
weight once, whatever the CPU; `--quantization int8` halves the layers' weights in a server's peak RSS."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from kvstrata import platform
from kvstrata.model.layers import Linear, onednn_weights_apply, use_decode_linear, use_onednn_weights
from kvstrata.model.paged_kernels import DecodeLinear, decode_linear_variant
from tests.cpu_kinds import KINDS

# kind: (the GEMV variant in the default mode, in deterministic mode)
VARIANTS = {"zen3": ("packed", "packed"), "zen4": ("row_major", "row_major"), "xeon": ("row_major", "amx")}


@pytest.fixture(params=sorted(KINDS))
def kind(request, monkeypatch) -> str:
    monkeypatch.setattr(platform, "cpu_flags_line", lambda: KINDS[request.param])
    return request.param


def _fake_gemv(variant: str) -> DecodeLinear:
    """A torch stand-in with the variant's storage contract: "row_major" reads the weight itself (decode rows
    by default), the others a packed copy (every row count)."""
    def run(x, packed, bias, n):
        return F.linear(x, packed.view(n, -1), bias)
    if variant == "row_major":
        return DecodeLinear(lambda w: w, run, 64)
    return DecodeLinear(lambda w: w.clone(), run, None)


def _model() -> torch.nn.ModuleList:
    """Two layers' worth of Linears and a tied lm_head over an embedding, bf16."""
    embedding = torch.nn.Embedding(96, 64).bfloat16()
    lm_head = Linear(64, 96).bfloat16()
    lm_head.weight = embedding.weight
    return torch.nn.ModuleList([Linear(64, 128).bfloat16(), Linear(128, 64, bias=True).bfloat16(), embedding,
                                lm_head])


def _held_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct storage the model's weights live in (row-major, packed, prepacked)."""
    tensors = [p for p in model.parameters()]
    for m in model.modules():
        if isinstance(m, Linear):
            tensors += [t for t in (m.decode_weight, m.onednn_weight) if t is not None]
    storages = {}
    for t in tensors:
        if t.is_mkldnn or t.layout != torch.strided:
            storages[("opaque", id(t))] = t.numel() * t.element_size()   # oneDNN's prepacked weight
        elif t.numel():
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_every_cpu_kind_holds_each_bf16_weight_once(kind, deterministic):
    variant = decode_linear_variant(every_row=deterministic)
    assert variant == VARIANTS[kind][deterministic]
    model = _model()
    dense_bytes = _held_bytes(model)
    x = torch.randn(5, 64).bfloat16()
    with torch.inference_mode():
        want = [model[0](x), model[3](x)]
        if onednn_weights_apply(torch.bfloat16, deterministic):   # the runner's choice, as on AMX CPUs
            if not torch.backends.mkldnn.is_available() or not platform.cpu_has_onednn_bf16_reorder():
                pytest.skip("oneDNN bf16 reorder unavailable")
            use_onednn_weights(model)
        else:
            use_decode_linear(model, _fake_gemv(variant))
        assert _held_bytes(model) == dense_bytes, "a weight is held twice"
        assert torch.equal(model[0](x), want[0]) and torch.allclose(model[3](x), want[1], atol=1e-2)
    packed_copy = variant in ("packed", "amx") and not onednn_weights_apply(torch.bfloat16, deterministic)
    if packed_copy:   # the packed copy serves every product; the tied lm_head keeps the embedding's weight
        assert model[0].weight.numel() == 0 and model[0].serves_every_row() and model[3].decode_gemv is None


CHILD = """
import gc, json, sys, torch
from kvstrata.model.config import ModelConfig
from kvstrata.model.loader import load_model
def rss():
    return {l.split(":")[0]: int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(("VmHWM", "VmRSS"))}
from kvstrata.model.builtin import resolve_model_path
tiny = resolve_model_path("tiny")
for quantization in (None, "int8"):   # first-use costs (allocator, op set-up) on another, tiny model
    load_model(tiny, ModelConfig.from_path(tiny), torch.bfloat16, "cpu", quantization=quantization)
gc.collect()
path = sys.argv[1]
config = ModelConfig.from_path(path)
out = {}
for quantization in (None, "int8"):
    with open("/proc/self/clear_refs", "w") as fh:   # 5: reset the peak (VmHWM) to the current RSS
        fh.write("5")
    before = rss()
    model = load_model(path, config, torch.bfloat16, "cpu", quantization=quantization)
    after = rss()
    out[quantization or "dense"] = {"before": before["VmRSS"], "peak": after["VmHWM"], "after": after["VmRSS"]}
    del model
    gc.collect()
print(json.dumps(out))
"""


def _layers_checkpoint(folder) -> str:
    """A bf16 Llama whose weights are nearly all layers (2 x 10 M parameters, a 64 KB embedding): 40 MiB."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
              "intermediate_size": 2048, "num_hidden_layers": LAYERS, "num_attention_heads": 8, "num_key_value_heads": 8,
              "vocab_size": 32, "max_position_embeddings": 256, "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
    (folder / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(32, 1024, generator=g).bfloat16(),
               "model.norm.weight": torch.ones(1024).bfloat16()}
    for i in range(LAYERS):
        for name, shape in LAYER_SHAPES.items():
            tensors[f"model.layers.{i}.{name}.weight"] = (0.02 * torch.randn(*shape, generator=g)).bfloat16()
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{i}.{norm}.weight"] = torch.ones(1024).bfloat16()
    save_file(tensors, folder / "model.safetensors")
    return str(folder)


LAYERS = 2
LAYER_SHAPES = {"self_attn.q_proj": (1024, 1024), "self_attn.k_proj": (1024, 1024), "self_attn.v_proj": (1024, 1024),
                "self_attn.o_proj": (1024, 1024), "mlp.gate_proj": (2048, 1024), "mlp.up_proj": (2048, 1024),
                "mlp.down_proj": (1024, 2048)}


def test_int8_at_load_halves_the_layers_in_peak_rss(tmp_path):
    path = _layers_checkpoint(tmp_path)
    out = subprocess.run([sys.executable, "-c", CHILD, path], capture_output=True, text=True, timeout=300,
                         check=True)
    runs = json.loads(out.stdout.strip().splitlines()[-1])
    int8 = runs["int8"]
    weights_kb = LAYERS * sum(n * k for n, k in LAYER_SHAPES.values()) * 2 // 1024    # bf16 layers: 40 MiB
    grown = {name: r["peak"] - r["before"] for name, r in runs.items()}
    # Dense: the weights and one tensor in flight (4 MiB). Reading through a memory map added the mapped file.
    assert weights_kb <= grown["dense"] <= weights_kb + 8 * 1024, grown
    # int8 holds half the layers' bytes; on top, while loading, one bf16 tensor being read (4 MiB), the
    # float32 temporaries of quantizing 256 of its rows and the parts of one fused layer: at most 12 MiB.
    assert grown["int8"] <= weights_kb // 2 + 12 * 1024, grown
    assert int8["after"] - int8["before"] <= weights_kb // 2 + 8 * 1024, int8
