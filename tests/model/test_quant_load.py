"""Quantized checkpoints through the real loader: AWQ, GPTQ (sym, asym) and FP8 (block, per-tensor) against
de-quantizing the same tensors and running the dense path; int8 at load against the dense model; the
`--quantization` checks; rows independent of their batch in deterministic mode."""

from __future__ import annotations

import json

import pytest
import torch

from kvstrata.args import ConfigError, ServerArgs
from kvstrata.model.builtin import resolve_model_path
from kvstrata.model.config import ModelConfig, ModelLoadError
from kvstrata.model.layers import Linear, make_batch_invariant
from kvstrata.model.loader import load_model
from kvstrata.model.quant import fp8, int8
from kvstrata.model.quant.base import QuantizedWeight
from kvstrata.model.quant.int4 import Int4Weight
from tests.model.forward_batch import PagedSequences, make_pool
from tests.model.hf_ckpt import edit_checkpoint
from tests.model.quant_ckpt import FORMATS, write_quantized

CPU = torch.device("cpu")
PROMPTS = [list(range(5, 40)), [7, 8, 9, 300, 2], [1000, 3, 3, 3]]
KINDS = {"awq": Int4Weight, "gptq": Int4Weight, "fp8": fp8.Fp8Weight, "int8": int8.Int8Weight}
# bf16 tolerance on logits (|logit| up to ~5, std ~1.1): the int4 kernel takes its scales in bf16.
BF16_ATOL = 0.25


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """fmt -> (quantized folder, de-quantized reference folder), written once per module."""
    root = tmp_path_factory.mktemp("quant")
    return {fmt: write_quantized(fmt, root) for fmt in FORMATS}


def method(fmt: str) -> str:
    return fmt.split("-")[0]


def logits(model, config, dtype) -> torch.Tensor:
    pool = make_pool(config, num_pages=64, page_size=4, dtype=dtype)
    seqs = PagedSequences(pool, seed=1)
    ids, positions, meta = seqs.batch(list(enumerate(PROMPTS)))
    return model(ids, positions, meta, pool)


def load(path, dtype=torch.float32, quantization=None):
    return load_model(str(path), ModelConfig.from_path(str(path)), dtype, CPU, quantization=quantization)


# Every format in float32 (where the products are exact to rounding); bf16 for an int4 and an FP8 format.
CASES = [(fmt, torch.float32) for fmt in FORMATS] + [("gptq-asym", torch.bfloat16), ("fp8-block", torch.bfloat16)]


@pytest.mark.parametrize("fmt,dtype", CASES, ids=[f"{f}-{str(d)[6:]}" for f, d in CASES])
def test_quantized_checkpoint_matches_its_dequantized_weights(written, fmt, dtype):
    quant_dir, dense_dir = written[fmt]
    ours = load(quant_dir, dtype, method(fmt))
    qkv = ours.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.quantized, KINDS[method(fmt)]) and qkv.weight.numel() == 0   # one copy: no float weight
    dense = load(dense_dir, dtype)
    dense_qkv = dense.model.layers[0].self_attn.qkv_proj.weight.float()
    assert torch.allclose(qkv.quantized.dequantize(), dense_qkv, atol=1e-6 if dtype == torch.float32 else 1e-2)
    got, want = logits(ours, ours.config, dtype), logits(dense, dense.config, dtype)
    assert torch.allclose(got, want, atol=1e-4 if dtype == torch.float32 else BF16_ATOL), (got - want).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_int8_at_load_stays_close_to_the_dense_model_and_halves_layer_weights(dtype):
    path = resolve_model_path("tiny")
    ours, dense = load(path, dtype, "int8"), load(path, dtype)
    linears = [m for name, m in ours.named_modules() if isinstance(m, Linear) and name.startswith("model.layers.")]
    assert linears and all(isinstance(m.quantized, int8.Int8Weight) and m.weight.numel() == 0 for m in linears)
    held = sum(m.quantized.weight.numel() for m in linears)
    float_bytes = sum(m.weight.numel() * m.weight.element_size() for name, m in dense.named_modules()
                      if isinstance(m, Linear) and name.startswith("model.layers."))
    assert held == float_bytes // dense.model.layers[0].self_attn.qkv_proj.weight.element_size()
    got, want = logits(ours, ours.config, dtype), logits(dense, dense.config, dtype)
    # Per-channel int8 keeps each weight within 1/254 of its row's largest: logits (std ~1.1) within 0.1 in
    # float32; in bf16 the dense model's own rounding is of that size too.
    assert (got - want).abs().max() < (0.1 if dtype == torch.float32 else BF16_ATOL), (got - want).abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


