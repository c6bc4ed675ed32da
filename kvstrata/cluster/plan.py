"""Each member's command line, environment, ports and readiness probe, derived from the spec.

One function, `member_command`, serves both deployments: the local launcher calls it with a
`LocalNetwork` (127.0.0.1, a free port per member), the Kubernetes renderer with a `KubeNetwork` (the pod
IP, fixed container ports, Service names). Service discovery lives here and only here:

    router          --worker-urls  every member of the server roles it depends on; with prefill/decode
                    roles instead: --pd-disaggregation --prefill URL BOOTSTRAP_PORT ... --decode URL ...
    worker          MOONCAKE_MASTER / MOONCAKE_TE_META_DATA_SERVER of the group's mooncake-master role;
                    with L2, --hicache-snapshot-path in the member's state dir (its host tier outlives it)
    prefill/decode  --disaggregation-mode (and the prefill's bootstrap port); a decode server learns its
                    prefill peer per request, from the router's bootstrap_host/bootstrap_port; the group's
                    PD secret (`Network.pd_secret`) as $KVSTRATA_DISAGGREGATION_SECRET; on Kubernetes the
                    transfer engine's ports pinned to TRANSFER_PORTS (the NetworkPolicy names them)
    mooncake-store  --master / --metadata of the same role
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Optional, Protocol

from kvstrata.args import DISAGGREGATION_SECRET_ENV, ServerArgs
from kvstrata.cluster.spec import SERVER_KINDS, GroupSpec, RoleSpec, to_flags
from kvstrata.platform import env
from kvstrata.server.launch import SNAPSHOT_STOP_TIMEOUT_S, STOP_TIMEOUT_S
from kvstrata.storage.mooncake_config import parse_size

# Container ports on Kubernetes (locally each member gets free ports under the same names).
KIND_PORTS = {
    "router": ("http",), "worker": ("http",), "prefill": ("http", "bootstrap"), "decode": ("http",),
    "mooncake-master": ("rpc", "metadata", "metrics"), "mooncake-store": (),
}
DEFAULT_PORTS = {"http": 30000, "bootstrap": 8998, "rpc": 50051, "metadata": 8080, "metrics": 9003}
MC_ENV = {"MC_LEGACY_RPC_PORT_BINDING": "1"}
KUBE_STATE_DIR = "/var/lib/kvstrata"
L2_SNAPSHOT_FILE = "l2.snapshot"   # a worker's host tier across restarts (--hicache-snapshot-path)
MASTER_EXTRA_PREFIX = "--"       # extra master args are passed on as Mooncake gflags (--name=value)
PD_KINDS = ("prefill", "decode")
TRANSFER_PORTS = (15000, 15063)  # Kubernetes: the transfer engine's handshake and data ports (Mooncake's range)
STOP_MARGIN_S = 15.0            # beyond a server's drain and scheduler stop (server_stop_grace_s)


def new_pd_secret() -> str:
    """The group's PD secret: $KVSTRATA_DISAGGREGATION_SECRET when set (so a re-render keeps it), else random."""
    return env(DISAGGREGATION_SECRET_ENV) or secrets.token_urlsafe(32)


@dataclass(frozen=True)
class Probe:
    """Readiness of a member: an HTTP GET answering 200, TCP ports accepting, or a file existing."""

    kind: str                                  # "http" | "tcp" | "file"
    path: str = ""                             # http: URL path; file: file path
    ports: tuple[str, ...] = ()                # port names (http: one)


@dataclass(frozen=True)
class MemberCommand:
    """What runs as one member: `program args...` with `env` added, listening on `ports`."""

    role: str
    index: int
    program: str                               # "python" or an executable name; the launcher resolves it
    args: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    probe: Probe = Probe("tcp")
    secret_env: dict[str, str] = field(default_factory=dict, repr=False)   # env whose values are secrets
    stop_grace_s: float = STOP_TIMEOUT_S + STOP_MARGIN_S   # SIGTERM to exit, at most

    @property
    def name(self) -> str:
        """Member name: role-index."""
        return f"{self.role}-{self.index}"


class Network(Protocol):
    """Where members bind and how they reach each other."""

    bind_host: str
    pd_secret: str                              # signs the group's PD bootstrap messages
    transfer_ports: Optional[tuple[int, int]]   # the transfer engine's port range (None: any free port)

    def member_host(self, role: RoleSpec, index: int) -> str:
        """The host other members reach member `index` of `role` at."""

    def port(self, role: RoleSpec, index: int, name: str) -> int:
        """The port called `name` of a member."""

    def ready_file(self, role: RoleSpec, index: int) -> str:
        """Where a member that signals readiness by a file writes it."""

    def state_dir(self, role: RoleSpec, index: int) -> str:
        """A directory that outlives the member's process across restarts and upgrades (its L2 snapshot)."""


