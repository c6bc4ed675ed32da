"""KVEventsConfig: `--kv-events-config JSON`, with vLLM's and SGLang's field names, checked strictly.

    {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557",
     "replay_endpoint": "tcp://127.0.0.1:5558", "topic": "kv", "buffer_steps": 10000, "hwm": 100000}

Differences from vLLM/SGLang, all on the side of exposure: the PUB endpoint defaults to 127.0.0.1 (theirs:
tcp://*:5557), and a non-loopback endpoint is refused unless `allow_remote_subscribers` is true (ours),
because the replay endpoint answers whoever asks. Both sockets always bind (vLLM connects when the host is
not a wildcard); subscribers connect. A config without `enable_kv_cache_events` (SGLang's) is on when its
publisher is "zmq".
"""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass, fields
from typing import Optional

from kvstrata.config_cli import ConfigError

PUBLISHERS = ("null", "zmq")
_TCP = re.compile(r"tcp://(?:\[(?P<ipv6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9.*-]+)):(?P<port>[0-9]{1,5})")


@dataclass(frozen=True)
class KVEventsConfig:
    """The settings of the KV event publisher (kv_events/publisher.py)."""

    enable_kv_cache_events: bool = True
    publisher: str = "null"
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: Optional[str] = None
    buffer_steps: int = 10_000       # batches kept for replay
    hwm: int = 100_000               # ZMQ high-water mark of the PUB socket
    max_queue_size: int = 100_000    # batches queued for the publisher thread; beyond: dropped, then resynced
    topic: str = ""
    allow_remote_subscribers: bool = False

    @property
    def enabled(self) -> bool:
        """Whether events are published."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


def parse_kv_events_config(raw: Optional[str]) -> Optional[KVEventsConfig]:
    """The config of `--kv-events-config` (None when unset or off); ConfigError naming the problem."""
    if not raw:
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--kv-events-config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError("--kv-events-config must be a JSON object")
    known = {f.name: f for f in fields(KVEventsConfig)}
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ConfigError(f"--kv-events-config: unknown field(s) {unknown}; known: {sorted(known)}")
    if "publisher" not in value and value.get("enable_kv_cache_events") is True:
        value["publisher"] = "zmq"        # vLLM's newer default when events are enabled
    for name, v in value.items():
        _check_type(name, v, known[name].type)
    config = KVEventsConfig(**value)
    if config.publisher not in PUBLISHERS:
        raise ConfigError(f"--kv-events-config: publisher must be one of {list(PUBLISHERS)}, got {config.publisher!r}")
    for name in ("buffer_steps", "max_queue_size"):
        if getattr(config, name) < 1:
            raise ConfigError(f"--kv-events-config: {name} must be >= 1")
    if config.hwm < 0:
        raise ConfigError("--kv-events-config: hwm must be >= 0")
    if not config.enabled:
        return None
    check_endpoint("endpoint", config.endpoint, config.allow_remote_subscribers)
    if config.replay_endpoint is not None:
        check_endpoint("replay_endpoint", config.replay_endpoint, config.allow_remote_subscribers)
        if config.replay_endpoint == config.endpoint:
            raise ConfigError("--kv-events-config: replay_endpoint must differ from endpoint")
    return config


def _check_type(name: str, value: object, annotation: str) -> None:
    want = {"bool": bool, "str": str, "int": int, "Optional[str]": (str, type(None))}[annotation]
    if annotation == "int" and isinstance(value, bool) or not isinstance(value, want):
        raise ConfigError(f"--kv-events-config: {name} must be of type {annotation}, got {value!r}")


def check_endpoint(name: str, endpoint: str, allow_remote: bool) -> tuple[str, int]:
    """(host, port) of a `tcp://host:port` endpoint; ConfigError unless it is one, on loopback unless allowed."""
    m = _TCP.fullmatch(endpoint)
    if m is None or not 0 < int(m["port"]) <= 65535:
        raise ConfigError(f"--kv-events-config: {name} must be tcp://host:port (port 1..65535), got {endpoint!r}")
    host = m["ipv6"] or m["host"]
    if not allow_remote and not is_loopback_host(host):
        raise ConfigError(f"--kv-events-config: {name} {endpoint!r} is not on loopback; the replay endpoint "
                          "answers whoever connects, so set \"allow_remote_subscribers\": true to expose it")
    return host, int(m["port"])


def is_loopback_host(host: str) -> bool:
    """Whether `host` names this machine only (localhost or a loopback address; '*' is every interface)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
