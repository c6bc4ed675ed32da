"""The role-group spec: named roles with a kind, replicas, arguments, environment, dependencies, readiness,
resources and an image, read from YAML and checked with errors that name the field (`roles[2].kind`).

Nothing here addresses another role: host names, ports and peer lists are derived by `plan.py`, the same
way for local processes and for Kubernetes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

KINDS = ("router", "worker", "prefill", "decode", "mooncake-master", "mooncake-store")
SERVER_KINDS = ("worker", "prefill", "decode")           # kvstrata servers (ServerArgs flags)
CACHE_KINDS = ("worker", "prefill", "decode", "mooncake-store")   # hold KV: updated in place
STORE_ARGS = {"segment-size"}      # the store's memory; mooncake-master args go to mooncake_master as flags
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
GPU_RESOURCE = "nvidia.com/gpu"    # Kubernetes' name for a GPU (NVIDIA's device plugin)
ArgValue = Any    # str | int | float | bool | list of those


class SpecError(ValueError):
    """An invalid spec; the message starts with the field it is about."""


@dataclass(frozen=True)
class Readiness:
    """How long to wait for a member to become ready, and how often to probe (the probe follows the kind)."""

    timeout_s: float = 300.0
    period_s: float = 0.5


@dataclass(frozen=True)
class Resources:
    """CPU placement locally (cores, threads) and Kubernetes requests/limits."""

    cpu_cores: Optional[str] = None          # local: taskset-style list "0-1,3" for each member
    threads: Optional[int] = None            # torch threads (--num-threads) and OMP_NUM_THREADS
    requests: dict[str, str] = field(default_factory=dict)
    limits: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RoleSpec:
    """One role of the group: `replicas` identical members of one kind."""

    name: str
    kind: str
    replicas: int = 1
    args: dict[str, ArgValue] = field(default_factory=dict)   # flag name (no dashes) -> value
    env: dict[str, str] = field(default_factory=dict)
    dependencies: tuple[str, ...] = ()
    readiness: Readiness = Readiness()
    resources: Resources = Resources()
    image: Optional[str] = None
    port: Optional[int] = None      # Kubernetes container port (locally every member gets a free port)

    @property
    def holds_cache(self) -> bool:
        """Whether a restart would lose KV this role holds (so Kubernetes updates it in place)."""
        return self.kind in CACHE_KINDS


@dataclass(frozen=True)
class GroupSpec:
    """The whole deployment: its name, an optional default image, the roles in spec order."""

    name: str
    roles: tuple[RoleSpec, ...]
    image: Optional[str] = None

    def role(self, name: str) -> RoleSpec:
        """The role called `name` (SpecError if there is none)."""
        for role in self.roles:
            if role.name == name:
                return role
        raise SpecError(f"no role named {name!r}; roles: {', '.join(r.name for r in self.roles)}")

    def roles_of(self, *kinds: str) -> list[RoleSpec]:
        """Roles of the given kinds, in spec order."""
        return [r for r in self.roles if r.kind in kinds]

    def start_order(self) -> list[RoleSpec]:
        """Roles in dependency order (dependencies first; ties in spec order)."""
        return topological_order(self)

    def image_for(self, role: RoleSpec, override: Optional[str] = None) -> str:
        """The image of `role` for Kubernetes: --image, the role's, the group's; SpecError if none."""
        image = override or role.image or self.image
        if not image:
            index = self.roles.index(role)
            raise SpecError(f"roles[{index}].image: role {role.name!r} has no image; set `image:` on the role "
                            f"or the group, or pass --image")
        return image


DEFAULT_SPEC_YAML = """\
# kvstrata role group: `kvstrata cluster up [SPEC]` runs it here, `kvstrata cluster render [SPEC]` turns it
# into a Kubernetes RoleBasedGroup. Addresses are derived: the router learns its workers, workers learn the
# Mooncake master and metadata server. `args` are the role's own flags (without --host/--port).
name: kvstrata
image: kvstrata:latest            # for render; --image overrides it
roles:
  - name: mooncake-master
    kind: mooncake-master
  - name: mooncake-store          # holds the L3 memory, so a worker upgrade keeps the cache
    kind: mooncake-store
    dependencies: [mooncake-master]
    args: {segment-size: 256mb}
  - name: worker
    kind: worker
    replicas: 2
    dependencies: [mooncake-master, mooncake-store]
    args:
      model-path: tiny
      page-size: 16
      max-total-tokens: 4096
      enable-hierarchical-cache: true
      hicache-ratio: 2
      hicache-mem-layout: page_first
      hicache-storage-backend: mooncake
    resources:
      threads: 1
      requests: {cpu: "1", memory: 2Gi}
      limits: {cpu: "2", memory: 4Gi}
  - name: router
    kind: router
    dependencies: [worker]