@dataclass
class LocalNetwork:
    """127.0.0.1 and ports chosen by the launcher (kept for a member's whole life, upgrades included)."""

    ports: dict[tuple[str, int], dict[str, int]]
    run_dir: str
    bind_host: str = "127.0.0.1"
    pd_secret: str = field(default_factory=new_pd_secret, repr=False)
    transfer_ports: Optional[tuple[int, int]] = None

    def member_host(self, role: RoleSpec, index: int) -> str:
        """Every member is on this machine."""
        return self.bind_host

    def port(self, role: RoleSpec, index: int, name: str) -> int:
        """The allocated port."""
        return self.ports[(role.name, index)][name]

    def ready_file(self, role: RoleSpec, index: int) -> str:
        """A file in the run directory."""
        return f"{self.run_dir}/{role.name}-{index}.ready"

    def state_dir(self, role: RoleSpec, index: int) -> str:
        """Per member, in the run directory."""
        return f"{self.run_dir}/state/{role.name}-{index}"


@dataclass
class KubeNetwork:
    """Pod IP to bind, per-member DNS names through each role's headless Service, fixed container ports."""

    group: str
    bind_host: str = "$(POD_IP)"
    pd_secret: str = field(default_factory=new_pd_secret, repr=False)
    transfer_ports: Optional[tuple[int, int]] = TRANSFER_PORTS

    def service(self, role: RoleSpec) -> str:
        """The Service of a role."""
        return f"{self.group}-{role.name}"

    def member_host(self, role: RoleSpec, index: int) -> str:
        """Pod hostname.subdomain: stable across in-place updates."""
        return f"{self.group}-{role.name}-{index}.{self.service(role)}"

    def port(self, role: RoleSpec, index: int, name: str) -> int:
        """The role's port (spec `port:` overrides the first one)."""
        if role.port and KIND_PORTS[role.kind] and name == KIND_PORTS[role.kind][0]:
            return role.port
        return DEFAULT_PORTS[name]

    def ready_file(self, role: RoleSpec, index: int) -> str:
        """Inside the container."""
        return "/tmp/kvstrata-member.ready"

    def state_dir(self, role: RoleSpec, index: int) -> str:
        """An emptyDir volume: it survives the container restart of an in-place update, not the pod."""
        return KUBE_STATE_DIR


def member_command(spec: GroupSpec, role: RoleSpec, index: int, net: Network,
                   args_override: Optional[dict] = None) -> MemberCommand:
    """The command line, environment, ports and probe of member `index` of `role`."""
    role_args = {**role.args, **(args_override or {})}
    ports = {name: net.port(role, index, name) for name in KIND_PORTS[role.kind]}
    host = net.bind_host
    mooncake_env = dict(MC_ENV) | {"MC_TCP_BIND_ADDRESS": host}
    env: dict[str, str] = {}
    secret_env: dict[str, str] = {}
    stop_grace_s = STOP_TIMEOUT_S + STOP_MARGIN_S
    if role.kind == "mooncake-master":
        args = ["-m", "kvstrata.cluster.mooncake_master", "--host", host, "--rpc-port", str(ports["rpc"]),
                "--metadata-port", str(ports["metadata"]), "--metrics-port", str(ports["metrics"])]
        args += [f"{MASTER_EXTRA_PREFIX}{k.replace('-', '_')}={v}" for k, v in role_args.items()]
        probe = Probe("tcp", ports=("rpc", "metadata"))
        env |= mooncake_env
    elif role.kind == "mooncake-store":
        master, metadata = mooncake_addresses(spec, net)
        size = parse_size(role_args.get("segment-size", "256mb"))
        args = ["-m", "kvstrata.storage.mooncake_services", "serve-segment", "--master", master,
                "--metadata", metadata, "--segment-size", str(size), "--local-hostname", host,
                "--ready-file", net.ready_file(role, index)]
        probe = Probe("file", path=net.ready_file(role, index))
        env |= mooncake_env
    elif role.kind == "router":
        args = ["-m", "kvstrata.router", "--host", host, "--port", str(ports["http"]),
                *router_peers(spec, role, net), *to_flags(role_args)]
        probe = Probe("http", path="/health", ports=("http",))
    else:
        args = ["-m", "kvstrata.launch_server", "--host", host, "--port", str(ports["http"])]
        if role.kind != "worker":
            args += ["--disaggregation-mode", role.kind]
        if role.kind == "prefill":
            args += ["--disaggregation-bootstrap-port", str(ports["bootstrap"])]
        args += to_flags(role_args)
        if role_args.get("enable-hierarchical-cache") is True and "hicache-snapshot-path" not in role_args:
            args += ["--hicache-snapshot-path", f"{net.state_dir(role, index)}/{L2_SNAPSHOT_FILE}"]
        if role.resources.threads:
            args += ["--num-threads", str(role.resources.threads)]
        if role.kind in PD_KINDS:            # the KV handoff runs on Mooncake's transfer engine
            env |= mooncake_env | transfer_port_env(net)
            secret_env = {DISAGGREGATION_SECRET_ENV: net.pd_secret}
        if role_args.get("hicache-storage-backend") == "mooncake":
            env |= mooncake_env | mooncake_client_env(spec, net)
        probe = Probe("http", path="/health", ports=("http",))
        stop_grace_s = server_stop_grace_s(args)
    if role.resources.threads:
        env["OMP_NUM_THREADS"] = str(role.resources.threads)
    return MemberCommand(role=role.name, index=index, program="python", args=tuple(args),
                         env=env | role.env, ports=ports, probe=probe, secret_env=secret_env,
                         stop_grace_s=stop_grace_s)


