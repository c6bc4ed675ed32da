"""Settings of the Mooncake backend, from the same places SGLang reads them.

Layers, later ones win:
    1. defaults below
    2. SGLang's environment variables: MOONCAKE_MASTER, MOONCAKE_TE_META_DATA_SERVER, MOONCAKE_PROTOCOL,
       MOONCAKE_DEVICE, MOONCAKE_GLOBAL_SEGMENT_SIZE, MOONCAKE_LOCAL_BUFFER_SIZE, MOONCAKE_LOCAL_HOSTNAME
    3. a JSON file: `config_path` in the extra config, else $MOONCAKE_CONFIG_PATH
    4. the keys of `--hicache-storage-backend-extra-config`
Sizes may be integers (bytes) or strings such as "512mb" / "4gb" (binary units, like Mooncake's own).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

from kvstrata.net import free_port  # noqa: F401  (re-exported: the Mooncake launchers pick ports with it)
from kvstrata.storage.errors import StorageError

logger = logging.getLogger(__name__)

INSTALL_HINT = ("pip install kvstrata[mooncake] (on Debian/Ubuntu its libraries also need "
                "libibverbs1 librdmacm1 libnuma1: scripts/install_system_deps.sh)")
P2P_HANDSHAKE = "P2PHANDSHAKE"
MIB = 1 << 20
GIB = 1 << 30

_ENV_KEYS = {
    "MOONCAKE_MASTER": "master_server_address",
    "MOONCAKE_TE_META_DATA_SERVER": "metadata_server",
    "MOONCAKE_PROTOCOL": "protocol",
    "MOONCAKE_DEVICE": "device_name",
    "MOONCAKE_GLOBAL_SEGMENT_SIZE": "global_segment_size",
    "MOONCAKE_LOCAL_BUFFER_SIZE": "local_buffer_size",
    "MOONCAKE_LOCAL_HOSTNAME": "local_hostname",
}
# Other spellings found in Mooncake's and SGLang's config files.
_ALIASES = {"master_server_addr": "master_server_address", "master": "master_server_address",
            "rdma_devices": "device_name", "metadata_server_address": "metadata_server"}
_SIZE_UNITS = {"kb": 1 << 10, "mb": MIB, "gb": GIB, "tb": 1 << 40, "k": 1 << 10, "m": MIB, "g": GIB,
               "t": 1 << 40, "b": 1}


@dataclass(frozen=True)
class MooncakeConfig:
    """Resolved settings of one Mooncake client."""

    master_server_address: str = ""          # host:port of mooncake_master's RPC service
    metadata_server: str = P2P_HANDSHAKE     # "P2PHANDSHAKE" or http://host:port/metadata
    protocol: str = "tcp"                    # "tcp", or "rdma" where the hardware has it
    device_name: str = ""                    # RDMA device(s), e.g. "mlx5_0"; empty for tcp
    local_hostname: str = "127.0.0.1"        # address other nodes reach this client at
    global_segment_size: int = GIB           # memory this client contributes to the pool (0: none)
    local_buffer_size: int = 16 * MIB        # client-side buffer of Mooncake's copying APIs
    replica_num: int = 1                     # copies of each page in the cluster
    connect_timeout_s: float = 2.0           # TCP reachability check of the master
    retry_backoff_s: float = 0.5             # first wait before retrying a backend that failed
    retry_backoff_max_s: float = 10.0        # longest wait between retries

    def master_host_port(self) -> tuple[str, int] | None:
        """The master's (host, port), or None when the address is not a plain host:port."""
        host, sep, port = self.master_server_address.rpartition(":")
        if not sep or not port.isdigit() or "/" in host:
            return None
        return host.strip("[]") or "127.0.0.1", int(port)


def resolve_mooncake_config(extra_config: Mapping, environ: Mapping[str, str] | None = None) -> MooncakeConfig:
    """Merge defaults, environment, JSON config file and extra config into a checked MooncakeConfig."""
    environ = os.environ if environ is None else environ
    values: dict = {}
    for env_name, key in _ENV_KEYS.items():
        if environ.get(env_name):
            values[key] = environ[env_name]
    path = extra_config.get("config_path") or environ.get("MOONCAKE_CONFIG_PATH")
    if path:
        values.update(_normalize(_read_json(path), source=path))
    values.update(_normalize({k: v for k, v in extra_config.items() if k != "config_path"},
                             source="extra config"))
    config = _build(values)
    if not config.master_server_address:
        raise StorageError("Mooncake master address is not configured: set MOONCAKE_MASTER=host:port, "
                           "MOONCAKE_CONFIG_PATH=<json file>, or master_server_address in "
                           "--hicache-storage-backend-extra-config")
    return config


def import_mooncake():
    """The `mooncake.store` module, or StorageError naming what to install."""
    try:
        from mooncake import store
    except (ImportError, OSError) as e:
        raise StorageError(f"the Mooncake client is not available ({e}); {INSTALL_HINT}") from e
    return store


def parse_size(value: int | float | str) -> int:
    """Bytes from an int or a string like "512mb" / "4 GB" / "1073741824"."""
    if isinstance(value, (int, float)):
        return int(value)
    text = str(value).strip().lower().replace(" ", "")
    for unit, factor in _SIZE_UNITS.items():
        if text.endswith(unit) and text[: -len(unit)]:
            return int(float(text[: -len(unit)]) * factor)
    return int(float(text))


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise StorageError(f"cannot read Mooncake config file {path}: {e}") from e
    if not isinstance(data, dict):
        raise StorageError(f"Mooncake config file {path} must hold a JSON object")
    return data


def _normalize(raw: Mapping, source: str) -> dict:
    known = {f.name for f in fields(MooncakeConfig)}
    out = {}
    for key, value in raw.items():
        key = _ALIASES.get(key, key)
        if key in known:
            out[key] = value
        else:
            logger.warning("Mooncake backend ignores unknown setting %r from %s", key, source)
    return out


def _build(values: dict) -> MooncakeConfig:
    try:
        for key in ("global_segment_size", "local_buffer_size"):
            if key in values:
                values[key] = parse_size(values[key])
        for key in ("connect_timeout_s", "retry_backoff_s", "retry_backoff_max_s"):
            if key in values:
                values[key] = float(values[key])
        if "replica_num" in values:
            values["replica_num"] = int(values["replica_num"])
        if "protocol" in values:
            values["protocol"] = str(values["protocol"]).strip().lower()
    except (TypeError, ValueError) as e:
        raise StorageError(f"invalid Mooncake setting: {e}") from e
    config = MooncakeConfig(**values)
    if config.replica_num < 1:
        raise StorageError(f"replica_num must be >= 1, got {config.replica_num}")
    if config.global_segment_size < 0 or config.local_buffer_size < 0:
        raise StorageError("Mooncake segment and buffer sizes must be >= 0")
    return config


def client_hostname(config: MooncakeConfig, environ: Mapping[str, str] | None = None) -> str:
    """The local_hostname to give one new Mooncake client (called again for every client created).

    With MC_LEGACY_RPC_PORT_BINDING and an HTTP metadata server, the installed Mooncake binds its handshake
    port twice (and fails) unless local_hostname names the port itself, so a free one is added here;
    each client needs its own, hence a fresh port per call.
    """
    environ = os.environ if environ is None else environ
    host = config.local_hostname
    if not environ.get("MC_LEGACY_RPC_PORT_BINDING") or config.metadata_server == P2P_HANDSHAKE or ":" in host:
        return host
    try:
        port = free_port(host)
    except OSError:  # a hostname this machine cannot bind directly: any free port will do
        port = free_port("0.0.0.0")
    return f"{host}:{port}"
