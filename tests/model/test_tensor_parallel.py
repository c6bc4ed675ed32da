"""The tensor-parallel layout (what each rank holds), the CPU binding of the ranks, and the column invariance
the deterministic row-parallel layers rely on. No processes here: tests/runtime/test_tp.py runs the ranks."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvstrata.model.builtin import BUILTIN_SPECS, resolve_model_path
from kvstrata.model.config import ModelConfig
from kvstrata.model.layers import Linear, make_batch_invariant, use_decode_linear
from kvstrata.model.loader import load_dummy_model
from kvstrata.model.paged_kernels import decode_linear_op
from kvstrata.model.parallel import ShardError, ShardLayout, TensorParallel
from kvstrata.runtime.ranks import cpu_sets
from tests.model.gguf_files import MOE_CONFIG

CPU = torch.device("cpu")


def _config(name: str = "tiny") -> ModelConfig:
    return ModelConfig.from_path(resolve_model_path(name))


def _layout(size: int, rank: int, deterministic: bool = False, name: str = "tiny") -> ShardLayout:
    return ShardLayout.of(_config(name), TensorParallel(rank, size, deterministic))


def test_heads_split_and_kv_heads_replicate_when_fewer_than_ranks():
    spec = BUILTIN_SPECS["tiny"]      # 4 q heads, 2 KV heads
    two = [_layout(2, r) for r in range(2)]
    assert [(x.q_head0, x.q_heads, x.kv_head0, x.kv_heads) for x in two] == [(0, 2, 0, 1), (2, 2, 1, 1)]
    four = [_layout(4, r) for r in range(4)]
    # Each rank's one q head reads KV head q_head // (4 // 2): ranks 0, 1 share KV head 0; ranks 2, 3 head 1.
    assert [(x.q_head0, x.kv_head0, x.kv_heads) for x in four] == [(0, 0, 1), (1, 0, 1), (2, 1, 1), (3, 1, 1)]
    for x in four:
        assert x.q_head0 // (spec.num_heads // spec.num_kv_heads) == x.kv_head0


def test_shards_of_checkpoint_tensors_cover_the_whole_tensor_once():
    c = _config()
    q = torch.arange(c.num_heads * c.head_dim * 3, dtype=torch.float32).view(-1, 3)
    assert torch.equal(torch.cat([_layout(2, r).shard("model.layers.0.self_attn.q_proj.weight", q) for r in (0, 1)]), q)
    down = torch.randn(c.hidden_size, c.intermediate_size)
    name = "model.layers.1.mlp.down_proj.weight"
    by_input = [_layout(2, r).shard(name, down) for r in (0, 1)]
    assert torch.equal(torch.cat(by_input, dim=1), down)                         # default: input columns
    by_output = [_layout(2, r, deterministic=True).shard(name, down) for r in (0, 1)]
    assert torch.equal(torch.cat(by_output, dim=0), down)                        # deterministic: output rows
    emb = torch.randn(c.vocab_size, c.hidden_size)
    three = ShardLayout.of(_config(), TensorParallel(0, 1)).shard("model.embed_tokens.weight", emb)
    assert three is emb                                                           # one rank: untouched
    norm = torch.randn(c.hidden_size)
    assert _layout(2, 1).shard("model.layers.0.input_layernorm.weight", norm) is norm


def test_vocabulary_shards_are_padded_to_equal_rows():
    layout = _layout(2, 1)
    emb = torch.randn(1023, 8)        # an odd vocabulary: the last rank's tail is zeros
    layout = ShardLayout(**{**layout.__dict__, "vocab": 1023, "vocab_rows": 512})
    part = layout.shard("lm_head.weight", emb)
    assert part.shape == (512, 8) and torch.equal(part[:511], emb[512:]) and not part[511].any()


def test_models_that_do_not_split_are_refused_by_name():
    with pytest.raises(ShardError, match="--tp-size 3 cannot split .*4 attention heads"):
        _layout(3, 0)
    moe = _config("bench-moe")
    odd = replace(moe, moe=replace(moe.moe, expert_intermediate_size=383, shared_expert_intermediate_size=90))
    with pytest.raises(ShardError, match=r"--tp-size 2 cannot split Qwen3MoeForCausalLM: MoE intermediate size 383 "
                                         r"\(each expert's; --ep-size 2 splits whole experts instead\)"):
        ShardLayout.of(odd, TensorParallel(0, 2))
    with pytest.raises(ShardError, match="--tp-size 4 cannot split .*shared expert intermediate size 90"):
        ShardLayout.of(replace(odd, moe=replace(odd.moe, expert_intermediate_size=384)), TensorParallel(0, 4))
    whole_experts = ShardLayout.of(odd, TensorParallel(0, 2, expert_parallel=True))   # whole experts: any size
    assert (whole_experts.experts, whole_experts.expert_intermediate) == (16, 383)


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_split_inside_the_experts_cuts_each_expert_like_a_dense_mlp(deterministic):
    """--tp-size without --ep-size on an MoE model: every rank holds every expert, its rows of gate/up and
    its columns of down (deterministic mode: its output rows); the router stays whole."""
    layouts = [ShardLayout.of(_config("bench-moe"), TensorParallel(r, 2, deterministic)) for r in (0, 1)]
    assert all(x.slices_experts and (x.held_experts(3), x.experts, x.expert_intermediate) == (tuple(range(32)), 32, 192)
               for x in layouts)
    name = "model.layers.3.mlp.experts.{}.{}.weight"
    assert all(x.holds(name.format(e, "up_proj")) for x in layouts for e in (0, 31))
    up, down = torch.randn(384, 512), torch.randn(512, 384)
    assert torch.equal(torch.cat([x.shard(name.format(7, "up_proj"), up) for x in layouts]), up)
    halves = [x.shard(name.format(7, "down_proj"), down) for x in layouts]
    assert all(h.shape == ((256, 384) if deterministic else (512, 192)) for h in halves)
    assert torch.equal(torch.cat(halves, dim=0 if deterministic else 1), down)
    mixtral = "model.layers.0.block_sparse_moe.experts.3.{}.weight"     # Mixtral's w1 (gate) and w2 (down)
    assert layouts[1].cut(mixtral.format("w1")).rows == slice(192, 384)
    assert layouts[1].cut(mixtral.format("w2")) == layouts[1].cut(name.format(3, "down_proj"))
    router = torch.randn(32, 512)
    assert all(x.shard("model.layers.3.mlp.gate.weight", router) is router for x in layouts)


def test_expert_parallel_ranks_hold_whole_experts_and_skip_the_others():
    layouts = [ShardLayout.of(_config("bench-moe"), TensorParallel(r, 2, expert_parallel=True)) for r in (0, 1)]
    assert [(x.held_experts(3), x.experts) for x in layouts] == [(tuple(range(16)), 16), (tuple(range(16, 32)), 16)]
    name = "model.layers.3.mlp.experts.{}.down_proj.weight"
    assert [[x.holds(name.format(e)) for e in (0, 15, 16, 31)] for x in layouts] == [
        [True, True, False, False], [False, False, True, True]]
    assert all(x.holds("model.layers.3.mlp.gate.weight") for x in layouts)       # the router: on every rank
    expert = torch.randn(512, 384)
    assert layouts[1].shard(name.format(20), expert) is expert                    # whole, not sliced
    # a placement that cannot serve this model stops the start, naming it
    for location, redundant, message in (("/nonexistent/loads.json", 0, "No such file"),
                                         ('{"logical_count": [[1, 2]]}', 0, "has 1 layers, the model 8"),
                                         ("trivial", 3, "35 physical slots do not divide over --ep-size 2")):
        with pytest.raises(ShardError, match=f"cannot split Qwen3MoeForCausalLM: .*{message}"):
            ShardLayout.of(_config("bench-moe"), TensorParallel(0, 2, expert_parallel=True, expert_location=location,
                                                                redundant_experts=redundant))


# (deterministic, expert_parallel, --init-expert-location, --ep-num-redundant-experts)
PLACED = '{"physical_to_logical_map": [[3, 0, 1, 2, 3, 0], [2, 1, 3, 0, 2, 1]]}'


@pytest.mark.parametrize("deterministic, expert_parallel, location, redundant", [
    (False, False, "trivial", 0), (True, False, "trivial", 0), (False, True, "trivial", 0),
    (False, True, "trivial", 2), (False, True, PLACED, 2)])
def test_dummy_moe_shards_are_the_layouts_cuts_of_the_one_rank_weights(deterministic, expert_parallel, location,
                                                                        redundant):
    """--load-format dummy under tensor parallelism: each rank's experts (or slices of them) are cut from the
    one-rank model's, so every TP size and split serves the same weights; under --ep-size each slot holds
    the expert its placement says (spare copies included)."""
    config = ModelConfig.from_dict(MOE_CONFIG)
    whole = load_dummy_model(config, torch.float32, CPU).model.layers[1].mlp.experts
    for rank in range(2):
        tp = TensorParallel(rank, 2, deterministic, expert_parallel=expert_parallel, expert_location=location,
                            redundant_experts=redundant)
        shard = load_dummy_model(config, torch.float32, CPU, tp=tp)
        layout, experts = shard.layout, shard.model.layers[1].mlp.experts
        assert len(experts.down) == layout.experts == (2 + redundant // 2 if expert_parallel else 4)
        if location == PLACED:
            assert layout.held_experts(1) == ((2, 1, 3), (0, 2, 1))[rank]
        for e, one in enumerate(layout.held_experts(1)):
            for kind, linears, whole_linears in (("down_proj", experts.down, whole.down),
                                                 ("up_proj", experts.gate_up, whole.gate_up)):
                name = f"model.layers.1.mlp.experts.{one}.{kind}.weight"
                weight = whole_linears[one].weight
                if kind == "up_proj":     # gate|up: the up rows of each
                    weight, mine = weight[config.moe.expert_intermediate_size:], linears[e].weight
                    mine = mine[mine.shape[0] // 2:]
                else:
                    mine = linears[e].weight
                assert torch.equal(mine, layout.shard(name, weight)), (rank, e, kind)


def test_cpu_binding_follows_sglang_format_or_splits_the_cores_evenly():
    assert cpu_sets(2, "0-1|2,5") == [[0, 1], [2, 5]]
    assert cpu_sets(2, "", available=[0, 1, 2, 3, 4]) == [[0, 1, 2], [3, 4]]
    assert cpu_sets(4, "", available=[7, 3]) == [[3, 7]] * 4          # fewer cores than ranks: shared
    with pytest.raises(ValueError, match="lists 1 core sets for 2 rank"):
        cpu_sets(2, "0-3")
    with pytest.raises(ValueError, match="not a core list"):
        cpu_sets(1, "zero")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features,out_features", [(128, 128), (384, 128), (128, 1024)])
def test_batch_invariant_products_are_column_invariant(dtype, in_features, out_features):
    """Deterministic TP splits o_proj / down_proj / lm_head by output features: a rank's half of the weight
    must give the same bits per output feature as the whole weight does at TP=1 (one thread per rank)."""
    torch.manual_seed(0)
    whole = Linear(in_features, out_features, bias=True).to(dtype)
    halves = [Linear(in_features, out_features // 2, bias=True).to(dtype) for _ in range(2)]
    with torch.no_grad():
        for k, half in enumerate(halves):
            half.weight.copy_(whole.weight[k * out_features // 2:(k + 1) * out_features // 2])
            half.bias.copy_(whole.bias[k * out_features // 2:(k + 1) * out_features // 2])
    gemv = decode_linear_op(every_row=True) if dtype == torch.bfloat16 else None   # what the runner uses
    for module in (whole, *halves):
        make_batch_invariant(module)
        use_decode_linear(module, gemv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for rows in (1, 5, 40):
            x = torch.randn(rows, in_features, dtype=dtype)
            assert torch.equal(whole(x), torch.cat([h(x) for h in halves], dim=1))
    finally:
        torch.set_num_threads(threads)
