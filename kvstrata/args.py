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
import os
import random
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from kvstrata.cache.write_policy import WRITE_POLICIES
from kvstrata.platform import cpu_has_fast_bf16


class ConfigError(ValueError):
    """An invalid setting or combination of settings, raised at start-up."""


def cli_option(help: str, choices: Optional[list] = None, cli: bool = True, aliases: tuple[str, ...] = (),
               no_effect: Optional[str] = None) -> dict:
    """Field metadata read by `add_dataclass_cli_args`: help text, allowed values, extra flag names, and
    why a flag has no effect here (if so)."""
    return {"help": help, "choices": choices, "cli": cli, "aliases": aliases, "no_effect": no_effect}


_opt = cli_option


def _no_effect(why: str) -> dict:
    """An SGLang flag accepted so that launch lines work unchanged; it changes nothing on this engine."""
    return _opt(f"Accepted for SGLang compatibility; no effect here: {why}.", no_effect=why)


SCHEDULE_POLICIES = ["fcfs", "lpm"]
EVICTION_POLICIES = ["lru", "lfu", "fifo", "priority"]
MEM_LAYOUTS = ["layer_first", "page_first"]
STORAGE_BACKENDS = ["file", "mooncake"]
PREFETCH_POLICIES = ["best_effort", "wait_complete", "timeout"]
DTYPES = ["auto", "bfloat16", "float32", "float16"]
TOOL_CALL_PARSERS = ["hermes", "qwen", "qwen25", "qwen3", "llama3"]
# Settings whose only value we can honour: (value, why another one cannot be).
_SINGLE_VALUE = {
    "tp_size": (1, "tensor parallelism is not implemented; run one server per device behind a router"),
    "dp_size": (1, "data parallelism is not implemented; run one server per device behind a router"),
    "pp_size": (1, "pipeline parallelism is not implemented"),
    "ep_size": (1, "expert parallelism is not implemented (it needs tensor parallelism, which is not implemented either); "
                   "MoE models run all their experts on one device"),
    "nnodes": (1, "multi-node serving is not implemented"),
    "node_rank": (0, "multi-node serving is not implemented"),
    "enable_dp_attention": (False, "data-parallel attention is not implemented"),
    "speculative_algorithm": (None, "speculative decoding is not implemented"),
    "quantization": (None, "quantized weights are not supported (a GGUF file is de-quantized on load)"),
    "kv_cache_dtype": ("auto", "the KV cache uses the model dtype (--dtype)"),
    "lora_paths": (None, "LoRA adapters are not supported"),
}
DISAGGREGATION_MODES = ["null", "prefill", "decode"]
# On CPU a step of 256 prefill tokens is compute-bound: prompts that arrive together are prefilled one per
# step from there (multi-turn mean TTFT -10 to -19%, same throughput; docs/benchmarks.md, issue 19).
CPU_PREFILL_ADMIT_THRESHOLD = 256
TRANSFER_BACKENDS = ["mooncake"]


