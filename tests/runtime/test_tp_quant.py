"""Quantized weights under tensor parallelism: two real ranks (gloo, one process each, one thread) load their
shards of int8, AWQ, GPTQ, FP8 and K-quant GGUF checkpoints in the format, cut on block boundaries, and give
TP=1's logits: bitwise in deterministic mode (o_proj / down_proj split by output rows), to float32 rounding
with the default split of their input columns (partial sums, then an all-reduce). An input split inside a
block is refused before any weight is read, naming the tensor, its block and the TP size. int8 shards are
exact cuts of the one-rank int8 weights (scales of whole rows). A Qwen3-MoE GGUF file under --ep-size 2 (by id,
and placed by --init-expert-location): each rank reads only its experts' slabs and its part of every other
tensor, and gives TP=1's logits. MoE models
split inside each expert (--tp-size alone: Qwen3-MoE and Qwen2-MoE's shared expert from safetensors, a
Qwen3-MoE GGUF file's quantized slabs): TP=1's logits the same two ways."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvstrata.args import ServerArgs
from kvstrata.model import gguf_loader
from kvstrata.model.config import ModelConfig
from kvstrata.model.gguf_loader import load_gguf_model
from kvstrata.model.layers import Linear, make_batch_invariant
from kvstrata.model.loader import load_model
from kvstrata.model.parallel import ShardError, TensorParallel
from kvstrata.net import free_port
from tests.model.gguf_files import MOE_CONFIG, write_kquant_gguf, write_moe_gguf
from tests.model.hf_ckpt import write_checkpoint, write_servable_moe_checkpoint
from tests.model.quant_ckpt import write_float_llama, write_quantized

CPU = torch.device("cpu")
# Every split lands on a block boundary at TP=2: o_proj's 512 and down_proj's 1024 input columns halve into
# multiples of 256 (K-quant super-blocks), of 128 (int4 groups, FP8 blocks) and of 32. An odd vocabulary:
# the last rank's vocabulary shard ends in a zero padding row.
SHAPE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
         "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
         "head_dim": 64, "vocab_size": 1001, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
         "rope_theta": 10000.0, "tie_word_embeddings": False, "eos_token_id": 2}
GGUF_SHAPE = {**SHAPE, "tie_word_embeddings": True}        # the lm_head shares the quantized embedding's blocks
PROMPTS = [[5, 17, 300, 999, 1000, 42, 7], [1, 2, 3, 4, 800]]
RANK_TIMEOUT_S = 240
SCRAMBLED_ROUTER = "+scrambled-router"     # a job kind's suffix: rank 1's MoE routers get other weights
# --init-expert-location: each rank's slabs out of the file's order, another set per layer
PLACED = "gguf-moe-placed"
PLACEMENT = '{"physical_to_logical_map": [[3, 0, 1, 2], [2, 1, 0, 3]]}'


def _checkpoints(root: Path) -> dict[str, tuple[str, str, str | None]]:
    """label -> (kind, path, --quantization) of every format, written under `root`."""
    dense = write_float_llama(root / "float", SHAPE)
    jobs = {"int8": ("safetensors", str(dense), "int8")}
    for fmt in ("awq", "gptq-asym", "fp8-block"):
        quant_dir, _ = write_quantized(fmt, root, source=dense)
        jobs[fmt] = ("safetensors", str(quant_dir), fmt.split("-")[0])
    jobs["gguf-k"] = ("gguf", write_kquant_gguf(str(root / "k-mix.gguf"), GGUF_SHAPE), None)
    return jobs


def _load(job: tuple[str, str, str | None], tp: TensorParallel | None) -> torch.nn.Module:
    from kvstrata.model.paged_kernels import gguf_ops
    from kvstrata.model.quant.gguf_weight import use_gguf_kernels

    kind, path, quantization = job
    kind = kind.removesuffix(SCRAMBLED_ROUTER)
    if kind in ("gguf-moe", PLACED) and tp is not None:     # experts split across the ranks (--ep-size = --tp-size)
        tp = TensorParallel(tp.rank, tp.size, tp.deterministic, tp.group, expert_parallel=True,
                            expert_location=PLACEMENT if kind == PLACED else "trivial")
    if kind.startswith("gguf"):     # gguf-moe-tp: a split inside each expert (--tp-size alone)
        shape = MOE_CONFIG if kind.startswith("gguf-moe") else GGUF_SHAPE
        model = load_gguf_model(path, ModelConfig.from_dict(shape), torch.float32, CPU, tp=tp)
        use_gguf_kernels(model, gguf_ops())      # as the runner does (None: the plain-torch path)
    else:
        config = ModelConfig.from_path(path) if kind == "moe" else ModelConfig.from_dict(SHAPE)
        model = load_model(path, config, torch.float32, CPU, tp=tp, quantization=quantization)
    if SCRAMBLED_ROUTER in job[0] and tp is not None and tp.rank == 1:
        # rank 1's routers would pick other experts than rank 0's: only rank 0's routing may count
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.data.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(7)))
    return model


def _logits(model: torch.nn.Module, deterministic: bool) -> torch.Tensor:
    """Logits of every prompt row (one prefill of both prompts), then of one decode row each."""
    from kvstrata.memory.device_pool import DeviceKVPool
    from tests.model.forward_batch import PagedSequences

    c = model.config
    if deterministic:
        make_batch_invariant(model)
    pool = DeviceKVPool(32, 16, c.num_layers, model.layout.kv_heads, c.head_dim, torch.float32, CPU)
    seqs = PagedSequences(pool)
    seqs.batch_invariant = deterministic
    prompts = [[t % c.vocab_size for t in p] for p in PROMPTS]
    prefill = model(*seqs.batch([(0, prompts[0]), (1, prompts[1])]), pool)
    decode = model(*seqs.batch([(0, [11]), (1, [12])]), pool)
    return torch.cat([prefill, decode])


def _held(model: torch.nn.Module) -> torch.Tensor:
    """(bytes of weights held, quantized Linears) of a model or a rank's shard."""
    held = {id(t): t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())}
    quantized = sum(1 for m in model.modules() if isinstance(m, Linear) and m.quantized is not None)
    return torch.tensor([sum(held.values()), quantized])


