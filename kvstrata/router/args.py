"""RouterArgs: every setting of `kvstrata router` in one frozen dataclass; the CLI is generated from it.

Flag names and defaults follow SGLang's router (sglang_router) where it has the setting; the tier_aware
policy's weights and the load-poll interval are ours.
"""

from __future__ import annotations

import argparse
import ipaddress
import re
from dataclasses import dataclass, field
from typing import Optional

from kvstrata.config_cli import (
    ConfigError,
    add_dataclass_cli_args,
    check_choices,
    cli_option,
    dataclass_from_cli_args,
)

POLICIES = ["random", "round_robin", "power_of_two", "cache_aware", "tier_aware"]
LOG_LEVELS = ["debug", "info", "warning", "error", "critical"]


@dataclass(frozen=True)
class RouterArgs:
    """All router configuration. Field names are SGLang router's where it has the setting."""

    worker_urls: tuple[str, ...] = field(default=(), metadata=cli_option(
        "Worker base URLs (http://host:port), more can be added later with /add_worker."))
    host: str = field(default="127.0.0.1", metadata=cli_option("HTTP host to bind."))
    port: int = field(default=30000, metadata=cli_option("HTTP port."))
    policy: str = field(default="tier_aware", metadata=cli_option(
        "Routing policy. tier_aware (ours): least expected prefill work (uncached tokens, weighted by the "
        "tier that holds the rest) plus queueing; cache_aware: SGLang's longest-prefix-match policy.",
        POLICIES))
    cache_threshold: float = field(default=0.3, metadata=cli_option(
        "cache_aware: route to the longest prefix match only when it covers more than this fraction of "
        "the prompt; else to the least loaded worker."))
    balance_abs_threshold: int = field(default=64, metadata=cli_option(
        "cache_aware: balance load instead when (max_load - min_load) > this AND the relative threshold "
        "also holds (load = in-flight requests)."))
    balance_rel_threshold: float = field(default=1.5, metadata=cli_option(
        "cache_aware: balance load instead when max_load > min_load * this AND the absolute threshold "
        "also holds."))
    eviction_interval_secs: float = field(default=120.0, metadata=cli_option(
        "Seconds between LRU evictions of the approximate prefix trees.", aliases=("--eviction-interval",)))
    max_tree_size: int = field(default=2 ** 26, metadata=cli_option(
        "Entries (tokens or characters) each worker's approximate prefix tree keeps after an eviction."))
    api_key: Optional[str] = field(default=None, metadata=cli_option(
        "Require this API key (Bearer token) from clients, and send it to the workers given at start "
        "(--worker-urls, --prefill, --decode). A worker added later with /add_worker gets only the key "
        "given in that request."))
    admin_api_key: Optional[str] = field(default=None, metadata=cli_option(
        "Key for the control routes (/add_worker, /remove_worker, /list_workers, /abort_request, "
        "/flush_cache) and for seeing worker URLs; --api-key does not grant them. Without it, only "
        "loopback clients may use them. Never sent to a worker."))
    worker_first_byte_timeout_secs: float = field(default=30.0, metadata=cli_option(
        "Take a worker out when it has requests in flight and sends nothing (no answer, no stream chunk, "
        "no /load report) for this long; its requests that got no byte yet are retried on another "
        "worker. It comes back once it answers again."))
    request_timeout_secs: float = field(default=1800.0, metadata=cli_option(
        "Time limit for one proxied request, streaming included."))
    max_concurrent_requests: int = field(default=-1, metadata=cli_option(
        "Requests proxied at once; more are answered 429 (-1: no limit)."))
    log_level: str = field(default="info", metadata=cli_option("Logging level.", LOG_LEVELS))
    health_check_interval_secs: float = field(default=5.0, metadata=cli_option(
        "Seconds between GET /health checks of every worker."))
    health_check_timeout_secs: float = field(default=5.0, metadata=cli_option(
        "Time limit of one health check."))
    health_failure_threshold: int = field(default=3, metadata=cli_option(
        "Consecutive failed health checks that take a worker out (a refused connection while proxying "
        "takes it out at once)."))
    health_success_threshold: int = field(default=2, metadata=cli_option(
        "Consecutive passed health checks that put a worker (back) in."))
    worker_load_check_interval: float = field(default=1.0, metadata=cli_option(
        "Seconds between polls of each worker's GET /load report (tier_aware, power_of_two)."))
    tier_host_weight: float = field(default=0.1, metadata=cli_option(
        "tier_aware: cost of a prompt token that must be loaded back from host memory (L2), relative to "
        "prefilling it (1.0)."))
    tier_storage_weight: float = field(default=0.3, metadata=cli_option(
        "tier_aware: cost of a prompt token loaded from a shared storage tier (L3), relative to "
        "prefilling it (1.0)."))
    pd_disaggregation: bool = field(default=False, metadata=cli_option(
        "PD mode: every request goes to one --prefill and one --decode server (see router/pd.py)."))
    prefill: tuple = field(default=(), metadata=cli_option("PD: (url, bootstrap port) pairs.", cli=False))
    decode: tuple = field(default=(), metadata=cli_option("PD: decode server URLs.", cli=False))
    prefill_policy: str = field(default="cache_aware", metadata=cli_option(
        "PD: policy that picks the prefill server (prefix affinity).", POLICIES))
    decode_policy: str = field(default="power_of_two", metadata=cli_option(
        "PD: policy that picks the decode server (load).", POLICIES))
    tier_decode_weight: float = field(default=8.0, metadata=cli_option(
        "tier_aware: queueing cost of one request already decoding on a worker, in prompt tokens."))
    worker_admin_api_key: Optional[str] = field(default=None, repr=False, metadata=cli_option(
        "tier_aware: the workers' --admin-api-key, sent with the prefetch hints (POST /prefetch) the router "
        "gives a worker whose L2/L3 holds the chosen request's prefix. Without it they carry the worker's "
        "API key (enough for a worker without an admin key, from loopback)."))
    prefetch_hints: bool = field(default=True, metadata=cli_option(
        "tier_aware: send the chosen worker a prefetch hint (POST /prefetch) when the exact index says its "
        "L2/L3 holds the request's prefix; --no-prefetch-hints sends none (to measure what the hints gain)."))
    kv_events: bool = field(default=True, metadata=cli_option(
        "tier_aware: subscribe to the KV events of workers that publish them (found in their /server_info: "
        "--kv-events-config) and route on the exact index; --no-kv-events keeps the approximate trees."))

    # ------------------------------------------------------------------ CLI
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add one `--flag-name` per field to `parser`."""
        from kvstrata.router.pd import add_pd_cli_args  # pd.py imports this module

        add_dataclass_cli_args(parser, RouterArgs)
        add_pd_cli_args(parser)

    @staticmethod
    def from_cli_args(ns: argparse.Namespace) -> RouterArgs:
        """Build RouterArgs from parsed CLI arguments."""
        from kvstrata.router.pd import pd_servers_from_cli

        ns.prefill, ns.decode = pd_servers_from_cli(ns.prefill), pd_servers_from_cli(ns.decode)
        return dataclass_from_cli_args(RouterArgs, ns)

    # ------------------------------------------------------------------ checks
    def __post_init__(self) -> None:
        from kvstrata.router.pd import check_pd_args

        check_choices(self)
        check_pd_args(self)
        for url in self.worker_urls:
            check_worker_url(url)
        if not 0 < self.port <= 65535:
            raise ConfigError(f"--port must be in 1..65535, got {self.port}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ConfigError(f"--cache-threshold must be in [0, 1], got {self.cache_threshold}")
        for name in ("eviction_interval_secs", "max_tree_size", "request_timeout_secs",
                     "health_check_interval_secs", "health_check_timeout_secs",
                     "worker_first_byte_timeout_secs", "health_failure_threshold",
                     "health_success_threshold", "worker_load_check_interval"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.max_concurrent_requests == 0 or self.max_concurrent_requests < -1:
            raise ConfigError("--max-concurrent-requests must be positive or -1 (no limit)")

    @property
    def url(self) -> str:
        """Base URL of the router."""
        return f"http://{self.host}:{self.port}"


# One RFC 1123 label: letters, digits and inner hyphens, at most 63 characters.
_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_URL = re.compile(r"(?P<scheme>https?)://(?:\[(?P<ipv6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9.-]+)):(?P<port>[0-9]{1,5})/?")


def check_worker_url(url: str) -> str:
    """Return `url` as `scheme://host:port`; raise ConfigError naming the problem unless it is exactly that.

    The scheme is http or https; the host an RFC 1123 hostname, a dotted IPv4 address or a bracketed IPv6
    address; the port 1..65535; no user info, path, query or fragment (one trailing slash is dropped).
    The URL is shown in pages and logs, so nothing else may get through.
    """
    m = _URL.fullmatch(url) if isinstance(url, str) else None
    if m is None:
        raise ConfigError(f"bad worker URL {url!r}: expected http(s)://host:port with a hostname, an IPv4 "
                          "address or a [IPv6] address, and no user, path, query or fragment")
    if m["ipv6"] is not None:
        _check_ip(url, m["ipv6"], ipaddress.IPv6Address)
    elif m["host"].replace(".", "").isdigit():
        _check_ip(url, m["host"], ipaddress.IPv4Address)
    else:
        _check_hostname(url, m["host"])
    if not 0 < int(m["port"]) <= 65535:
        raise ConfigError(f"bad worker URL {url!r}: port {int(m['port'])} is not in 1..65535")
    return url[:-1] if url.endswith("/") else url


def _check_ip(url: str, text: str, kind: type) -> None:
    try:
        kind(text)
    except ValueError:
        raise ConfigError(f"bad worker URL {url!r}: {text!r} is not an {kind.__name__[:4]} address") from None


def _check_hostname(url: str, host: str) -> None:
    labels = host[:-1].split(".") if host.endswith(".") else host.split(".")
    if len(host) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        raise ConfigError(f"bad worker URL {url!r}: {host!r} is not a hostname (RFC 1123 labels of letters, "
                          "digits and inner hyphens)")
    if labels[-1].isdigit():
        raise ConfigError(f"bad worker URL {url!r}: {host!r} is neither an IPv4 address nor a hostname")