@dataclass(frozen=True)
class ServerArgs:
    """All configuration. Field names are SGLang's where SGLang has the setting."""

    # --- model ---
    model_path: str = field(default="tiny", metadata=_opt(
        "Local Hugging Face checkpoint folder, or a built-in model: 'tiny' (default), 'bench' or 'bench-moe'."))
    tokenizer_path: Optional[str] = field(default=None, metadata=_opt("Tokenizer folder (default: model path)."))
    served_model_name: Optional[str] = field(default=None, metadata=_opt(
        "Model name reported by the API (default: model path)."))
    dtype: str = field(default="auto", metadata=_opt(
        "Weight and KV dtype. 'auto': bfloat16 on CUDA and on CPUs with AVX-512 BF16/AMX, else float32.", DTYPES))
    context_length: Optional[int] = field(default=None, metadata=_opt(
        "Maximum context length (default: the model's max_position_embeddings)."))
    device: str = field(default="auto", metadata=_opt("Device: 'auto', 'cpu' or 'cuda'.", ["auto", "cpu", "cuda"]))
    random_seed: Optional[int] = field(default=None, metadata=_opt("Seed for unseeded sampling (default: random)."))
    num_threads: Optional[int] = field(default=None, metadata=_opt(
        "torch intra-op threads on CPU (default: torch's choice)."))
    enable_deterministic_inference: bool = field(default=False, metadata=_opt(
        "Batch-invariant forward and sampling: a request's logits, tokens and logprobs are bit-identical "
        "whether it runs alone or in any batch, at any chunked-prefill split, with any cache hits."))
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
        "Order of the waiting queue: fcfs, or lpm (longest cached prefix first).", SCHEDULE_POLICIES))

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
    hicache_mem_layout: str = field(default="layer_first", metadata=_opt("Host pool layout.", MEM_LAYOUTS))
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
        "JSON object (or @path to a JSON file) with backend settings."))
    hicache_storage_dir: Optional[str] = field(default=None, metadata=_opt(
        "Directory of the file backend (default: $KVSTRATA_STORAGE_DIR or ~/.cache/kvstrata/kv)."))
    hicache_storage_page_tokens: int = field(default=64, metadata=_opt(
        "Tokens per storage (L3) object, independent of --page-size: consecutive pages are stored as one "
        "object (file or Mooncake key). A multiple of --page-size; a value below it means one page."))

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

    # --- SGLang settings with only one value here (any other is a start-up error) ---
    tp_size: int = field(default=1, metadata=_opt("Tensor parallel size (only 1).",
                                                  aliases=("--tp", "--tensor-parallel-size")))
    dp_size: int = field(default=1, metadata=_opt("Data parallel size (only 1).",
                                                  aliases=("--dp", "--data-parallel-size")))
    pp_size: int = field(default=1, metadata=_opt("Pipeline parallel size (only 1).",
                                                  aliases=("--pipeline-parallel-size",)))
    ep_size: int = field(default=1, metadata=_opt("Expert parallel size (only 1).",
                                                  aliases=("--expert-parallel-size",)))
    nnodes: int = field(default=1, metadata=_opt("Number of nodes (only 1)."))
    node_rank: int = field(default=0, metadata=_opt("Rank of this node (only 0)."))
    enable_dp_attention: bool = field(default=False, metadata=_opt("Data-parallel attention (not supported)."))
    speculative_algorithm: Optional[str] = field(default=None, metadata=_opt(
        "Speculative decoding algorithm (not supported)."))
    quantization: Optional[str] = field(default=None, metadata=_opt("Weight quantization (not supported)."))
    kv_cache_dtype: str = field(default="auto", metadata=_opt("KV cache dtype (only auto: the model dtype)."))
    lora_paths: Optional[str] = field(default=None, metadata=_opt("LoRA adapters (not supported)."))

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
    disable_custom_all_reduce: bool = field(default=False, metadata=_no_effect("there is one device"))
    skip_server_warmup: bool = field(default=False, metadata=_no_effect("the server does no warm-up request"))
    tokenizer_mode: str = field(default="auto", metadata=_no_effect("the fast tokenizer is always used"))
    watchdog_timeout: Optional[float] = field(default=None, metadata=_no_effect(
        "the HTTP process watches the scheduler process instead"))

    # --- hardening: admin actions, request limits, shutdown ---
    admin_api_key: Optional[str] = field(default=None, metadata=_opt(
        "Key for admin actions (/abort_request); --api-key does not grant them. Without it, only loopback "
        "clients may use them."))
    max_request_body_bytes: int = field(default=16 << 20, metadata=_opt(
        "Largest accepted request body; larger ones get HTTP 413 before they are read."))
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

    # ------------------------------------------------------------------ CLI
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add one `--flag-name` per field to `parser`."""
        add_dataclass_cli_args(parser, ServerArgs)

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
        self._check()

    def _check(self) -> None:
        check_choices(self)
        _positive(self, "page_size", "max_total_tokens", "max_running_requests", "context_length",
                  "max_prefill_tokens", "num_threads")
        _positive(self, "max_request_body_bytes")
        if self.kv_run_spare_tokens < 0:
            raise ConfigError(f"--kv-run-spare-tokens must be >= 0, got {self.kv_run_spare_tokens}")
        if self.graceful_shutdown_timeout < 0:
            raise ConfigError(f"--graceful-shutdown-timeout must be >= 0, got {self.graceful_shutdown_timeout}")
        if self.port <= 0 or self.port > 65535:
            raise ConfigError(f"--port must be in 1..65535, got {self.port}")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size != -1:
            if self.chunked_prefill_size <= 0:
                raise ConfigError("--chunked-prefill-size must be positive or -1 (disabled)")
            if self.chunked_prefill_size % self.page_size:
                raise ConfigError(
                    f"--chunked-prefill-size ({self.chunked_prefill_size}) must be a multiple of "
                    f"--page-size ({self.page_size})")
        if self.prefill_admit_threshold is not None and self.prefill_admit_threshold < 0:
            raise ConfigError("--prefill-admit-threshold must be >= 0 (0: fill the prefill budget)")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ConfigError("--mem-fraction-static must be in (0, 1)")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ConfigError("--max-total-tokens must hold at least one page")
        if self.enable_hierarchical_cache and self.disable_radix_cache:
            raise ConfigError("--enable-hierarchical-cache needs the radix cache; drop --disable-radix-cache")
        if self.hicache_ratio <= 1 and not self.hicache_size:
            raise ConfigError(f"--hicache-ratio must be > 1 (the host pool must be larger than the device "
                              f"pool), got {self.hicache_ratio}")
        if self.hicache_size < 0:
            raise ConfigError("--hicache-size must be >= 0")
        if self.hicache_snapshot_path and not self.enable_hierarchical_cache:
            raise ConfigError("--hicache-snapshot-path needs --enable-hierarchical-cache")
        if self.hicache_storage_backend and not self.enable_hierarchical_cache:
            raise ConfigError("--hicache-storage-backend needs --enable-hierarchical-cache")
        if self.hicache_storage_backend_extra_config:
            self.storage_extra_config()  # raises on bad JSON
        if self.hicache_storage_page_tokens < 1:
            raise ConfigError("--hicache-storage-page-tokens must be >= 1")
        if self.hicache_storage_page_tokens > self.page_size and self.hicache_storage_page_tokens % self.page_size:
            raise ConfigError(f"--hicache-storage-page-tokens ({self.hicache_storage_page_tokens}) must be a "
                              f"multiple of --page-size ({self.page_size})")
        for name, (value, why) in _SINGLE_VALUE.items():
            if getattr(self, name) != value:
                raise ConfigError(f"--{_flag(name)} {getattr(self, name)} cannot be honoured: {why}")
        if self.constrained_json_whitespace_pattern is not None:
            if self.constrained_json_disable_any_whitespace:
                raise ConfigError("--constrained-json-whitespace-pattern contradicts "
                                  "--constrained-json-disable-any-whitespace (compact JSON only)")
            _check_regex("--constrained-json-whitespace-pattern", self.constrained_json_whitespace_pattern)
        if self.chat_template is not None:
            from kvstrata.model.chat_template_flag import ChatTemplateNotFound, resolve_chat_template

            try:
                resolve_chat_template(self.chat_template)
            except ChatTemplateNotFound as e:
                raise ConfigError(str(e)) from None
        if not 0 < self.disaggregation_bootstrap_port <= 65535:
            raise ConfigError(f"--disaggregation-bootstrap-port must be in 1..65535, got "
                              f"{self.disaggregation_bootstrap_port}")
        if self.disaggregation_bootstrap_timeout <= 0:
            raise ConfigError("--disaggregation-bootstrap-timeout must be positive")

    def no_effect_notes(self) -> list[str]:
        """One line per SGLang flag that was set but means nothing on this engine (logged once at start)."""
        notes = []
        for f in dataclasses.fields(self):
            why = f.metadata.get("no_effect")
            if why and getattr(self, f.name) != f.default:
                notes.append(f"--{_flag(f.name)} has no effect on kvstrata: {why}")
        return notes

    # ------------------------------------------------------------------ derived values
    def resolve(self, with_device: bool = True) -> ServerArgs:
        """Return a copy with every 'auto'/None that has a derived value filled in.

        Device, dtype, chunked_prefill_size and prefill_admit_threshold depend on CUDA being available, which needs torch: with
        `with_device=False` they stay as given, for the HTTP process, which never imports torch; the
        scheduler process resolves them (resolving twice changes nothing) and reports its copy back.
        """
        args = dataclasses.replace(
            self,
            tokenizer_path=self.tokenizer_path or self.model_path,
            served_model_name=self.served_model_name or self.model_path,
            random_seed=self.random_seed if self.random_seed is not None else random.randrange(1 << 30),
            max_running_requests=self.max_running_requests or 256,
        )
        return args._resolve_device() if with_device else args

    def _resolve_device(self) -> ServerArgs:
        import torch

        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda requested but CUDA is not available")
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
        for secret in ("api_key", "admin_api_key"):
            if d.get(secret):
                d[secret] = "***"
        return d

    @property
    def url(self) -> str:
        """Base URL of the HTTP server."""
        return f"http://{self.host}:{self.port}"


def env_flag(name: str, default: str = "") -> str:
    """Read a KVSTRATA_* environment variable (the one place env vars are read)."""
    return os.environ.get(name, default)


def add_dataclass_cli_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one `--flag-name` per field of the config dataclass `cls` (metadata from `_opt`).

    bool fields get `--flag/--no-flag`; tuple fields take any number of values; `aliases` in a field's
    metadata adds more flag names for the same field.
    """
    for f in dataclasses.fields(cls):
        if not f.metadata.get("cli", True):
            continue
        flags = ["--" + _flag(f.name), *f.metadata.get("aliases", ())]
        kind = _base_type(f.type)
        kwargs: dict[str, Any] = {"dest": f.name, "help": f.metadata.get("help"), "default": f.default}
        if kind is bool:
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, **kwargs)
            continue
        if f.metadata.get("choices"):
            kwargs["choices"] = f.metadata["choices"]
        if typing.get_origin(kind) is tuple:
            kind, kwargs["nargs"] = typing.get_args(kind)[0], "*"
        parser.add_argument(*flags, type=kind, **kwargs)


