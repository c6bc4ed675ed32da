"""The range and cross-field checks of ServerArgs: each refusal names the flag and what to do instead.

Kept apart from args.py (the fields, their CLI and the derived values) so that each rule lives in one place.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from kvstrata.config_cli import ConfigError, check_choices, flag_name
from kvstrata.net import is_ip_literal, is_loopback

if TYPE_CHECKING:
    from kvstrata.args import ServerArgs

DISAGGREGATION_SECRET_ENV = "KVSTRATA_DISAGGREGATION_SECRET"
MIN_SECRET_CHARS = 16
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def check_server_args(args: ServerArgs) -> None:
    """Raise ConfigError naming the first setting that is out of range or contradicts another."""
    check_choices(args)
    _positive(args, "page_size", "max_total_tokens", "max_running_requests", "context_length",
              "max_prefill_tokens", "num_threads")
    _positive(args, "max_request_body_bytes", "stream_interval", "max_queued_requests")
    if args.base_gpu_id < 0:
        raise ConfigError(f"--base-gpu-id must be >= 0, got {args.base_gpu_id}")
    if args.load_format == "gguf" and not args.model_path.endswith(".gguf"):
        raise ConfigError(f"--load-format gguf needs a .gguf file as --model-path, got {args.model_path!r}")
    args.kv_events()                # raises on a bad --kv-events-config
    if args.kv_run_spare_tokens < 0:
        raise ConfigError(f"--kv-run-spare-tokens must be >= 0, got {args.kv_run_spare_tokens}")
    if args.graceful_shutdown_timeout < 0:
        raise ConfigError(f"--graceful-shutdown-timeout must be >= 0, got {args.graceful_shutdown_timeout}")
    if args.port <= 0 or args.port > 65535:
        raise ConfigError(f"--port must be in 1..65535, got {args.port}")
    if args.chunked_prefill_size is not None and args.chunked_prefill_size != -1:
        if args.chunked_prefill_size <= 0:
            raise ConfigError("--chunked-prefill-size must be positive or -1 (disabled)")
        if args.chunked_prefill_size % args.page_size:
            raise ConfigError(
                f"--chunked-prefill-size ({args.chunked_prefill_size}) must be a multiple of "
                f"--page-size ({args.page_size})")
    if args.prefill_admit_threshold is not None and args.prefill_admit_threshold < 0:
        raise ConfigError("--prefill-admit-threshold must be >= 0 (0: fill the prefill budget)")
    if args.mem_fraction_static is not None and not 0 < args.mem_fraction_static < 1:
        raise ConfigError("--mem-fraction-static must be in (0, 1)")
    if args.max_total_tokens is not None and args.max_total_tokens < args.page_size:
        raise ConfigError("--max-total-tokens must hold at least one page")
    if args.enable_hierarchical_cache and args.disable_radix_cache:
        raise ConfigError("--enable-hierarchical-cache needs the radix cache; drop --disable-radix-cache")
    if args.hicache_ratio <= 1 and not args.hicache_size:
        raise ConfigError(f"--hicache-ratio must be > 1 (the host pool must be larger than the device "
                          f"pool), got {args.hicache_ratio}")
    if args.hicache_size < 0:
        raise ConfigError("--hicache-size must be >= 0")
    if args.hicache_snapshot_path and not args.enable_hierarchical_cache:
        raise ConfigError("--hicache-snapshot-path needs --enable-hierarchical-cache")
    if args.hicache_storage_backend and not args.enable_hierarchical_cache:
        raise ConfigError("--hicache-storage-backend needs --enable-hierarchical-cache")
    if args.hicache_storage_backend_extra_config:
        args.storage_extra_config()  # raises on bad JSON
    if args.hicache_storage_page_tokens < 1:
        raise ConfigError("--hicache-storage-page-tokens must be >= 1")
    if args.hicache_storage_page_tokens > args.page_size and args.hicache_storage_page_tokens % args.page_size:
        raise ConfigError(f"--hicache-storage-page-tokens ({args.hicache_storage_page_tokens}) must be a "
                          f"multiple of --page-size ({args.page_size})")
    for f in dataclasses.fields(args):
        value, why = f.metadata.get("only", (getattr(args, f.name), ""))
        if getattr(args, f.name) != value:
            raise ConfigError(f"--{flag_name(f.name)} {_shown(getattr(args, f.name))} cannot be honoured: {why}")
    if args.constrained_json_whitespace_pattern is not None:
        if args.constrained_json_disable_any_whitespace:
            raise ConfigError("--constrained-json-whitespace-pattern contradicts "
                              "--constrained-json-disable-any-whitespace (compact JSON only)")
        _check_regex("--constrained-json-whitespace-pattern", args.constrained_json_whitespace_pattern)
    if args.chat_template is not None:
        from kvstrata.model.chat_template_flag import ChatTemplateNotFound, resolve_chat_template

        try:
            resolve_chat_template(args.chat_template)
        except ChatTemplateNotFound as e:
            raise ConfigError(str(e)) from None
    if not 0 < args.disaggregation_bootstrap_port <= 65535:
        raise ConfigError(f"--disaggregation-bootstrap-port must be in 1..65535, got "
                          f"{args.disaggregation_bootstrap_port}")
    if args.watchdog_timeout is not None and args.watchdog_timeout < 0:
        raise ConfigError("--watchdog-timeout must be positive (0 disables the watchdog)")
    if args.max_connections is not None and args.max_connections < 1:
        raise ConfigError("--max-connections must be at least 1")
    if args.header_read_timeout <= 0:
        raise ConfigError("--header-read-timeout must be positive")
    if args.scheduler_heartbeat_timeout <= 0:
        raise ConfigError("--scheduler-heartbeat-timeout must be positive")
    if args.disaggregation_bootstrap_timeout <= 0:
        raise ConfigError("--disaggregation-bootstrap-timeout must be positive")
    _check_parallelism(args)


def _check_parallelism(args: ServerArgs) -> None:
    """--tp-size and its companions; what tensor parallelism does not cover yet is refused by name."""
    _positive(args, "tp_size", "ep_size", "nnodes", "dist_timeout")
    if args.ep_size not in (1, args.tp_size):
        raise ConfigError(f"--ep-size {args.ep_size} must be 1 or --tp-size ({args.tp_size}): experts are split "
                          f"across the tensor-parallel ranks")
    if args.ep_num_redundant_experts < 0:
        raise ConfigError("--ep-num-redundant-experts must be 0 or more")
    if args.ep_size == 1 and (args.ep_num_redundant_experts or args.init_expert_location != "trivial"):
        raise ConfigError("--ep-num-redundant-experts and --init-expert-location place experts across the "
                          "ranks of --ep-size N > 1; with --ep-size 1 there is nothing to place")
    if not 0 <= args.node_rank < args.nnodes:
        raise ConfigError(f"--node-rank must be in 0..{args.nnodes - 1} (--nnodes {args.nnodes}), got {args.node_rank}")
    if args.nnodes > 1 and not args.dist_init_addr:
        raise ConfigError("--nnodes > 1 needs --dist-init-addr host:port (reachable from every node)")
    if args.tp_size % args.nnodes:
        raise ConfigError(f"--tp-size {args.tp_size} must be a multiple of --nnodes {args.nnodes}")
    if args.dist_init_addr is not None:
        host, _, port = args.dist_init_addr.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ConfigError(f"--dist-init-addr must be host:port, got {args.dist_init_addr!r}")
    if args.tp_size == 1:
        return
    unsupported = {  # flag -> what does not shard its KV per rank yet
        # Each rank's transfer engine listens on this node's --disaggregation-host: one node only.
        f"--disaggregation-mode {args.disaggregation_mode} and --nnodes {args.nnodes}": (
            args.disaggregation_mode != "null" and args.nnodes > 1, "a transfer host per node"),
    }
    for flag, (used, missing) in unsupported.items():
        if used:
            raise ConfigError(f"--tp-size {args.tp_size} with {flag} is not implemented yet ({missing}); "
                              f"use --tp-size 1")


def check_disaggregation_exposure(args: ServerArgs) -> None:
    """A PD server reachable from other machines must authenticate its peers (after the env fallback)."""
    if args.disaggregation_mode == "null":
        return
    host = args.disaggregation_host()
    if host in WILDCARD_HOSTS:
        raise ConfigError(f"--host {host or repr(host)} cannot be advertised to PD peers; set "
                          f"--disaggregation-advertise-host to this machine's address on their network")
    if not args.disaggregation_secret and not is_loopback(host):
        raise ConfigError(f"PD server on {host} (not loopback) needs --disaggregation-secret or "
                          f"${DISAGGREGATION_SECRET_ENV}: without it anyone on the network could forge "
                          f"KV handoffs")
    if args.disaggregation_secret and len(args.disaggregation_secret) < MIN_SECRET_CHARS:
        raise ConfigError(f"the PD secret must have at least {MIN_SECRET_CHARS} characters (generate one "
                          f"with: python -c 'import secrets; print(secrets.token_urlsafe(32))')")
    if args.disaggregation_advertise_host is not None and not is_ip_literal(args.disaggregation_advertise_host):
        raise ConfigError(f"--disaggregation-advertise-host must be an IP address (the PD sockets bind it), "
                          f"got {args.disaggregation_advertise_host!r}")


def _shown(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, tuple) else str(value)


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
            raise ConfigError(f"--{flag_name(name)} must be positive, got {value}")
