"""ModelRunner: loads the model and the device KV pool, turns a ScheduledBatch into one forward + sampling.

It knows pools and slots, not the radix tree: the scheduler has already placed every token in a slot.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Optional

import torch

from kvstrata.args import ServerArgs
from kvstrata.cache.shards import RankLink
from kvstrata.memory.device_pool import DeviceKVPool
from kvstrata.memory.kv_format import KVFormat
from kvstrata.memory.req_slots import ReqSlotTable
from kvstrata.model.builtin import resolve_model_path
from kvstrata.model.config import ModelConfig
from kvstrata.model.expert_location import ExpertDistributionRecorder
from kvstrata.model.forward_meta import ForwardMetadata
from kvstrata.model.gguf import gguf_file, is_gguf
from kvstrata.model.gguf_loader import load_gguf_model
from kvstrata.model.kv_scales import read_kv_scales
from kvstrata.model.layers import (
    make_batch_invariant,
    onednn_weights_apply,
    use_decode_linear,
    use_fused_activation,
    use_fused_norms,
    use_onednn_weights,
)
from kvstrata.model.loader import checkpoint_files, load_dummy_model, load_model
from kvstrata.model.moe import use_expert_linear, use_expert_recorder, use_moe_combine
from kvstrata.model.paged_kernels import (
    BF16_HEAD_DIMS,
    amx_linear_op,
    argmax_op,
    decode_attention_op,
    decode_linear_op,
    extend_attention_op,
    gguf_ops,
    moe_combine_op,
    norm_ops,
    paged_attention_op,
    rope_op,
    silu_and_mul_op,
)
from kvstrata.model.parallel import TensorParallel
from kvstrata.model.quant.gguf_weight import use_gguf_kernels
from kvstrata.model.rope import use_rope_kernel
from kvstrata.platform import large_buffers_unmapped
from kvstrata.runtime.batch import ScheduledBatch, StepResult
from kvstrata.runtime.forward_plan import ForwardPlan, PlanKind, PlanLedger, gather_ledgers, receive_plan
from kvstrata.runtime.handoff import RankHandoff, RankHandoffFactory
from kvstrata.runtime.rank_call import answer_safely, gather_answers, no_handoff, receive_request
from kvstrata.runtime.sampler import Sampler

logger = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
CPU_DEFAULT_MAX_TOKENS = 131072     # CPU pools are plain RAM: keep the default modest
CPU_MEM_FRACTION = 0.25
CUDA_MEM_FRACTION = 0.85


class ModelRunner:
    """Owns the model weights and the L1 pool; runs forwards.

    Under tensor parallelism (--tp-size > 1) each rank has its own runner over its shard of the weights and
    of the pool (its KV heads). Rank 0's (`tp` None: it starts the group, runtime/ranks.py) sends every
    forward's plan to the others before running it; theirs (`tp` given) run `follow()`.
    """

    def __init__(self, args: ServerArgs, tp: Optional[TensorParallel] = None,
                 rank_side: Optional[RankHandoffFactory] = None):
        """`tp`: a rank > 0's group (rank 0 starts its own); `rank_side`: what the other ranks run for the PD
        handoff (HandoffFactory.rank_side), if any."""
        from kvstrata.runtime.ranks import RankGroup

        self.args = args
        self.device = torch.device(args.device)
        self.dtype = DTYPES[args.dtype]
        if args.num_threads and self.device.type == "cpu":
            torch.set_num_threads(args.num_threads)
        if self.device.type == "cuda":
            torch.cuda.set_device(args.base_gpu_id)   # "cuda" below then means cuda:base_gpu_id
        self.ranks = RankGroup.start(args, rank_side) if args.tp_size > 1 and tp is None else None   # rank 0's followers
        self.tp = tp or (self.ranks.tp if self.ranks is not None else None)
        try:
            self._load(args)
        except BaseException:
            self.close()
            raise

    @large_buffers_unmapped()    # the relayout and the kernels' packed copies too
    def _load(self, args: ServerArgs) -> None:
        self.model_path = resolve_model_path(args.model_path)
        self.config = ModelConfig.from_path(self.model_path)
        if args.load_format == "dummy":
            self.model = load_dummy_model(self.config, self.dtype, self.device, relayout=False, tp=self.tp,
                                          quantization=args.quantization)
        elif is_gguf(args.model_path):
            self.model = load_gguf_model(gguf_file(args.model_path), self.config, self.dtype, self.device, tp=self.tp)
        else:
            self.model = load_model(self.model_path, self.config, self.dtype, self.device, relayout=False, tp=self.tp,
                                    quantization=args.quantization)
        if args.enable_deterministic_inference:
            make_batch_invariant(self.model)
        self.context_len = args.context_length or self.config.max_position_embeddings
        self.vocab_size = self.config.vocab_size
        self.kv_format = self._kv_format()
        num_pages = self._pool_pages()
        if self.tp is not None:     # rank 0 allocates slots for every rank: all pools have its size
            num_pages = self.tp.all_min([num_pages])[0]
            self.tp.check_agree("--dtype, --page-size, --enable-deterministic-inference, --disable-cpu-kernels",
                                [list(DTYPES).index(args.dtype), args.page_size,
                                 int(args.enable_deterministic_inference), int(args.disable_cpu_kernels)])
        self.pool = DeviceKVPool(num_pages, args.page_size, self.config.num_layers, self.model.layout.kv_heads,
                                 self.config.head_dim, self.kv_format.dtype, self.device, self.kv_format)
        self.sampler = Sampler(self.vocab_size, args.random_seed or 0, self.device, self._argmax_kernel())
        self.paged_kernel = self._paged_kernel()
        self.extend_kernel = self._extend_kernel()
        self._use_layer_kernels()
        self.model.optimize_layout()   # after the kernels: an lm_head that the decode GEMV reads keeps its layout
        self.grammar_backend = None   # set by the scheduler when structured output is enabled
        # --expert-distribution-recorder-mode: rank 0 counts (its routing is every rank's)
        self.expert_recorder: Optional[ExpertDistributionRecorder] = None
        if args.expert_distribution_recorder_mode and self.config.moe is not None and (self.tp is None or self.tp.rank == 0):
            self.expert_recorder = ExpertDistributionRecorder(self.config.num_layers, self.config.moe.num_experts)
            use_expert_recorder(self.model, self.expert_recorder)
        logger.info("KV pool: %d tokens (%d pages of %d), %.1f MB", self.max_total_tokens, num_pages - 1,
                    args.page_size, self.pool.bytes_per_token * self.pool.num_slots / 2**20)

    def _kv_format(self) -> KVFormat:
        """--kv-cache-dtype for this model, with the checkpoint's per-layer K/V scales where it has them."""
        fp8 = self.args.kv_cache_dtype != "auto"
        scales = (read_kv_scales(self.model_path, checkpoint_files(self.model_path), self.config.num_layers)
                  if fp8 and self.args.load_format != "dummy" and not is_gguf(self.args.model_path) else None)
        return KVFormat.of(self.args.kv_cache_dtype, self.dtype, self.config.num_layers, scales)

    def _paged_kernel(self):
        """The compiled in-place attention op for decode rows where it applies (CPU, bf16/f32, not
        --disable-cpu-kernels, and it builds), else None: plain-torch attention. On AVX-512 BF16 CPUs a bf16
        model in the default mode gets the bf16 decode kernel; deterministic inference keeps the float32 one,
        which then attends every row (extends too) with the same arithmetic."""
        usable = self.device.type == "cpu" and self.dtype in (torch.bfloat16, torch.float32)
        if not usable or self.args.disable_cpu_kernels:
            return None
        bf16_decode = (self.dtype == torch.bfloat16 and self.config.head_dim in BF16_HEAD_DIMS
                       and not self.args.enable_deterministic_inference)
        return (decode_attention_op() if bf16_decode else None) or paged_attention_op()

    def _extend_kernel(self):
        """The compiled extend-attention op where it applies (CPU, a head dim it serves, not
        --disable-cpu-kernels, default mode: deterministic inference keeps every row on the batch-invariant
        kernel): bf16 models on AVX-512 BF16 CPUs, bf16 and float32 models on AVX2 ones; else None (SDPA)."""
        a = self.args
        usable = (self.device.type == "cpu" and self.config.head_dim in BF16_HEAD_DIMS
                  and not a.disable_cpu_kernels and not a.enable_deterministic_inference)
        return extend_attention_op(self.dtype) if usable else None

    def _argmax_kernel(self) -> Optional[Callable]:
        """The compiled greedy argmax (torch's tokens) on CPU without --disable-cpu-kernels, else None."""
        if self.device.type != "cpu" or self.args.disable_cpu_kernels:
            return None
        return argmax_op()

    def _use_layer_kernels(self) -> None:
        """Compiled norms, rotary embedding, silu·mul and the MoE weighted sum (row-invariant: both modes) and
        the bf16 products:
        on AMX CPUs oneDNN on prepacked weights, elsewhere the compiled GEMV (decode rows; AVX2: every
        product; MoE experts there take the AMX linear); deterministic mode takes the GEMV for every row count
        on every CPU, since oneDNN's AMX kernels sum a row differently at different row counts. On CPU unless --disable-cpu-kernels; plain
        torch otherwise."""
        if self.device.type != "cpu" or self.args.disable_cpu_kernels:
            return
        use_fused_norms(self.model, norm_ops())
        use_rope_kernel(self.model, rope_op())
        use_moe_combine(self.model, moe_combine_op())
        use_gguf_kernels(self.model, gguf_ops())
        if self.dtype == torch.bfloat16:
            use_fused_activation(self.model, silu_and_mul_op())
        deterministic = self.args.enable_deterministic_inference
        gemv = decode_linear_op(every_row=deterministic)
        if onednn_weights_apply(self.dtype, deterministic):
            amx = amx_linear_op()
            if amx is not None:
                use_expert_linear(self.model, amx)   # small products: the AMX linear beats oneDNN there
            if gemv is not None:
                use_decode_linear(self.model, gemv)  # decode rows of what oneDNN does not take (a tied lm_head)
            use_onednn_weights(self.model)
        elif gemv is not None:
            use_decode_linear(self.model, gemv)

    @property
    def max_total_tokens(self) -> int:
        """Usable tokens of the device pool (page 0 is reserved)."""
        return (self.pool.num_pages - 1) * self.pool.page_size

    def _pool_pages(self) -> int:
        a, c = self.args, self.config
        per_token = DeviceKVPool.bytes_per_token_for(c.num_layers, self.model.layout.kv_heads, c.head_dim, self.kv_format.dtype)
        if a.max_total_tokens:
            tokens = a.max_total_tokens
        elif self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            fraction = a.mem_fraction_static or CUDA_MEM_FRACTION
            weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
            tokens = int((free * fraction - 0.1 * free) // per_token) if free * fraction > weights else 0
        else:
            import psutil

            budget = psutil.virtual_memory().available * (a.mem_fraction_static or CPU_MEM_FRACTION)
            tokens = min(int(budget // per_token), CPU_DEFAULT_MAX_TOKENS)
        if tokens < a.page_size:
            raise RuntimeError(f"not enough memory for a KV pool ({tokens} tokens); lower the load or set "
                               "--max-total-tokens")
        return -(-tokens // a.page_size) + 1

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch, slot_table: ReqSlotTable) -> StepResult:
        """Run one forward over the batch and sample the sequences whose fill completes."""
        ids: list[int] = []
        kv_slots, extend_lens, prefix_lens = [], [], []
        logit_rows: list[int] = []
        prompt_spans: list[tuple[int, int, int]] = []   # (entry index, first logits row, count)
        sample_entries: list[int] = []
        offset = 0
        table = slot_table.table
        for i, e in enumerate(batch.entries):
            req = e.req
            ids.extend(_tokens(req, e.start, e.end))
            kv_slots.append(table[req.row, : e.end])
            extend_lens.append(e.extend_len)
            prefix_lens.append(e.start)
            if e.logprob_hi > e.logprob_lo:
                prompt_spans.append((i, len(logit_rows), e.logprob_hi - e.logprob_lo))
                logit_rows.extend(range(offset + e.logprob_lo - e.start, offset + e.logprob_hi - e.start))
            if e.sample:
                sample_entries.append(i)
                logit_rows.append(offset + e.extend_len - 1)
            offset += e.extend_len
        plan = ForwardPlan(torch.tensor(ids, dtype=torch.long), extend_lens, prefix_lens, kv_slots,
                           torch.tensor(logit_rows, dtype=torch.long))
        if self.ranks is not None:
            self.ranks.send(PlanKind.FORWARD, plan)
        logits = self._run(plan, batch.layer_wait)
        prompt_rows = {i: torch.log_softmax(logits[r0:r0 + n], dim=-1).cpu() for i, r0, n in prompt_spans}
        if not sample_entries:
            return StepResult([], None, None, prompt_rows)
        first = len(logit_rows) - len(sample_entries)
        reqs = [batch.entries[i].req for i in sample_entries]
        masks, mask_rows = self._grammar_masks(reqs)
        # The backend's own kernel: the generic torch one costs tens of ms per step at a 32k vocab on CPU.
        apply_mask = self.grammar_backend.apply_bitmask if masks is not None else None
        out = self.sampler.sample(logits[first:], reqs, masks, mask_rows, apply_mask)
        return StepResult(out.token_ids, out.logprobs, out.top_logprobs, prompt_rows)

    def _run(self, plan: ForwardPlan, layer_wait: Optional[Callable[[int], None]] = None) -> torch.Tensor:
        """The float32 logits of the plan's rows: one forward over this rank's weights and pool."""
        dev = self.device
        positions = torch.cat([torch.arange(p, p + n) for p, n in zip(plan.prefix_lens, plan.extend_lens)])
        out_slots = torch.cat([s[p:] for s, p in zip(plan.kv_slots, plan.prefix_lens)]).to(dev)
        meta = ForwardMetadata(
            extend_lens=plan.extend_lens, prefix_lens=plan.prefix_lens, kv_slots=[s.to(dev) for s in plan.kv_slots],
            out_slots=out_slots, logits_indices=plan.logits_rows.to(dev),
            layer_wait=layer_wait, batch_invariant=self.args.enable_deterministic_inference,
            paged_kernel=self.paged_kernel, extend_kernel=self.extend_kernel)
        return self.model(plan.ids.to(dev), positions.to(dev), meta, self.pool).float()

    def follow(self, handoff: Optional[RankHandoff] = None) -> None:
        """Ranks > 0: run rank 0's plans until it sends STOP (RankFailure if the group breaks): their copies and
        ops on this rank's share of the cache tiers (runtime/rank_cache.py), then the forward, the round trip
        or the agreement; a HANDOFF plan's call is answered by `handoff` (this rank's part of the PD handoff)."""
        from kvstrata.runtime.rank_cache import RankCache

        cache = RankCache(self.args, self.pool, self.model_path, self.tp.rank)
        ledger = PlanLedger()
        while True:
            kind, plan = receive_plan(self.tp, ledger)
            if kind == PlanKind.REPORT:
                gather_ledgers(self.tp, ledger, cache.state())
                continue
            if kind == PlanKind.HANDOFF:
                request = receive_request(self.tp)
                answer = handoff.answer if handoff is not None else no_handoff
                gather_answers(self.tp, answer_safely(answer, request, self.tp.rank))
                continue
            answers = cache.apply(plan.copies)
            if kind == PlanKind.STOP:
                cache.close()            # this rank's last L3 writes
                return
            if kind == PlanKind.FORWARD:
                self._run(plan)
            elif kind == PlanKind.IDLE:
                self.tp.all_min([1])     # the round trip that tells rank 0 this rank is alive
            elif kind == PlanKind.AGREE:
                self.tp.all_min(answers)

    @property
    def copy_journal(self) -> Optional[Callable[[str, torch.Tensor, torch.Tensor], None]]:
        """Rank 0 under tensor parallelism: what its cache tells each device <-> host copy (sent with the next plan)."""
        return self.ranks.record_copy if self.ranks is not None else None

    def call_ranks(self, request: bytes, local: Callable[[bytes], bytes]) -> list[bytes]:
        """Every rank's answer to a PD handoff's call, in rank order (runtime/handoff.py: HandoffHost.call_ranks)."""
        if self.ranks is None:
            return [answer_safely(local, request, 0)]
        return self.ranks.call(request, local)

    @property
    def rank_link(self) -> Optional[RankLink]:
        """Rank 0 under tensor parallelism: how its cache's L3 ops and snapshots reach the other ranks."""
        return self.ranks

    def idle(self) -> None:
        """Called by the scheduler loop while it has nothing to run: keeps the other ranks' collectives alive."""
        if self.ranks is not None:
            self.ranks.beat()

    def parallel_state(self) -> dict:
        """Tensor parallelism for /server_info: size, this node's rank pids (rank order), the collectives' path
        (shm, gloo or nccl), rank 0's time in collectives, and what every rank has executed (`tp_ranks`;
        `tp_ranks_agree`: all equal)."""
        if self.ranks is None:
            return {"tp_size": 1}
        tp = self.ranks.tp
        ranks, caches = self.ranks.report()
        return {"tp_size": tp.size, "tp_rank_pids": [os.getpid(), *(p.pid for p in self.ranks.procs.values())],
                "tp_collectives": tp.collectives, "tp_comm_s": tp.comm_s, "tp_comm_calls": tp.comm_calls,
                "tp_ranks": ranks, "tp_ranks_agree": all(r == ranks[0] for r in ranks), "tp_rank_caches": caches}

    def close(self) -> None:
        """Stop the other ranks (rank 0; nothing to do otherwise)."""
        if self.ranks is not None:
            ranks, self.ranks = self.ranks, None
            ranks.close()

    def _grammar_masks(self, reqs) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        rows = [k for k, r in enumerate(reqs) if r.grammar is not None]
        if not rows or self.grammar_backend is None:
            return None, None
        mask = self.grammar_backend.allocate_bitmask(len(reqs))
        for k in rows:
            reqs[k].grammar.fill_bitmask(mask, k)
        return mask, torch.tensor(rows, dtype=torch.long)


def _tokens(req, start: int, end: int) -> list[int]:
    """Tokens [start, end) of prompt + output, without building the whole list for a decode step."""
    n_prompt = len(req.prompt_ids)
    if start >= n_prompt:
        return req.output_ids[start - n_prompt: end - n_prompt]
    if end <= n_prompt:
        return req.prompt_ids[start:end]
    return req.prompt_ids[start:] + req.output_ids[: end - n_prompt]