def dataclass_from_cli_args(cls: type, ns: argparse.Namespace) -> Any:
    """Build the config dataclass `cls` from parsed CLI arguments (unknown attributes are ignored)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {k: v for k, v in vars(ns).items() if k in fields}
    for name, value in values.items():
        if isinstance(value, list):
            values[name] = tuple(value)
    return cls(**values)


def check_choices(config: Any) -> None:
    """Raise ConfigError for a field whose value is not one of its metadata `choices`."""
    for f in dataclasses.fields(config):
        choices = f.metadata.get("choices")
        value = getattr(config, f.name)
        if choices and value is not None and value not in choices:
            raise ConfigError(f"--{_flag(f.name)} must be one of {choices}, got {value!r}")


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _check_regex(flag: str, pattern: str) -> None:
    import re

    try:
        re.compile(pattern)
    except re.error as e:
        raise ConfigError(f"{flag} is not a valid regular expression: {e}") from None


def _positive(args: ServerArgs, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ConfigError(f"--{_flag(name)} must be positive, got {value}")


def _base_type(tp: Any) -> type:
    """int for 'Optional[int]' etc.; annotations are strings under `from __future__ import annotations`."""
    if isinstance(tp, str):
        tp = eval(tp, {"Optional": Optional, **vars(typing)})  # our own annotations only
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = args[0]
    return tp