def test_missing_and_misplaced_quantized_tensors_are_named(written, tmp_path):
    import shutil

    quant_dir, _ = written["awq"]
    copy = tmp_path / "awq"
    shutil.copytree(quant_dir, copy)
    edit_checkpoint(copy, drop=("model.layers.1.self_attn.k_proj.qzeros",))
    with pytest.raises(ModelLoadError, match="model.layers.1.self_attn.k_proj.qzeros"):
        load(copy, quantization="awq")
    edit_checkpoint(copy, put={"model.layers.1.self_attn.k_proj.qzeros": torch.zeros(2, 8, dtype=torch.int32)})
    with pytest.raises(ModelLoadError, match=r"k_proj.qzeros has shape \(2, 8\), expected \(1, 8\)"):
        load(copy, quantization="awq")


def resolved(model_path, quantization=None, load_format="auto") -> str | None:
    return ServerArgs(model_path=str(model_path), quantization=quantization,
                      load_format=load_format).resolve(with_device=False).quantization


def test_quantization_flag_is_checked_against_the_checkpoint(written, tmp_path):
    awq_dir, plain = written["awq"][0], written["awq"][1]
    assert resolved(awq_dir) == "awq"                       # a quantized checkpoint loads by its own config
    assert resolved(awq_dir, "awq") == "awq"
    assert resolved(written["gptq-sym"][0]) == "gptq" and resolved(written["fp8-block"][0]) == "fp8"
    assert resolved(plain) is None and resolved(plain, "int8") == "int8"
    refusals = [
        ((awq_dir, "gptq"), "--quantization gptq does not fit .*quantized with awq"),
        ((written["gptq-asym"][0], "awq"), "--quantization awq does not fit .*quantized with gptq"),
        ((plain, "awq"), "--quantization awq does not fit .*not quantized"),
        ((plain, "fp8"), "--quantization fp8 does not fit .*not quantized"),
        ((awq_dir, "int8"), "--quantization int8 does not fit .*quantized with awq"),
        ((plain, "gguf"), "--quantization gguf needs a .gguf file"),
    ]
    for (path, flag), message in refusals:
        with pytest.raises(ConfigError, match=message):
            resolved(path, flag)
    with pytest.raises(ConfigError, match="must be one of"):
        ServerArgs(quantization="awq-marlin")
    with pytest.raises(ConfigError, match="random weights are dense"):
        resolved("tiny", "awq", load_format="dummy")
    assert resolved("tiny", "int8", load_format="dummy") == "int8"


@pytest.mark.parametrize("change,message", [
    ({"bits": 8}, "gptq with 8 bits"), ({"desc_act": True}, "desc_act"), ({"group_size": 100}, "group_size 100")])
def test_unsupported_checkpoint_parameters_stop_the_start(written, tmp_path, change, message):
    import shutil

    copy = tmp_path / "gptq"
    shutil.copytree(written["gptq-sym"][0], copy)
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"].update(change)
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        resolved(copy)