def transfer_port_env(net: Network) -> dict[str, str]:
    """Mooncake's variables that keep its transfer engine's listening ports in `net.transfer_ports`."""
    if net.transfer_ports is None:
        return {}
    return {"MC_MIN_RPC_PORT": str(net.transfer_ports[0]), "MC_MAX_RPC_PORT": str(net.transfer_ports[1])}


def server_stop_grace_s(args: list[str]) -> float:
    """Seconds a server started with `args` may take from SIGTERM to exit: its drain, then its scheduler's
    stop or L2 snapshot, plus a margin."""
    drain = ServerArgs.graceful_shutdown_timeout
    if "--graceful-shutdown-timeout" in args:
        drain = float(args[args.index("--graceful-shutdown-timeout") + 1])
    stop = SNAPSHOT_STOP_TIMEOUT_S if "--hicache-snapshot-path" in args else STOP_TIMEOUT_S
    return drain + stop + STOP_MARGIN_S


def worker_roles(spec: GroupSpec, router: RoleSpec) -> list[RoleSpec]:
    """The server roles a router fronts: its dependencies of a server kind."""
    return [spec.role(d) for d in router.dependencies if spec.role(d).kind in SERVER_KINDS]


def router_peers(spec: GroupSpec, router: RoleSpec, net: Network) -> list[str]:
    """The router's upstream flags: every worker's URL, or the prefill and decode servers in PD mode."""
    def url(role: RoleSpec, i: int) -> str:
        return f"http://{net.member_host(role, i)}:{net.port(role, i, 'http')}"

    fronted = worker_roles(spec, router)
    if all(r.kind == "worker" for r in fronted):
        return ["--worker-urls", *(url(r, i) for r in fronted for i in range(r.replicas))]
    flags = ["--pd-disaggregation"]
    for r in fronted:
        for i in range(r.replicas):
            flags += (["--prefill", url(r, i), str(net.port(r, i, "bootstrap"))] if r.kind == "prefill"
                      else ["--decode", url(r, i)])
    return flags


def mooncake_addresses(spec: GroupSpec, net: Network) -> tuple[str, str]:
    """(master host:port, metadata server URL) of the group's mooncake-master role."""
    master = spec.roles_of("mooncake-master")[0]
    host = net.member_host(master, 0)
    if isinstance(net, KubeNetwork):
        host = net.service(master)
    return (f"{host}:{net.port(master, 0, 'rpc')}",
            f"http://{host}:{net.port(master, 0, 'metadata')}/metadata")


def mooncake_client_env(spec: GroupSpec, net: Network) -> dict[str, str]:
    """SGLang's Mooncake variables pointing a worker at the group's master (it contributes no memory)."""
    master, metadata = mooncake_addresses(spec, net)
    return {"MOONCAKE_MASTER": master, "MOONCAKE_TE_META_DATA_SERVER": metadata, "MOONCAKE_PROTOCOL": "tcp",
            "MOONCAKE_LOCAL_HOSTNAME": net.bind_host, "MOONCAKE_GLOBAL_SEGMENT_SIZE": "0"}