"""

_GROUP_KEYS = {"name", "image", "roles"}
_ROLE_KEYS = {"name", "kind", "replicas", "args", "env", "dependencies", "readiness", "resources", "image",
              "port"}
_DERIVED_ARGS = {"host", "port", "worker-urls", "master", "metadata", "ready-file", "disaggregation-mode",
                 "disaggregation-bootstrap-port", "pd-disaggregation", "prefill", "decode",
                 "disaggregation-secret", "disaggregation-advertise-host"}


def load_spec(path: Optional[str] = None) -> GroupSpec:
    """Read and check the spec at `path` (the default spec when None)."""
    if path is None:
        return parse_spec(DEFAULT_SPEC_YAML)
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as e:
        raise SpecError(f"cannot read spec {path}: {e.strerror}") from None
    return parse_spec(text, source=path)


def parse_spec(text: str, source: str = "spec") -> GroupSpec:
    """Parse YAML text into a checked GroupSpec."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise SpecError(f"{source}: not valid YAML: {e}") from None
    spec = spec_from_dict(data)
    check_spec(spec)
    return spec


def spec_from_dict(data: Any) -> GroupSpec:
    """Build the typed spec from plain data, naming the first field of the wrong shape."""
    _mapping(data, "spec", _GROUP_KEYS)
    roles = data.get("roles")
    if not isinstance(roles, list) or not roles:
        raise SpecError("roles: must be a non-empty list of roles")
    return GroupSpec(name=_str(data.get("name", "kvstrata"), "name"),
                     image=_opt_str(data.get("image"), "image"),
                     roles=tuple(_role(r, f"roles[{i}]") for i, r in enumerate(roles)))


def _role(data: Any, where: str) -> RoleSpec:
    _mapping(data, where, _ROLE_KEYS)
    for key in ("name", "kind"):
        if key not in data:
            raise SpecError(f"{where}.{key}: required")
    args = data.get("args") or {}
    _mapping(args, f"{where}.args")
    args = {str(k).lstrip("-").replace("_", "-"): v for k, v in args.items()}
    derived = sorted(set(args) & _DERIVED_ARGS)
    if derived:
        raise SpecError(f"{where}.args.{derived[0]}: derived by the launcher (addresses and ports are not "
                        f"written by hand)")
    env = data.get("env") or {}
    _mapping(env, f"{where}.env")
    deps = data.get("dependencies") or []
    if not isinstance(deps, list):
        raise SpecError(f"{where}.dependencies: must be a list of role names")
    replicas = data.get("replicas", 1)
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
        raise SpecError(f"{where}.replicas: must be an integer >= 1, got {replicas!r}")
    port = data.get("port")
    if port is not None and (not isinstance(port, int) or not 0 < port < 65536):
        raise SpecError(f"{where}.port: must be a port number, got {port!r}")
    return RoleSpec(name=_str(data["name"], f"{where}.name"), kind=_str(data["kind"], f"{where}.kind"),
                    replicas=replicas, args=args, env={str(k): str(v) for k, v in env.items()},
                    dependencies=tuple(_str(d, f"{where}.dependencies[{j}]") for j, d in enumerate(deps)),
                    readiness=_readiness(data.get("readiness") or {}, f"{where}.readiness"),
                    resources=_resources(data.get("resources") or {}, f"{where}.resources"),
                    image=_opt_str(data.get("image"), f"{where}.image"), port=port)


def _readiness(data: Any, where: str) -> Readiness:
    _mapping(data, where, {"timeout_s", "period_s"})
    values = {}
    for key in ("timeout_s", "period_s"):
        if key in data:
            value = data[key]
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise SpecError(f"{where}.{key}: must be a positive number of seconds, got {value!r}")
            values[key] = float(value)
    return Readiness(**values)


def _resources(data: Any, where: str) -> Resources:
    _mapping(data, where, {"cpu_cores", "threads", "requests", "limits"})
    cores = data.get("cpu_cores")
    if cores is not None:
        cores = str(cores)
        parse_cpu_list(cores, f"{where}.cpu_cores")
    threads = data.get("threads")
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
        raise SpecError(f"{where}.threads: must be an integer >= 1, got {threads!r}")
    quantities = {}
    for key in ("requests", "limits"):
        value = data.get(key) or {}
        _mapping(value, f"{where}.{key}")
        quantities[key] = {str(k): str(v) for k, v in value.items()}
    return Resources(cpu_cores=cores, threads=threads, **quantities)