def test_quantized_moe_experts_are_refused(checkpoint_dir, tmp_path):
    import shutil

    folder = tmp_path / "moe"
    shutil.copytree(checkpoint_dir("qwen3_moe"), folder)
    name = "model.layers.0.mlp.experts.0.up_proj"
    weight = torch.zeros(32, 64).to(torch.float8_e4m3fn)
    edit_checkpoint(folder, put={f"{name}.weight": weight, f"{name}.weight_scale": torch.tensor(1.0)})
    with pytest.raises(ModelLoadError, match="quantized MoE expert weights"):
        load(folder, quantization="fp8")


def _formats(k: int, n: int) -> dict[str, QuantizedWeight]:
    torch.manual_seed(0)
    w = torch.randn(n, k) * 0.05
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scales, zeros = torch.rand(k // 128, n) * 0.01, torch.randint(0, 16, (k // 128, n))
    f8, rows = fp8.decode({"weight": w.to(torch.float8_e4m3fn), "weight_scale_inv": torch.rand(-(-n // 128),
                                                                                              k // 128)},
                          "w", (128, 128))
    return {"int4": (lambda dt: Int4Weight(q, scales, zeros, dt, CPU)),
            "fp8": (lambda dt: fp8.Fp8Weight(f8, rows, CPU)),
            "int8": (lambda dt: int8.Int8Weight(*int8.quantize(w), dt, CPU))}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kind", ["int4", "fp8", "int8"])
def test_deterministic_mode_rows_do_not_depend_on_the_batch(kind, dtype):
    weight = _formats(256, 384)[kind](dtype)
    make_batch_invariant(weight)
    x = torch.randn(300, 256).to(dtype)
    with torch.inference_mode():
        ref = weight(x)
        for rows in (1, 2, 5, 13, 16, 31, 129):
            pick = torch.randperm(300)[:rows]
            assert torch.equal(weight(x[pick]), ref[pick]), f"{rows} rows"


def test_int4_tile_path_computes_what_the_cpu_kernel_does():
    """The de-quantizing tile path (devices without torch's CPU int4 kernel), run here on CPU."""
    torch.manual_seed(1)
    q = torch.randint(0, 16, (1040, 256), dtype=torch.uint8)
    scales, zeros = torch.rand(2, 1040) * 0.01, torch.randint(0, 16, (2, 1040))
    kernel = Int4Weight(q, scales, zeros, torch.float32, CPU)
    tiles = Int4Weight(q, scales, zeros, torch.float32, CPU, cpu_kernel=False)
    assert kernel.cpu_kernel and not tiles.cpu_kernel
    want = (q.float() - zeros.t().repeat_interleave(128, 1)) * scales.t().repeat_interleave(128, 1)
    assert torch.allclose(tiles.dequantize(), want) and torch.allclose(kernel.dequantize(), want, atol=1e-6)
    x = torch.randn(3, 256)
    assert torch.allclose(tiles(x), kernel(x), atol=1e-4)


def test_int8_weights_get_their_own_kv_namespace():
    """The same folder served as int8 and unquantized computes different KV: L2 snapshots and L3 objects of
    one must never be found by the other."""
    from kvstrata.cache.host_snapshot import HostSnapshot

    path = resolve_model_path("tiny")
    spaces = []
    for quantization in (None, "int8"):
        extra = ServerArgs(model_path=path, quantization=quantization).cache_config().weights_namespace()
        spaces.append(HostSnapshot.for_engine("/unused", path, "torch.bfloat16", 16, extra).namespace)
    assert spaces[0] != spaces[1]


def test_int8_prefill_products_take_dequantized_tiles_with_the_kernels_result():
    weight = _formats(256, 384)["int8"](torch.bfloat16)
    x = torch.randn(100, 256).bfloat16()
    with torch.inference_mode():
        tiles = weight(x)                                     # > int8.KERNEL_MAX_ROWS rows: de-quantized tiles
        kernel = torch.cat([weight(x[i:i + 20]) for i in range(0, 100, 20)])   # the int8 kernel
    assert x.shape[0] > int8.KERNEL_MAX_ROWS >= 20
    assert torch.allclose(tiles.float(), kernel.float(), atol=2e-2, rtol=2e-2)
