"""Qwen3-MoE GGUF files served quantized: the expert slabs (`ffn_*_exps`) and the router (`ffn_gate_inp`) stay
in their GGUF types, one quantized weight per expert over one buffer per projection, and the logits equal the
dense MoE path on the same weights de-quantized by `gguf` (Q8_0 from gguf's quantizer; Q4_K/Q5_K/Q6_K as
random valid blocks); greedy output is identical with no cache, L1 and L2 in deterministic mode."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvstrata.model.builtin import resolve_model_path
from kvstrata.model.config import ModelConfig, ModelLoadError
from kvstrata.model.gguf_loader import load_gguf_model
from kvstrata.model.loader import load_model
from kvstrata.model.quant.gguf_weight import GGUFStack, GGUFWeight, use_gguf_kernels
from tests.model.forward_batch import PagedSequences
from tests.model.gguf_files import MOE_CONFIG, write_moe_gguf
from tests.runtime.helpers import assert_greedy_identical_across_tiers

CPU = torch.device("cpu")
# expert kinds -> GGUF type: Q8_0 throughout, and Q4_K_M-like K-quants (gate and up of different types: each
# expert's gate|up is then a GGUFStack)
FILES = {"q8_0": {"gate": "Q8_0", "up": "Q8_0", "down": "Q8_0"},
         "k_quants": {"gate": "Q4_K", "up": "Q5_K", "down": "Q6_K"}}


@pytest.fixture(scope="module")
def moe_files(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """case -> (GGUF file, de-quantized safetensors folder)."""
    out = str(tmp_path_factory.mktemp("moe-gguf"))
    return {case: write_moe_gguf(out, types) for case, types in FILES.items()}


def _prefill_and_decode(model, prompts: list[list[int]]) -> torch.Tensor:
    """Logits of a batched prefill of `prompts` (every row) and of two decode steps: all of them, then a lone
    one (the experts' one-row path)."""
    c = model.config
    from kvstrata.memory.device_pool import DeviceKVPool

    pool = DeviceKVPool(64, 16, c.num_layers, c.num_kv_heads, c.head_dim, torch.float32, CPU)
    seqs = PagedSequences(pool)
    out = [model(*seqs.batch(list(enumerate(prompts))), pool)]
    for chunk in ([(i, [5 + i]) for i in range(len(prompts))], [(0, [9])]):
        out.append(model(*seqs.batch(chunk), pool))
    return torch.cat(out)


def _expert_types(model) -> set[tuple[str, ...]]:
    """The GGUF types of every expert's gate|up and down weights, as (gate|up types..., down type)."""
    types = set()
    for layer in model.model.layers:
        experts = layer.mlp.experts
        for gate_up, down in zip(experts.gate_up, experts.down, strict=True):
            parts = gate_up.quantized.parts if isinstance(gate_up.quantized, GGUFStack) else [gate_up.quantized]
            types.add((*(p.fmt.name for p in parts), down.quantized.fmt.name))
    return types


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "compiled"])
def test_moe_logits_equal_the_dense_path_on_the_dequantized_weights(moe_files, kernels):
    from kvstrata.model.paged_kernels import gguf_ops

    ops = gguf_ops() if kernels else None
    if kernels and ops is None:
        pytest.skip("no compiled CPU kernels")
    prompts = [list(range(3, 40, 2)), list(range(100, 111)), [7, 8, 9]]
    for case, (path, folder) in moe_files.items():
        config, dense_config = ModelConfig.from_path(resolve_model_path(path)), ModelConfig.from_path(folder)
        assert config.moe == dense_config.moe and config.moe.expert_intermediate_size == MOE_CONFIG["moe_intermediate_size"]
        quantized = load_gguf_model(path, config, torch.float32, CPU)
        use_gguf_kernels(quantized, ops)
        for layer in quantized.model.layers:
            block = layer.mlp
            assert isinstance(block.gate.quantized, GGUFWeight) and block.gate.weight.numel() == 0   # the router
            assert not hasattr(block.experts, "gate_up_proj") and not hasattr(block.experts, "down_proj")
            linears = [*block.experts.gate_up, *block.experts.down]
            assert all(linear.weight.numel() == 0 for linear in linears)
        types = FILES[case]
        gate_up = (types["gate"],) if types["gate"] == types["up"] else (types["gate"], types["up"])
        assert _expert_types(quantized) == {(*gate_up, types["down"])}, case
        # float storage: norms only (the stacked expert tensors and every matrix stay in their blocks)
        assert sum(p.numel() for p in quantized.parameters()) < 10_000
        dense = load_model(folder, dense_config, torch.float32, CPU)
        got, expected = _prefill_and_decode(quantized, prompts), _prefill_and_decode(dense, prompts)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4, msg=case)


def test_experts_share_one_buffer_per_projection(moe_files):
    path, _ = moe_files["q8_0"]
    model = load_gguf_model(path, ModelConfig.from_path(resolve_model_path(path)), torch.float32, CPU)
    experts = model.model.layers[0].mlp.experts
    storages = {linear.quantized.blocks.untyped_storage().data_ptr() for linear in experts.gate_up}
    assert len(storages) == 1      # one [E, 2I, row bytes] buffer, each expert a slab of it


def test_expert_tensor_of_the_wrong_shape_is_named(moe_files):
    path, _ = moe_files["q8_0"]
    config = ModelConfig.from_path(resolve_model_path(path))
    wider = replace(config, moe=replace(config.moe, expert_intermediate_size=2 * config.moe.expert_intermediate_size))
    with pytest.raises(ModelLoadError, match=r"'blk.0.ffn_gate_exps.weight' has shape \[4, 256, 256\]"):
        load_gguf_model(path, wider, torch.float32, CPU)


def test_greedy_identical_without_cache_and_with_l1_l2_deterministic(moe_files):
    path, _ = moe_files["k_quants"]
    assert_greedy_identical_across_tiers(None, model_path=path, tokenizer_path="tiny")