def parse_cpu_list(text: str, where: str = "cpu_cores") -> set[int]:
    """CPU ids of a list like "0-1,3"."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise SpecError(f"{where}: must be a CPU list like '0-1,3', got {text!r}") from None
    if not cpus:
        raise SpecError(f"{where}: names no CPU")
    return cpus


def check_spec(spec: GroupSpec) -> None:
    """Check names, kinds, dependencies (known, acyclic) and what discovery needs; SpecError on the first problem."""
    if not DNS_LABEL.match(spec.name) or len(spec.name) > 40:
        raise SpecError(f"name: {spec.name!r} must be a lowercase DNS label of at most 40 characters")
    names = [r.name for r in spec.roles]
    for i, role in enumerate(spec.roles):
        where = f"roles[{i}]"
        if not DNS_LABEL.match(role.name) or len(role.name) > 20:
            raise SpecError(f"{where}.name: {role.name!r} must be a lowercase DNS label of at most 20 characters")
        if names.index(role.name) != i:
            raise SpecError(f"{where}.name: duplicate role name {role.name!r}")
        if role.kind not in KINDS:
            raise SpecError(f"{where}.kind: unknown role kind {role.kind!r}; known kinds: {', '.join(KINDS)}")
        for j, dep in enumerate(role.dependencies):
            if dep not in names:
                raise SpecError(f"{where}.dependencies[{j}]: unknown role {dep!r}")
            if dep == role.name:
                raise SpecError(f"{where}.dependencies[{j}]: role {role.name!r} depends on itself")
        if role.kind in SERVER_KINDS or role.kind == "router":
            _check_role_args(role, where)
        if role.kind in SERVER_KINDS:
            _check_tp_group(role, where)
        unknown = sorted(set(role.args) - STORE_ARGS) if role.kind == "mooncake-store" else []
        if unknown:
            raise SpecError(f"{where}.args.{unknown[0]}: unknown mooncake-store argument; allowed: "
                            f"{', '.join(sorted(STORE_ARGS))}")
    topological_order(spec)   # raises on a cycle
    _check_discovery(spec)


def to_flags(args: dict[str, ArgValue]) -> list[str]:
    """`{"page-size": 16, "enable-x": True, "no-y": False}` -> `["--page-size", "16", "--enable-x", "--no-y"]`.

    True is the bare flag; False is `--no-<flag>` (ServerArgs' booleans accept both); a list repeats values.
    """
    out: list[str] = []
    for name, value in args.items():
        if value is True:
            out.append(f"--{name}")
        elif value is False:
            out.append(f"--no-{name}")
        elif isinstance(value, list):
            out += [f"--{name}", *map(str, value)]
        elif value is not None:
            out += [f"--{name}", str(value)]
    return out


def _check_role_args(role: RoleSpec, where: str) -> None:
    """Parse a server's or router's args as `kvstrata serve` / `kvstrata router` would, so that a bad flag
    fails here rather than at start."""
    from kvstrata.args import ServerArgs

    if role.kind in ("prefill", "decode") and "disaggregation_mode" not in ServerArgs.__dataclass_fields__:
        raise SpecError(f"{where}.kind: {role.kind!r} roles need prefill/decode disaggregation, which this "
                        f"build of kvstrata does not have yet; use kind 'worker'")
    _parse_role_args(role, where)


def _parse_role_args(role: RoleSpec, where: str) -> Any:
    """The ServerArgs (a server kind) or RouterArgs (the router) that the role's args parse to."""
    import argparse

    from kvstrata.args import ConfigError, ServerArgs
    from kvstrata.router.args import RouterArgs

    args_cls = RouterArgs if role.kind == "router" else ServerArgs
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    args_cls.add_cli_args(parser)
    try:
        ns, unknown = parser.parse_known_args(to_flags(role.args))
        if unknown:
            raise SpecError(f"{where}.args: unknown {role.kind} argument {unknown[0]!r}")
        return args_cls.from_cli_args(ns)
    except (argparse.ArgumentError, ConfigError) as e:
        raise SpecError(f"{where}.args: {e}") from None


def tp_group_resources(role: RoleSpec) -> dict[str, float]:
    """What one member of a server role needs for its tensor-parallel group (--tp-size N ranks, all in the
    member: one pod): N GPUs with `device: cuda`, else N x `resources.threads` CPUs (nothing without threads)."""
    args = _parse_role_args(role, role.name)
    if args.device == "cuda":
        return {GPU_RESOURCE: float(args.tp_size)}
    if role.resources.threads:
        return {"cpu": float(args.tp_size * role.resources.threads)}
    return {}


def _check_tp_group(role: RoleSpec, where: str) -> None:
    """A TP group is one member: no ranks on other machines, and requests or limits the spec sets itself
    that cover every rank."""
    if _parse_role_args(role, where).nnodes > 1:
        raise SpecError(f"{where}.args.nnodes: a role's tensor-parallel group runs in one member (one pod); "
                        f"a group spread over machines is not deployed by kvstrata cluster")
    for name, needed in tp_group_resources(role).items():
        for kind, given in (("requests", role.resources.requests), ("limits", role.resources.limits)):
            if name in given and parse_quantity(given[name], f"{where}.resources.{kind}.{name}") < needed:
                raise SpecError(f"{where}.resources.{kind}.{name}: {given[name]} is less than the {needed:g} its "
                                f"tensor-parallel group needs ({'one GPU' if name == GPU_RESOURCE else 'threads'} "
                                f"per rank)")


def parse_quantity(text: str, where: str) -> float:
    """A Kubernetes CPU or count quantity: "2", "1.5", "500m"."""
    try:
        return float(text[:-1]) / 1000 if text.endswith("m") else float(text)
    except ValueError:
        raise SpecError(f"{where}: must be a quantity such as '2' or '500m', got {text!r}") from None


def _check_discovery(spec: GroupSpec) -> None:
    for kind in ("mooncake-master", "router"):
        found = spec.roles_of(kind)
        if len(found) > 1:
            raise SpecError(f"roles[{spec.roles.index(found[1])}].kind: only one {kind} role per group")
    for i, role in enumerate(spec.roles):
        needs_master = role.kind == "mooncake-store" or (
            role.kind in SERVER_KINDS and role.args.get("hicache-storage-backend") == "mooncake")
        if needs_master and not spec.roles_of("mooncake-master"):
            raise SpecError(f"roles[{i}]: role {role.name!r} needs Mooncake but the group has no mooncake-master role")
        fronted = {spec.role(d).kind for d in role.dependencies} & set(SERVER_KINDS)
        if role.kind == "router" and not fronted:
            raise SpecError(f"roles[{i}].dependencies: the router learns its workers from its dependencies; "
                            f"list at least one worker, prefill or decode role")
        if role.kind == "router" and fronted - {"worker"} and fronted != {"prefill", "decode"}:
            raise SpecError(f"roles[{i}].dependencies: a router fronts either worker roles or both a prefill "
                            f"and a decode role, got {', '.join(sorted(fronted))}")
        if role.kind == "router" and role.replicas != 1:
            raise SpecError(f"roles[{i}].replicas: the router runs as one member")


def topological_order(spec: GroupSpec) -> list[RoleSpec]:
    """Dependencies before dependents, ties in spec order; SpecError naming a cycle if there is one."""
    order: list[RoleSpec] = []
    state: dict[str, str] = {}

    def visit(role: RoleSpec, path: list[str]) -> None:
        if state.get(role.name) == "done":
            return
        if state.get(role.name) == "visiting":
            cycle = path[path.index(role.name):] + [role.name]
            raise SpecError(f"roles: dependency cycle {' -> '.join(cycle)}")
        state[role.name] = "visiting"
        for dep in role.dependencies:
            visit(spec.role(dep), path + [role.name])
        state[role.name] = "done"
        order.append(role)

    for role in spec.roles:
        visit(role, [])
    return order


def _mapping(value: Any, where: str, allowed: Optional[set[str]] = None) -> None:
    if not isinstance(value, dict):
        raise SpecError(f"{where}: must be a mapping, got {type(value).__name__}")
    if allowed is not None:
        unknown = sorted(set(map(str, value)) - allowed)
        if unknown:
            raise SpecError(f"{where}.{unknown[0]}: unknown field; allowed: {', '.join(sorted(allowed))}")


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise SpecError(f"{where}: must be a non-empty string, got {value!r}")
    return value


def _opt_str(value: Any, where: str) -> Optional[str]:
    return None if value is None else _str(value, where)
