"""ServerArgs: every setting of kvstrata in one frozen dataclass; the CLI is generated from it.

Flag names follow SGLang (`--model-path`, `--page-size`, `--hicache-ratio`, ...) so that existing launch
scripts work unchanged. `resolve()` returns a copy with derived values filled in (device, dtype, seed);
nothing mutates a ServerArgs after start-up. The HTTP server resolves all but the device-dependent values
(no torch there); its scheduler process resolves the rest and sends that copy back when it is ready.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
from dataclasses import dataclass, field
from typing import Any, Optional

from kvstrata.args_checks import (  # DISAGGREGATION_SECRET_ENV re-exported: the cluster plan and tests use it
    DISAGGREGATION_SECRET_ENV,
    check_disaggregation_exposure,
    check_server_args,
)
from kvstrata.cache.config import CacheConfig
from kvstrata.cache.eviction import EVICTION_POLICIES as EVICTION_KEYS
from kvstrata.cache.write_policy import WRITE_POLICIES
from kvstrata.config_cli import (  # re-exported: the rest of kvstrata imports them from here
    ConfigError,
    add_dataclass_cli_args,
    cli_option,
    dataclass_from_cli_args,
    flag_name,
)
from kvstrata.model.quant.scheme import METHODS as QUANTIZATION_METHODS
from kvstrata.platform import cpu_has_fast_bf16, env

_opt = cli_option


def _no_effect(why: str) -> dict:
    """An SGLang flag accepted so that launch lines work unchanged; it changes nothing on this engine."""
    return _opt(f"Accepted for SGLang compatibility; no effect here: {why}.", no_effect=why)


def _only(value: Any, why: str, help: str, aliases: tuple[str, ...] = ()) -> dict:
    """An SGLang setting whose only value here is `value`; any other is a start-up error saying `why`."""
    return {**_opt(help, aliases=aliases), "only": (value, why)}


SCHEDULE_POLICIES = ["fcfs", "lpm", "lof", "priority", "random"]
EVICTION_POLICIES = list(EVICTION_KEYS)
MEM_LAYOUTS = ["layer_first", "page_first"]
STORAGE_BACKENDS = ["file", "mooncake"]
PREFETCH_POLICIES = ["best_effort", "wait_complete", "timeout"]
DTYPES = ["auto", "bfloat16", "float32", "float16", "half", "float"]
KV_CACHE_DTYPES = ["auto", "fp8_e4m3", "fp8_e5m2"]      # memory/kv_format.py's (SGLang's names)
EXPERT_RECORDER_MODES = ["stat"]     # SGLang's per-pass and per-token modes are not kept
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}     # SGLang's (and vLLM's) short names
LOAD_FORMATS = ["auto", "safetensors", "gguf", "dummy"]
TOOL_CALL_PARSERS = ["hermes", "qwen", "qwen25", "qwen3", "llama3"]
DISAGGREGATION_MODES = ["null", "prefill", "decode"]
# On CPU a step of 256 prefill tokens is compute-bound: prompts that arrive together are prefilled one per
# step from there (multi-turn mean TTFT -10 to -19%, same throughput; docs/benchmarks.md, issue 19).
CPU_PREFILL_ADMIT_THRESHOLD = 256
TRANSFER_BACKENDS = ["mooncake"]


# `kvstrata serve --help` headings, in SGLang's order where it has the section: the first field of each.
CLI_GROUPS = {
    "model_path": "Model and tokenizer",
    "host": "HTTP server",
    "page_size": "Memory and scheduling",
    "disable_radix_cache": "Radix cache",
    "enable_hierarchical_cache": "Hierarchical cache: host tier (L2)",
    "hicache_storage_backend": "Hierarchical cache: storage tier (L3)",
    "grammar_backend": "Constrained decoding",
    "chat_template": "API, logging and metrics",
    "tp_size": "Tensor parallelism",
    "dp_size": "SGLang settings with one value here (parallelism, quantization, LoRA, MoE, ...)",
    "trust_remote_code": "SGLang settings with no effect here (kernels, CUDA graphs, distributed init, ...)",
    "admin_api_key": "Hardening: admin actions, request limits, shutdown",
    "disaggregation_mode": "Prefill/decode disaggregation",
}


@dataclass(frozen=True)
class ServerArgs:
    """All configuration. Field names are SGLang's where SGLang has the setting."""

    # --- model ---
    model_path: str = field(default="tiny", metadata=_opt(
        "The model: a local Hugging Face checkpoint folder, a GGUF file, a built-in model ('tiny', the "
        "default, 'bench' or 'bench-moe'), or a Hugging Face id (org/name) already in the local Hugging Face cache "
        "($HF_HUB_CACHE, $HF_HOME/hub or ~/.cache/huggingface/hub; nothing is downloaded: run "
        "`huggingface-cli download ID` first).", aliases=("--model",)))
    tokenizer_path: Optional[str] = field(default=None, metadata=_opt(
        "Tokenizer: the same kinds of reference as --model-path (default: the model's; with --load-format "
        "dummy and no tokenizer files there, the built-in 'bench' or 'tiny' tokenizer that fits the "
        "vocabulary)."))
    revision: Optional[str] = field(default=None, metadata=_opt(
        "Snapshot of a Hugging Face id in the cache: a branch or tag the cache has a ref for (default "
        "'main'), or a commit hash; applies to --model-path and --tokenizer-path ids."))
    load_format: str = field(default="auto", metadata=_opt(
        "How weights are loaded: auto (safetensors files, or the GGUF file given), safetensors, gguf, or "
        "dummy (deterministic random weights from config.json alone, to measure a model's shape without "
        "its weights).", LOAD_FORMATS))
    served_model_name: Optional[str] = field(default=None, metadata=_opt(
        "Model name reported by the API (default: model path)."))
    dtype: str = field(default="auto", metadata=_opt(
        "Weight dtype, and the KV dtype unless --kv-cache-dtype says otherwise. 'auto': bfloat16 on CUDA and on CPUs "
        "with AVX-512 BF16/AMX, else float32.", DTYPES))
    kv_cache_dtype: str = field(default="auto", metadata=_opt(
        "KV cache dtype in every tier (device pool, host pool, L3 objects, L2 snapshot, PD transfer): 'auto' = "
        "--dtype; fp8_e4m3 / fp8_e5m2 store half the bytes of bf16 (twice the tokens per byte), scaled by the "
        "checkpoint's per-layer k_scale / v_scale where it has them, else 1.0.", KV_CACHE_DTYPES))
    context_length: Optional[int] = field(default=None, metadata=_opt(
        "Maximum context length (default: the model's max_position_embeddings)."))
    device: str = field(default="auto", metadata=_opt("Device: 'auto', 'cpu' or 'cuda'.", ["auto", "cpu", "cuda"]))
    base_gpu_id: int = field(default=0, metadata=_opt(
        "CUDA: the GPU this server uses (cuda:N); useful for several servers on one machine. CPU: unused."))
    random_seed: Optional[int] = field(default=None, metadata=_opt("Seed for unseeded sampling (default: random)."))
    num_threads: Optional[int] = field(default=None, metadata=_opt(
        "torch intra-op threads on CPU (default: torch's choice)."))
    enable_deterministic_inference: bool = field(default=False, metadata=_opt(
        "Batch-invariant forward and sampling: a request's logits, tokens and logprobs are bit-identical "
        "whether it runs alone or in any batch, at any chunked-prefill split, with any cache hits."))
    quantization: Optional[str] = field(default=None, metadata=_opt(
        "Weight quantization, checked against the checkpoint at start-up: awq, gptq (4-bit int4 with group "
        "scales), fp8 (e4m3 with per-tensor or block scales) and gguf (a .gguf file) name the checkpoint's own "
        "format, which is also used without the flag; int8 quantizes a float checkpoint's layer weights at "
        "load to weight-only int8 per output channel (half of bf16's memory). A flag that does not fit the "
        "checkpoint is a start-up error.", QUANTIZATION_METHODS))
    disable_cpu_kernels: bool = field(default=False, metadata=_opt(
        "CPU only: plain torch instead of the compiled kernels (paged and extend attention reading K/V in "
        "place, silu*mul, the decode GEMV, fused residual-add + RMSNorm, the rotary embedding, the greedy "
        "argmax; built once per machine with the C++ compiler; without one, plain torch is used anyway)."))

    # --- HTTP server ---
    host: str = field(default="127.0.0.1", metadata=_opt("HTTP host to bind."))
    port: int = field(default=30000, metadata=_opt("HTTP port."))
    api_key: Optional[str] = field(default=None, metadata=_opt("Require this API key (Bearer token)."))
    log_level: str = field(default="info", metadata=_opt(
        "Logging level.", ["debug", "info", "warning", "error", "critical"]))
    stream_interval: int = field(default=1, metadata=_opt(
        "Tokens per streamed chunk: a streaming request gets an update every this many new tokens (the "
        "first token and the last chunk are sent at once)."))

    # --- device KV pool (L1) and scheduling ---
    page_size: int = field(default=1, metadata=_opt("Tokens per KV page."))
    kv_run_spare_tokens: int = field(default=128, metadata=_opt(
        "Free KV slots set aside behind a request's new pages so that its next tokens follow them in one run "
        "(they still count as free); 0 places each new page wherever one is free."))
    max_total_tokens: Optional[int] = field(default=None, metadata=_opt(
        "Size of the device KV pool in tokens (default: from --mem-fraction-static)."))
    mem_fraction_static: Optional[float] = field(default=None, metadata=_opt(
        "Fraction of device memory for weights + KV pool (CUDA: 0.85 of free memory; CPU: 0.25 of RAM)."))
    max_running_requests: Optional[int] = field(default=None, metadata=_opt(
        "Maximum number of requests decoding at once (default: 256)."))
    chunked_prefill_size: Optional[int] = field(default=None, metadata=_opt(
        "Maximum prefill tokens per forward step; longer prompts are chunked (default 2048 on CPU, 8192 on "
        "CUDA; -1 disables chunking)."))
    max_prefill_tokens: int = field(default=16384, metadata=_opt(
        "Maximum prompt tokens admitted into one prefill step when chunking is disabled."))
    prefill_admit_threshold: Optional[int] = field(default=None, metadata=_opt(
        "Stop admitting new prompts into a forward step once it holds this many prefill tokens; 0 fills the "
        "--chunked-prefill-size budget, as SGLang does (default: 256 on CPU, 0 on CUDA). A CPU step of ~256 "
        "tokens is already compute-bound, so there prompts that arrive together get their first tokens one "
        "step after another instead of all at the end of one big step."))
    preempt_for_first_token: bool = field(default=True, metadata=_opt(
        "When the device pool is full, let a request still waiting for its first token pause decoding "
        "requests (those with the most tokens left): their KV stays in the radix tree and the host tier, "
        "and they resume by load-back, not recompute. Needs --enable-hierarchical-cache; a paused request "
        "never pauses another, and none is paused while one waits."))
    schedule_policy: str = field(default="fcfs", metadata=_opt(
        "Order of the waiting queue: fcfs (arrival), lpm (longest cached prefix first), lof (longest output "
        "first: largest max_new_tokens), priority (the request's `priority`, as --enable-priority-scheduling) "
        "or random.", SCHEDULE_POLICIES))
    enable_priority_scheduling: bool = field(default=False, metadata=_opt(
        "Order the waiting queue by each request's `priority` field first (higher values first, as SGLang; "
        "see --schedule-low-priority-values-first), then by --schedule-policy. Running requests are not "
        "preempted for a higher-priority one."))
    schedule_low_priority_values_first: bool = field(default=False, metadata=_opt(
        "With priority scheduling (and --radix-eviction-policy priority): lower `priority` values are more "
        "important."))
    default_priority_value: Optional[int] = field(default=None, metadata=_opt(
        "Priority of a request that gives none (default 0)."))
    abort_on_priority_when_disabled: bool = field(default=False, metadata=_opt(
        "Refuse (HTTP 400) a request that gives a `priority` while priority scheduling is off."))
    max_queued_requests: Optional[int] = field(default=None, metadata=_opt(
        "Most requests that may wait in the scheduler's queue; one more gets HTTP 503 with Retry-After at "
        "once (default: no limit)."))

    # --- L1 radix cache ---
    disable_radix_cache: bool = field(default=False, metadata=_opt("Disable prefix sharing (RadixAttention)."))
    radix_eviction_policy: str = field(default="lru", metadata=_opt(
        "Eviction policy of the radix tree.", EVICTION_POLICIES))

    # --- L2 host tier (HiCache) ---
    enable_hierarchical_cache: bool = field(default=False, metadata=_opt(
        "Add the host-memory tier (L2) under the radix cache."))
    hicache_ratio: float = field(default=2.0, metadata=_opt("Host pool size as a multiple of the device pool."))
    hicache_size: int = field(default=0, metadata=_opt("Host pool size in GB (overrides --hicache-ratio)."))
    hicache_write_policy: str = field(default="write_through", metadata=_opt(
        "When device pages are copied to host.", list(WRITE_POLICIES)))
    hicache_mem_layout: str = field(default="page_first", metadata=_opt(
        "Host pool layout (default page_first, as SGLang: one page is one contiguous block, so a Mooncake "
        "object of one page moves zero-copy).", MEM_LAYOUTS))
    hicache_snapshot_path: Optional[str] = field(default=None, metadata=_opt(
        "File the host tier (L2) is saved to when the server stops, and reloaded from (each page verified "
        "against its key) when it starts, so a restart or in-place upgrade keeps L2 warm."))

    # --- L3 storage tier ---
    hicache_storage_backend: Optional[str] = field(default=None, metadata=_opt(
        "Storage tier (L3) backend.", STORAGE_BACKENDS))
    hicache_storage_prefetch_policy: str = field(default="timeout", metadata=_opt(
        "How long a new request waits for its L3 prefetch: not at all (best_effort), until it is done "
        "(wait_complete), or up to a timeout that grows with its size (timeout, the default).",
        PREFETCH_POLICIES))
    hicache_storage_backend_extra_config: Optional[str] = field(default=None, metadata=_opt(
        "JSON object (or @path to a JSON file) with backend settings. File backend: capacity_gb or "
        "capacity_bytes (default: half of the directory's filesystem free space at start, plus the pages "
        "already stored; LRU eviction beyond it), low_watermark, rescan_interval_s."))
    hicache_storage_dir: Optional[str] = field(default=None, metadata=_opt(
        "Directory of the file backend (default: $KVSTRATA_STORAGE_DIR or ~/.cache/kvstrata/kv)."))
    hicache_storage_page_tokens: int = field(default=64, metadata=_opt(
        "Tokens per storage (L3) object, independent of --page-size: consecutive pages are stored as one "
        "object (file or Mooncake key). A multiple of --page-size; a value below it means one page."))
    kv_events_config: Optional[str] = field(default=None, metadata=_opt(
        "Publish KV cache events (JSON, vLLM's and SGLang's fields): {\"enable_kv_cache_events\": true, "
        "\"publisher\": \"zmq\", \"endpoint\": \"tcp://127.0.0.1:5557\", \"replay_endpoint\": ..., \"topic\": ..., "
        "\"buffer_steps\": ..., \"hwm\": ...}. Blocks are L3 page groups (--hicache-storage-page-tokens), "
        "announced per tier: CPU or GPU (L1), CPU_PINNED (L2), DISK or MOONCAKE (L3). Endpoints must be on "
        "loopback unless \"allow_remote_subscribers\": true. Off by default."))

    # --- structured output ---
    grammar_backend: str = field(default="xgrammar", metadata=_opt(
        "Constrained decoding backend.", ["xgrammar", "none"]))
    constrained_json_disable_any_whitespace: bool = field(default=False, metadata=_opt(
        "In JSON-schema decoding allow only compact whitespace (models that know nothing finish sooner)."))
    constrained_json_whitespace_pattern: Optional[str] = field(default=None, metadata=_opt(
        "Regex of the whitespace allowed between JSON tokens in JSON-schema decoding (default: at most a "
        "newline and a few spaces, so that real models cannot loop on whitespace)."))

    # --- chat, tools, logging, metrics ---
    chat_template: Optional[str] = field(default=None, metadata=_opt(
        "Chat template: a Jinja file (.jinja, or a .json with a 'chat_template' key) or a built-in name "
        "(chatml, llama-3-instruct); default: the tokenizer's."))
    tool_call_parser: Optional[str] = field(default=None, metadata=_opt(
        "Tool-call format to parse from model output: hermes/qwen/qwen25/qwen3 (<tool_call> JSON) or llama3 "
        "(a JSON object); default: inferred from the chat template.", TOOL_CALL_PARSERS))
    reasoning_parser: Optional[str] = field(default=None, metadata=_opt(
        "Reasoning format: text between <think> and </think> is returned as reasoning_content in chat "
        "completions (SGLang's names, e.g. qwen3, deepseek-r1)."))
    log_requests: bool = field(default=False, metadata=_opt("Log every request and its outcome."))
    log_requests_level: int = field(default=0, metadata=_opt(
        "With --log-requests: 0 metadata, 1 + sampling params, 2 + the first 200 characters of input "
        "and output, 3 + the whole input and output.", [0, 1, 2, 3]))
    enable_metrics: bool = field(default=True, metadata=_opt(
        "Serve Prometheus metrics at /metrics (on by default here; --no-enable-metrics turns it off)."))

    # --- tensor parallelism (kvstrata/model/parallel.py, runtime/ranks.py) ---
    tp_size: int = field(default=1, metadata=_opt(
        "Tensor parallel size: the model is split over this many processes (ranks), one per GPU from "
        "--base-gpu-id on CUDA, one per set of cores on CPU ($SGLANG_CPU_OMP_THREADS_BIND, e.g. '0-27|28-55', "
        "else the cores split evenly). Rank 0 schedules; the others run the same forwards on their shard. "
        "Every cache tier, the L2 snapshot and PD disaggregation are sharded per rank. On an MoE model every rank "
        "holds its slice of every expert (SGLang's default), unless --ep-size N splits whole experts.",
        aliases=("--tp", "--tensor-parallel-size")))
    ep_size: int = field(default=1, metadata=_opt(
        "Expert parallel size for MoE models: 1 (with --tp-size N each rank holds 1/N of every expert's "
        "intermediate features), or --tp-size (each rank holds num_experts / N whole experts, plus any "
        "--ep-num-redundant-experts copies; with "
        "--enable-deterministic-inference each token's expert outputs are combined in the same order as on one "
        "rank).",
        aliases=("--expert-parallel-size",)))
    ep_num_redundant_experts: int = field(default=0, metadata=_opt(
        "With --ep-size N: this many spare expert copies per MoE layer, each on another rank than the "
        "expert's first copy; a replicated expert's rows are split between its copies batch by batch so the "
        "ranks' rows even out. Memory: (experts + this) / N experts per rank. Which experts get the copies: "
        "--init-expert-location."))
    init_expert_location: str = field(default="trivial", metadata=_opt(
        "Where the experts live under --ep-size: 'trivial' (rank r holds a contiguous range; spare copies: "
        "experts 0, 1, ...), or a .json file (or inline JSON) with a 'physical_to_logical_map' [layer][slot], "
        "or with a 'logical_count' [layer][expert] as /dump_expert_distribution_record returns it: the copies "
        "then go to the busiest experts and the ranks' recorded rows are evened out. SGLang's .pt dumps load "
        "too (tensors only)."))
    expert_distribution_recorder_mode: Optional[str] = field(default=None, metadata=_opt(
        "'stat': count the rows the router sends to each (layer, expert) between "
        "/start_expert_distribution_record and /stop_expert_distribution_record (admin routes); "
        "/dump_expert_distribution_record returns the counts as JSON, which --init-expert-location reads.",
        EXPERT_RECORDER_MODES))
    nnodes: int = field(default=1, metadata=_opt(
        "Number of machines the --tp-size ranks are spread over (evenly; needs --dist-init-addr)."))
    node_rank: int = field(default=0, metadata=_opt(
        "This machine's index among --nnodes: 0 runs the HTTP server and rank 0; the others run their ranks only."))
    dist_init_addr: Optional[str] = field(default=None, metadata=_opt(
        "host:port where the ranks meet (rank 0's machine; default with one node: a free loopback port).",
        aliases=("--nccl-init-addr",)))
    dist_timeout: Optional[int] = field(default=None, metadata=_opt(
        "Seconds a rank waits in a collective (or for its peers at start) before it declares the group failed "
        "and the server stops (default 60)."))
    disable_custom_all_reduce: bool = field(default=False, metadata=_opt(
        "Run the model's all-reduce and all-gather through torch.distributed (gloo) even when every rank is a "
        "CPU process on this machine; by default those use a shared-memory segment between the ranks "
        "(kvstrata/model/shm_collectives.py). Multi-node groups and CUDA (NCCL) always use torch.distributed."))

    # --- SGLang settings with only one value here: any other is a start-up error that says why ---
    dp_size: int = field(default=1, metadata=_only(
        1, "data parallelism is not implemented; run one server per device behind a router",
        "Data parallel size (only 1).", aliases=("--dp", "--data-parallel-size")))
    pp_size: int = field(default=1, metadata=_only(
        1, "pipeline parallelism is not implemented", "Pipeline parallel size (only 1).",
        aliases=("--pipeline-parallel-size",)))
    enable_dp_attention: bool = field(default=False, metadata=_only(
        False, "data-parallel attention is not implemented", "Data-parallel attention (not supported)."))
    speculative_algorithm: Optional[str] = field(default=None, metadata=_only(
        None, "speculative decoding is not implemented", "Speculative decoding algorithm (not supported)."))
    speculative_draft_model_path: Optional[str] = field(default=None, metadata=_only(
        None, "speculative decoding is not implemented", "Draft model (not supported)."))
    speculative_num_steps: Optional[int] = field(default=None, metadata=_only(
        None, "speculative decoding is not implemented", "Speculative steps (not supported)."))
    speculative_eagle_topk: Optional[int] = field(default=None, metadata=_only(
        None, "speculative decoding is not implemented", "EAGLE top-k (not supported)."))
    speculative_num_draft_tokens: Optional[int] = field(default=None, metadata=_only(
        None, "speculative decoding is not implemented", "Draft tokens (not supported)."))
    lora_paths: tuple[str, ...] = field(default=(), metadata=_only(
        (), "LoRA adapters are not supported", "LoRA adapters (not supported)."))
    enable_lora: bool = field(default=False, metadata=_only(False, "LoRA adapters are not supported",
                                                            "LoRA (not supported)."))
    is_embedding: bool = field(default=False, metadata=_only(
        False, "embedding models are not supported: only generation (/generate, /v1/completions, "
        "/v1/chat/completions)", "Serve a CausalLM as an embedding model (not supported)."))
    enable_multimodal: bool = field(default=False, metadata=_only(
        False, "multimodal inputs are not supported (text models only)", "Multimodal inputs (not supported)."))
    skip_tokenizer_init: bool = field(default=False, metadata=_only(
        False, "the server always tokenizes and detokenizes (send input_ids to skip tokenizing a prompt)",
        "Skip the tokenizer (not supported)."))
    json_model_override_args: str = field(default="{}", metadata=_only(
        "{}", "the model config is read as config.json has it (edit a copy of the folder instead)",
        "Overrides of config.json (not supported)."))
    cpu_offload_gb: int = field(default=0, metadata=_only(
        0, "weight offloading to host memory is not implemented (on CPU the weights are in host memory "
        "anyway: drop the flag)", "GB of weights offloaded to host memory (only 0)."))
    enable_lmcache: bool = field(default=False, metadata=_only(
        False, "the host (L2) and storage (L3) tiers are built in: use --enable-hierarchical-cache and "
        "--hicache-storage-backend", "LMCache (not supported)."))
    moe_runner_backend: Optional[str] = field(default=None, metadata=_only(
        None, "MoE layers run on the built-in fused experts (no other runner)", "MoE kernels (not supported)."))
    moe_a2a_backend: Optional[str] = field(default=None, metadata=_only(
        None, "expert parallelism (--ep-size) combines the experts' rows with one all-reduce, not an all-to-all",
        "MoE all-to-all backend (not supported)."))
    enable_eplb: bool = field(default=False, metadata=_only(
        False, "experts are placed by id (--ep-size), not rebalanced by load", "Expert load balancing (not "
        "supported)."))

    # --- SGLang flags accepted with no effect on this engine (logged once at start) ---
    trust_remote_code: bool = field(default=False, metadata=_no_effect(
        "only the built-in Llama-family code runs; a checkpoint's own Python code is never executed"))
    disable_cuda_graph: bool = field(default=False, metadata=_no_effect("CUDA graphs are not used"))
    cuda_graph_max_bs: Optional[int] = field(default=None, metadata=_no_effect("CUDA graphs are not used"))
    attention_backend: Optional[str] = field(default=None, metadata=_no_effect(
        "attention always runs on torch SDPA over the paged pool"))
    sampling_backend: Optional[str] = field(default=None, metadata=_no_effect("sampling always runs in torch"))
    enable_cache_report: bool = field(default=False, metadata=_no_effect(
        "usage.prompt_tokens_details.cached_tokens is always reported"))
    show_time_cost: bool = field(default=False, metadata=_no_effect(
        "per-request latencies are in /metrics (histograms) and meta_info.e2e_latency"))
    disable_overlap_schedule: bool = field(default=False, metadata=_no_effect(
        "the scheduler does not overlap CPU scheduling with the forward"))
    enable_torch_compile: bool = field(default=False, metadata=_no_effect("torch.compile is not used"))
    enable_mixed_chunk: bool = field(default=False, metadata=_no_effect(
        "prefill chunks and decodes are always mixed in one batch"))
    skip_server_warmup: bool = field(default=False, metadata=_no_effect("the server does no warm-up request"))
    tokenizer_mode: str = field(default="auto", metadata=_no_effect("the fast tokenizer is always used"))
    model_impl: str = field(default="auto", metadata=_no_effect(
        "only the built-in Llama-family implementation exists"))
    gpu_id_step: int = field(default=1, metadata=_no_effect("a server uses one device"))
    nccl_port: Optional[int] = field(default=None, metadata=_no_effect("the ranks meet at --dist-init-addr"))
    cuda_graph_bs: tuple[int, ...] = field(default=(), metadata=_no_effect("CUDA graphs are not used"))
    disable_cuda_graph_padding: bool = field(default=False, metadata=_no_effect("CUDA graphs are not used"))
    decode_attention_backend: Optional[str] = field(default=None, metadata=_no_effect(
        "attention always runs on the built-in paged kernels (or torch SDPA)"))
    prefill_attention_backend: Optional[str] = field(default=None, metadata=_no_effect(
        "attention always runs on the built-in paged kernels (or torch SDPA)"))
    hicache_io_backend: str = field(default="kernel", metadata=_no_effect(
        "host <-> device copies are torch copies on worker threads (CUDA streams on GPU)"))
    disable_priority_preemption: bool = field(default=False, metadata=_no_effect(
        "running requests are never preempted for a higher-priority one"))
    priority_scheduling_preemption_threshold: int = field(default=10, metadata=_no_effect(
        "running requests are never preempted for a higher-priority one"))
    schedule_conservativeness: float = field(default=1.0, metadata=_no_effect(
        "decode headroom is reserved from each request's max_new_tokens"))
    num_continuous_decode_steps: int = field(default=1, metadata=_no_effect("one decode step per schedule"))
    tokenizer_worker_num: int = field(default=1, metadata=_no_effect("one tokenizer in the HTTP process"))
    enable_p2p_check: bool = field(default=False, metadata=_no_effect("there is one device"))
    enable_nccl_nvls: bool = field(default=False, metadata=_no_effect("there is one device"))
    triton_attention_reduce_in_fp32: bool = field(default=False, metadata=_no_effect("Triton is not used"))
    log_level_http: Optional[str] = field(default=None, metadata=_no_effect("HTTP access logs are off"))
    decode_log_interval: int = field(default=40, metadata=_no_effect(
        "decode throughput is in /metrics and /server_info"))
    sleep_on_idle: bool = field(default=False, metadata=_no_effect("an idle scheduler always sleeps"))

    # --- hardening: admin actions, request limits, shutdown ---
    admin_api_key: Optional[str] = field(default=None, metadata=_opt(
        "Key for admin actions (/abort_request, /prefetch, the expert distribution recorder's routes); "
        "--api-key does not grant them. Without it, only loopback clients may use them."))
    max_request_body_bytes: int = field(default=16 << 20, metadata=_opt(
        "Largest accepted request body; larger ones get HTTP 413 before they are read."))
    watchdog_timeout: Optional[float] = field(default=300.0, metadata=_opt(
        "Seconds the scheduler may spend in one loop iteration (a forward step) before the server kills it "
        "and exits with code 3, for its supervisor to restart it (SGLang's flag; 0 disables)."))
    scheduler_heartbeat_timeout: float = field(default=20.0, metadata=_opt(
        "/health answers 503 when the scheduler loop has not completed an iteration for this many seconds "
        "(an idle loop iterates every 100 ms; a step longer than this reads as unhealthy)."))
    max_connections: Optional[int] = field(default=None, metadata=_opt(
        "Most HTTP connections open at once; beyond it the oldest connection still sending its request "
        "headers is closed (default: the open-file limit less max(limit/8, 64 + 4 accept bursts of "
        "min(512, limit/8)): 448 for a limit of 1,024)."))
    header_read_timeout: float = field(default=10.0, metadata=_opt(
        "Seconds a client may take to send a request's headers before its connection is closed (slow and "
        "half-open clients)."))
    graceful_shutdown_timeout: float = field(default=30.0, metadata=_opt(
        "On SIGTERM, seconds that running requests may take to finish (new ones get 503); what is left "
        "then ends with finish_reason 'abort'."))

    # --- prefill/decode disaggregation (kvstrata/disagg) ---
    disaggregation_mode: str = field(default="null", metadata=_opt(
        "PD disaggregation role: null (co-located), prefill or decode.", DISAGGREGATION_MODES))
    disaggregation_transfer_backend: str = field(default="mooncake", metadata=_opt(
        "KV transfer engine between prefill and decode servers.", TRANSFER_BACKENDS))
    disaggregation_bootstrap_port: int = field(default=8998, metadata=_opt(
        "Prefill side: port of the bootstrap service decode servers connect to."))
    disaggregation_ib_device: Optional[str] = field(default=None, metadata=_opt(
        "RDMA device(s) for the transfer engine (accepted; TCP is used where no RDMA device exists)."))
    disaggregation_bootstrap_timeout: float = field(default=30.0, metadata=_opt(
        "Seconds either side waits for its peer (SGLang: SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT) before it "
        "frees the request's KV and fails it."))
    disaggregation_secret: Optional[str] = field(default=None, repr=False, metadata=_opt(
        f"Shared secret of a prefill/decode group: every bootstrap message is signed with it (HMAC-SHA256) and "
        f"a message without it is dropped. Default: ${DISAGGREGATION_SECRET_ENV}. Required when the PD host "
        f"is not a loopback address; never logged."))
    disaggregation_advertise_host: Optional[str] = field(default=None, metadata=_opt(
        "Address this server's PD sockets (bootstrap channel, transfer engine) bind and advertise to their "
        "peers (SGLang reads SGLANG_HOST_IP for it). Default: --host; required when --host is a wildcard "
        "(0.0.0.0, ::), which peers cannot connect to."))

    # ------------------------------------------------------------------ CLI
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add one `--flag-name` per field to `parser`."""
        add_dataclass_cli_args(parser, ServerArgs, CLI_GROUPS, argparse_choices=False)

    @staticmethod
    def from_cli_args(ns: argparse.Namespace) -> ServerArgs:
        """Build ServerArgs from parsed CLI arguments (unknown attributes are ignored)."""
        return dataclass_from_cli_args(ServerArgs, ns)

    @staticmethod
    def from_kwargs(**kwargs: Any) -> ServerArgs:
        """Build ServerArgs from keyword arguments, naming any unknown one."""
        names = {f.name for f in dataclasses.fields(ServerArgs)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ConfigError(f"unknown server argument(s): {', '.join(unknown)}")
        return ServerArgs(**kwargs)

    # ------------------------------------------------------------------ checks
    def __post_init__(self) -> None:
        check_server_args(self)

    def no_effect_notes(self) -> list[str]:
        """One line per SGLang flag that was set but means nothing on this engine (logged once at start)."""
        notes = []
        for f in dataclasses.fields(self):
            why = f.metadata.get("no_effect")
            if why and getattr(self, f.name) != f.default:
                notes.append(f"--{flag_name(f.name)} has no effect on kvstrata: {why}")
        return notes

    # ------------------------------------------------------------------ derived values
    def resolve(self, with_device: bool = True) -> ServerArgs:
        """Return a copy with every 'auto'/None that has a derived value filled in.

        Model and tokenizer references become local paths or built-in names (a Hugging Face id: its snapshot
        folder in the local cache, `kvstrata/model/reference.py`; the served name stays the id), and SGLang's
        dtype names `half` / `float` become `float16` / `float32`.

        Device, dtype, chunked_prefill_size and prefill_admit_threshold depend on CUDA being available, which needs torch: with
        `with_device=False` they stay as given, for the HTTP process, which never imports torch; the
        scheduler process resolves them (resolving twice changes nothing) and reports its copy back.
        """
        from kvstrata.model.reference import ModelNotFound, resolve_model_references

        try:
            model_path, tokenizer_path = resolve_model_references(self.model_path, self.tokenizer_path,
                                                                  self.revision, self.load_format)
        except ModelNotFound as e:
            raise ConfigError(str(e)) from None
        from kvstrata.model.gguf import is_gguf
        from kvstrata.model.quant.scheme import QuantizationError, effective_quantization

        try:
            quantization = effective_quantization(self.quantization, model_path, self.load_format, is_gguf(model_path))
        except QuantizationError as e:
            raise ConfigError(str(e)) from None
        args = dataclasses.replace(
            self,
            model_path=model_path,
            quantization=quantization,
            tokenizer_path=tokenizer_path,
            served_model_name=self.served_model_name or self.model_path,
            dtype=_DTYPE_ALIASES.get(self.dtype, self.dtype),
            random_seed=self.random_seed if self.random_seed is not None else random.randrange(1 << 30),
            max_running_requests=self.max_running_requests or 256,
            disaggregation_secret=self.disaggregation_secret or env(DISAGGREGATION_SECRET_ENV) or None,
        )
        check_disaggregation_exposure(args)
        return args._resolve_device() if with_device else args

    def disaggregation_host(self) -> str:
        """The address the PD sockets bind and advertise: --disaggregation-advertise-host, else --host."""
        return self.disaggregation_advertise_host or self.host

    def _resolve_device(self) -> ServerArgs:
        import torch

        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda requested but CUDA is not available")
        if device == "cuda" and self.base_gpu_id + self.local_ranks() > torch.cuda.device_count():
            raise ConfigError(f"--base-gpu-id {self.base_gpu_id} with {self.local_ranks()} rank(s) on this node: "
                              f"this machine has {torch.cuda.device_count()} GPU(s)")
        dtype = self.dtype
        if dtype == "auto":
            dtype = "bfloat16" if device == "cuda" or cpu_has_fast_bf16() else "float32"
        chunk = self.chunked_prefill_size
        if chunk is None:
            chunk = 8192 if device == "cuda" else 2048
            chunk -= chunk % self.page_size
        threshold = self.prefill_admit_threshold
        if threshold is None:
            threshold = 0 if device == "cuda" else CPU_PREFILL_ADMIT_THRESHOLD
        return dataclasses.replace(self, device=device, dtype=dtype, chunked_prefill_size=chunk,
                                   prefill_admit_threshold=threshold)

    def local_ranks(self) -> int:
        """Tensor-parallel ranks on this node (ranks node_rank * local_ranks ... + local_ranks - 1)."""
        return self.tp_size // self.nnodes

    def cache_config(self) -> CacheConfig:
        """The cache stack's settings (the radix, hicache and storage flags), as build_kv_cache takes them."""
        # One slot-table row more than running requests, as ever; unresolved settings keep the default rows.
        rows = self.max_running_requests + 1 if self.max_running_requests else CacheConfig.request_rows
        return CacheConfig(
            page_size=self.page_size, request_rows=rows,
            prefix_cache=not self.disable_radix_cache, eviction_policy=self.radix_eviction_policy,
            spare_tokens=self.kv_run_spare_tokens, host_tier=self.enable_hierarchical_cache,
            host_ratio=self.hicache_ratio, host_size_gb=self.hicache_size, write_policy=self.hicache_write_policy,
            host_layout=self.hicache_mem_layout, snapshot_path=self.hicache_snapshot_path,
            weights_variant="int8" if self.quantization == "int8" else "",
            storage_backend=self.hicache_storage_backend, storage_dir=self.hicache_storage_dir,
            storage_group_pages=self.storage_group_pages(), prefetch_policy=self.hicache_storage_prefetch_policy,
            storage_extra_config=self.storage_extra_config() if self.hicache_storage_backend else {},
            block_events=self.kv_events() is not None, tp_size=self.tp_size)

    def kv_events(self):
        """The parsed --kv-events-config (a KVEventsConfig), None when unset or off."""
        from kvstrata.kv_events.config import parse_kv_events_config

        return parse_kv_events_config(self.kv_events_config)

    def storage_group_pages(self) -> int:
        """Pages per storage (L3) object: --hicache-storage-page-tokens in pages, at least one."""
        return max(1, self.hicache_storage_page_tokens // self.page_size)

    def storage_extra_config(self) -> dict:
        """The parsed `--hicache-storage-backend-extra-config` (inline JSON or @file)."""
        raw = self.hicache_storage_backend_extra_config
        if not raw:
            return {}
        try:
            if raw.startswith("@"):
                with open(raw[1:]) as fh:
                    raw = fh.read()
            value = json.loads(raw)
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"--hicache-storage-backend-extra-config is not valid JSON: {e}") from e
        if not isinstance(value, dict):
            raise ConfigError("--hicache-storage-backend-extra-config must be a JSON object")
        return value

    def to_dict(self) -> dict:
        """Plain dict of all settings, with the API keys hidden."""
        d = dataclasses.asdict(self)
        for secret in ("api_key", "admin_api_key", "disaggregation_secret"):
            if d.get(secret):
                d[secret] = "***"
        return d

    @property
    def url(self) -> str:
        """Base URL of the HTTP server."""
        return f"http://{self.host}:{self.port}"