def _rank(rank: int, port: int, jobs: dict, out: str) -> None:
    """One tensor-parallel rank: every job's logits in both modes, and what its shard holds, saved to `out`."""
    torch.set_num_threads(1)
    group = TensorParallel.init(rank, 2, f"127.0.0.1:{port}", "gloo", 60.0, deterministic=False)
    try:
        results = {}
        for label, job in jobs.items():
            for deterministic in (True, False):
                model = _load(job, TensorParallel(rank, 2, deterministic, group.group))
                results[f"{label}-{deterministic}"] = _logits(model, deterministic)
            results[f"{label}-held"] = _held(model)
        save_file(results, f"{out}/rank{rank}.safetensors")
    finally:
        group.close()


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, tuple[str, str, str | None]]:
    return _checkpoints(tmp_path_factory.mktemp("tp-quant"))


def _run_ranks(jobs: dict, out: Path) -> list[dict[str, torch.Tensor]]:
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(rank, port, jobs, str(out))) for rank in range(2)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + RANK_TIMEOUT_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        assert [p.exitcode for p in procs] == [0, 0], "a rank failed (its traceback is in the captured stderr)"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return [load_file(out / f"rank{rank}.safetensors") for rank in range(2)]


def _check_tp1_logits(jobs: dict, ranks: list[dict[str, torch.Tensor]], dropped_linears: int = 0) -> None:
    """Every rank's logits equal TP=1's (bitwise in deterministic mode); each holds under 55% of the weights,
    every quantized Linear but the `dropped_linears` (other ranks' experts) still quantized (a float job: none)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)      # as each rank: MKL sums a float32 product differently over more threads
    try:
        for label, job in jobs.items():
            for deterministic in (True, False):
                whole = _load(job, None)
                expected = _logits(whole, deterministic)
                got = [r[f"{label}-{deterministic}"] for r in ranks]
                assert torch.equal(got[0], got[1]), label          # every rank sees the full logits
                if deterministic:
                    assert torch.equal(got[0], expected), (label, (got[0] - expected).abs().max())
                else:     # partial sums added by an all-reduce: float32 rounding, the same greedy tokens
                    scale = expected.abs().max().item()
                    torch.testing.assert_close(got[0], expected, rtol=0, atol=1e-5 * scale, msg=label)
                    assert torch.equal(got[0].argmax(-1), expected.argmax(-1)), label
            held, quantized = _held(whole).tolist()
            for r in ranks:     # each rank holds its half, every quantized Linear still quantized
                rank_held, rank_quantized = r[f"{label}-held"].tolist()
                assert rank_quantized == quantized - dropped_linears, label
                assert (quantized > 0) == (not job[0].startswith("moe")), label
                assert rank_held < 0.55 * held, (label, rank_held, held)
    finally:
        torch.set_num_threads(threads)


def test_tp2_quantized_shards_give_tp1_logits(jobs, tmp_path):
    _check_tp1_logits(jobs, _run_ranks(jobs, tmp_path))


def test_tp2_ep2_moe_gguf_ranks_hold_their_experts_and_give_tp1_logits(tmp_path):
    path, _ = write_moe_gguf(str(tmp_path), {"gate": "Q4_K", "up": "Q5_K", "down": "Q6_K"})
    jobs = {"gguf-moe": ("gguf-moe", path, None), PLACED: (PLACED, path, None)}
    ranks = _run_ranks(jobs, tmp_path)
    c = MOE_CONFIG       # each rank lacks the other rank's half of the experts (a gate|up and a down Linear each)
    _check_tp1_logits(jobs, ranks, dropped_linears=c["num_hidden_layers"] * c["num_experts"])


def test_tp2_moe_split_inside_each_expert_gives_tp1_logits(tmp_path):
    """--tp-size 2 without --ep-size: every rank holds half of every expert's intermediate features (and of
    Qwen2-MoE's shared expert); deterministic mode gathers down's output features (bitwise TP=1), the default
    mode all-reduces each block's partial sums once. The GGUF file's down blocks (Q8_0: 32 values) split on a
    boundary; its gate/up K-quants are split by rows. With rank 1's routers scrambled the logits are still
    TP=1's: every rank runs rank 0's routing."""
    jobs = {"qwen3-moe": ("moe", write_servable_moe_checkpoint(str(tmp_path / "qwen3-moe")), None),
            "qwen2-moe": ("moe", write_checkpoint("qwen2_moe", str(tmp_path / "qwen2-moe")), None),
            "gguf-moe-tp": ("gguf-moe-tp", write_moe_gguf(str(tmp_path), {"gate": "Q4_K", "up": "Q5_K",
                                                                           "down": "Q8_0"})[0], None)}
    jobs["qwen3-moe-scrambled"] = ("moe" + SCRAMBLED_ROUTER, jobs["qwen3-moe"][1], None)   # rank 0 routes
    _check_tp1_logits(jobs, _run_ranks(jobs, tmp_path))


def test_a_split_inside_each_expert_refuses_a_quantized_down_block_it_would_cut(tmp_path):
    """Each rank takes 128 of a Q6_K expert down_proj's 256 input columns: half a super-block, refused from
    the header naming the tensor; deterministic mode splits down by output rows and loads."""
    path, _ = write_moe_gguf(str(tmp_path), {"gate": "Q8_0", "up": "Q8_0", "down": "Q6_K"})
    with pytest.raises(ShardError, match=r"--tp-size 2 cannot split model\.layers\.0\.mlp\.experts\.0\.down_proj"
                                         r"\.weight: each rank takes 128 .* block of 256 values"):
        _load(("gguf-moe-tp", path, None), TensorParallel(1, 2))
    model = _load(("gguf-moe-tp", path, None), TensorParallel(1, 2, deterministic=True))
    experts = model.model.layers[1].mlp.experts
    assert experts.down[3].quantized.out_features == MOE_CONFIG["hidden_size"] // 2


class _CountingFile:
    """A file that counts the bytes read from it (the loader's plain reads)."""

    read_bytes = 0

    def __init__(self, *args, **kwargs):
        self._file = open(*args, **kwargs)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()

    def seek(self, offset: int) -> int:
        return self._file.seek(offset)

    def readinto(self, view) -> int:
        got = self._file.readinto(view)
        _CountingFile.read_bytes += got
        return got


@pytest.mark.parametrize("kind", ["gguf", "gguf-moe", "gguf-moe-tp"])
def test_a_rank_reads_only_its_part_of_the_gguf_file(kind, jobs, tmp_path, monkeypatch):
    """Rows, whole blocks of input columns and experts (or their slices) are read at their offsets: a rank of
    two reads about half the tensor bytes TP=1 reads (norms and the MoE router are whole on every rank)."""
    path = jobs["gguf-k"][1] if kind == "gguf" else write_moe_gguf(str(tmp_path), {"gate": "Q8_0", "up": "Q8_0",
                                                                                    "down": "Q8_0"})[0]
    monkeypatch.setattr(gguf_loader, "open", _CountingFile, raising=False)
    read = []
    for tp in (None, TensorParallel(0, 2), TensorParallel(1, 2), TensorParallel(1, 2, deterministic=True)):
        _CountingFile.read_bytes = 0
        _load((kind, path, None), tp)
        read.append(_CountingFile.read_bytes)
    assert all(0 < r < 0.52 * read[0] for r in read[1:]), read


def test_input_split_inside_a_block_is_refused_naming_the_tensor_block_and_tp_size(jobs):
    # TP=4: each rank takes 128 of o_proj's 512 input columns, half a K-quant super-block of 256; TP=8: 64,
    # half an AWQ group of 128 (down_proj's 1024 columns still split on boundaries: o_proj is named).
    with pytest.raises(ShardError, match=r"--tp-size 4 cannot split model\.layers\.0\.self_attn\.o_proj\.weight: "
                                         r"each rank takes 128 .* block of 256 values"):
        _load(jobs["gguf-k"], TensorParallel(0, 4))
    with pytest.raises(ShardError, match=r"--tp-size 8 cannot split model\.layers\.\d\.self_attn\.o_proj\.weight: "
                                         r"each rank takes 64 .* block of 128 values"):
        _load(jobs["awq"], TensorParallel(0, 8))
    # Deterministic mode splits o_proj / down_proj by output rows: no block is cut, the shard loads.
    model = _load(jobs["gguf-k"], TensorParallel(0, 4, deterministic=True))
    assert all(m.quantized is not None for m in model.modules() if isinstance(m, Linear))


def test_quantized_checkpoints_start_with_tp_size_2(jobs):
    for label in ("awq", "fp8-block"):
        kind, path, quantization = jobs[label]
        assert ServerArgs(model_path=path, tp_size=2).resolve(with_device=False).quantization == quantization


@pytest.mark.parametrize("deterministic", [False, True])
def test_int8_shards_are_cuts_of_the_one_rank_int8_weights(deterministic):
    """--load-format dummy --quantization int8: a rank quantizes only its cut, with the scales of whole rows, so
    its int8 values and scales are exactly its cut of TP=1's (every TP size serves the same weights)."""
    from kvstrata.model.builtin import resolve_model_path
    from kvstrata.model.loader import load_dummy_model

    config = ModelConfig.from_path(resolve_model_path("tiny"))
    whole = load_dummy_model(config, torch.float32, CPU, quantization="int8")
    for rank in range(2):
        shard = load_dummy_model(config, torch.float32, CPU, quantization="int8",
                                 tp=TensorParallel(rank, 2, deterministic))
        for module in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            mine = shard.get_submodule(f"model.layers.1.{module}").quantized
            one = whole.get_submodule(f"model.layers.1.{module}").quantized
            rows, cols = _expected_cut(shard.layout, module, one.weight.shape)
            assert torch.equal(mine.weight, one.weight[rows, cols]), module
            assert torch.equal(mine.scales, one.scales[rows]), module


def _expected_cut(layout, module: str, shape: torch.Size) -> tuple[torch.Tensor, slice]:
    """This rank's rows (of a fused projection: of each part) and columns of a one-rank weight."""
    n, k = shape
    size, rank = layout.size, layout.rank
    if module.endswith(("o_proj", "down_proj")):
        if layout.deterministic:
            return torch.arange(rank * n // size, (rank + 1) * n // size), slice(None)
        return torch.arange(n), slice(rank * k // size, (rank + 1) * k // size)
    if module.endswith("qkv_proj"):
        q = layout.q_heads * layout.head_dim * size
        kv = (n - q) // 2
        mine_q = torch.arange(rank * q // size, (rank + 1) * q // size)
        mine_kv = torch.arange(layout.kv_head0 * layout.head_dim, (layout.kv_head0 + layout.kv_heads) * layout.head_dim)
        return torch.cat([mine_q, q + mine_kv, q + kv + mine_kv]), slice(None)
    half = n // 2      # gate | up
    mine = torch.arange(rank * half // size, (rank + 1) * half // size)
    return torch.cat([mine, half + mine]), slice(None)


@pytest.mark.parametrize("deterministic", [False, True])
def test_float_gguf_shards_are_the_layouts_cuts_of_the_one_rank_weights(deterministic, tmp_path):
    """A GGUF file's F16 matrices, read by rows and columns at their offsets, are exactly ShardLayout.shard of
    the one-rank parameters (the rule every safetensors checkpoint is cut by)."""
    from kvstrata.model.builtin import resolve_model_path
    from tests.model.gguf_files import write_tiny_gguf

    path, _ = write_tiny_gguf(str(tmp_path), "F16")
    config = ModelConfig.from_path(resolve_model_path(path))
    whole = load_gguf_model(path, config, torch.float32, CPU)
    whole_params, whole_targets = dict(whole.named_parameters(remove_duplicate=False)), whole.checkpoint_targets()
    for rank in range(2):
        shard = load_gguf_model(path, config, torch.float32, CPU, tp=TensorParallel(rank, 2, deterministic))
        params = dict(shard.named_parameters(remove_duplicate=False))
        for name, (param, start, end, *_) in shard.checkpoint_targets().items():
            one, one_start, one_end = whole_targets[name][:3]
            expected = shard.layout.shard(name, whole_params[one][one_start:one_end])
            assert torch.equal(params[param][start:end], expected), (name, rank)
