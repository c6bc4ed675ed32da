"""Mooncake settings: SGLang's environment variables, a JSON file, the extra config, in that order."""

import json
import sys

import pytest

from kvstrata.storage.base import create_backend
from kvstrata.storage.errors import StorageError
from kvstrata.storage.mooncake_config import (
    GIB,
    MIB,
    P2P_HANDSHAKE,
    MooncakeConfig,
    client_hostname,
    parse_size,
    resolve_mooncake_config,
)

SGLANG_ENV = {"MOONCAKE_MASTER": "10.0.0.1:50051", "MOONCAKE_TE_META_DATA_SERVER": "http://10.0.0.1:8080/metadata",
              "MOONCAKE_PROTOCOL": "RDMA", "MOONCAKE_DEVICE": "mlx5_0", "MOONCAKE_GLOBAL_SEGMENT_SIZE": "4gb",
              "MOONCAKE_LOCAL_BUFFER_SIZE": "16777216", "MOONCAKE_LOCAL_HOSTNAME": "10.0.0.2"}


def test_sglang_environment_variables():
    config = resolve_mooncake_config({}, SGLANG_ENV)
    assert config == MooncakeConfig(master_server_address="10.0.0.1:50051",
                                    metadata_server="http://10.0.0.1:8080/metadata", protocol="rdma",
                                    device_name="mlx5_0", local_hostname="10.0.0.2",
                                    global_segment_size=4 * GIB, local_buffer_size=16 * MIB)


def test_defaults_with_only_a_master():
    config = resolve_mooncake_config({}, {"MOONCAKE_MASTER": "127.0.0.1:1"})
    assert config.metadata_server == P2P_HANDSHAKE and config.protocol == "tcp"
    assert config.local_hostname == "127.0.0.1" and config.replica_num == 1
    assert config.master_host_port() == ("127.0.0.1", 1)


def test_file_then_extra_config_override(tmp_path):
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"master_server_addr": "file:1", "metadata_server": "P2PHANDSHAKE",
                                "global_segment_size": "512mb", "protocol": "tcp"}))
    env = {**SGLANG_ENV, "MOONCAKE_CONFIG_PATH": str(path)}
    config = resolve_mooncake_config({"replica_num": 2, "local_buffer_size": 1024}, env)
    assert config.master_server_address == "file:1"           # file beats env
    assert config.global_segment_size == 512 * MIB
    assert config.device_name == "mlx5_0"                      # env value the file does not set
    assert config.replica_num == 2 and config.local_buffer_size == 1024  # extra config beats all
    explicit = resolve_mooncake_config({"config_path": str(path), "master_server_address": "x:2"}, {})
    assert explicit.master_server_address == "x:2" and explicit.global_segment_size == 512 * MIB


def test_errors_are_clear(tmp_path):
    with pytest.raises(StorageError, match="MOONCAKE_MASTER"):
        resolve_mooncake_config({}, {})
    with pytest.raises(StorageError, match="replica_num"):
        resolve_mooncake_config({"master_server_address": "h:1", "replica_num": 0}, {})
    with pytest.raises(StorageError, match="cannot read"):
        resolve_mooncake_config({}, {"MOONCAKE_CONFIG_PATH": str(tmp_path / "missing.json")})
    with pytest.raises(StorageError, match="invalid Mooncake setting"):
        resolve_mooncake_config({"master_server_address": "h:1", "global_segment_size": "lots"}, {})


def test_legacy_port_binding_gets_a_port_for_http_metadata():
    env = {"MC_LEGACY_RPC_PORT_BINDING": "1"}
    http = resolve_mooncake_config({"master_server_address": "h:1", "metadata_server": "http://x/metadata"}, env)
    host, port = client_hostname(http, env).split(":")
    assert host == "127.0.0.1" and int(port) > 0
    assert client_hostname(http, {}) == "127.0.0.1"
    p2p = resolve_mooncake_config({"master_server_address": "h:1"}, env)
    assert client_hostname(p2p, env) == "127.0.0.1"
    fixed = resolve_mooncake_config({"master_server_address": "h:1", "metadata_server": "http://x/metadata",
                                     "local_hostname": "10.1.1.1:7000"}, env)
    assert client_hostname(fixed, env) == "10.1.1.1:7000"


def test_parse_size():
    assert parse_size("4gb") == 4 * GIB and parse_size("1.5 MB") == int(1.5 * MIB)
    assert parse_size(123) == 123 and parse_size("2048") == 2048


def test_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # what an absent package looks like to import
    monkeypatch.setitem(sys.modules, "mooncake", None)
    with pytest.raises(StorageError, match=r"pip install kvstrata\[mooncake\]"):
        create_backend("mooncake", 4096, {"master_server_address": "127.0.0.1:1"})
