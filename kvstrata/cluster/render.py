"""Kubernetes manifests of a spec: one RoleBasedGroup (workloads.x-k8s.io/v1alpha1) plus the Services; with
prefill/decode roles also the group's PD Secret and a NetworkPolicy.

Every container runs `member_command(...)` with a `KubeNetwork`, so its arguments and environment are
those of the local launcher with the pod IP, container ports and Service names in place of 127.0.0.1 and
free ports. Roles that hold KV (workers, the Mooncake store) are InstanceSets updated in place
(`InPlaceIfPossible`): an image change restarts the container, keeping the pod, its IP and its name.

PD roles read $KVSTRATA_DISAGGREGATION_SECRET from the Secret `<group>-pd-secret` (generated at render,
or taken from that variable when it is set, so that a re-render keeps it). The NetworkPolicy admits only
the group's own pods to their bootstrap port and to the transfer engine's port range (plan.TRANSFER_PORTS);
their HTTP port stays open to the router, probes and scrapers. A server pod's
terminationGracePeriodSeconds covers its drain and L2 snapshot (plan.server_stop_grace_s). A server role's
tensor-parallel group (`--tp-size N`) is one member, one pod: the pod asks for N GPUs (`device: cuda`) or N x
`resources.threads` CPUs, and the server starts its N rank processes inside it.
"""

from __future__ import annotations

import math
import os
from typing import Any, Optional

import yaml

from kvstrata.cluster.plan import (
    KIND_PORTS,
    KUBE_STATE_DIR,
    PD_KINDS,
    KubeNetwork,
    MemberCommand,
    Probe,
    member_command,
)
from kvstrata.cluster.spec import GPU_RESOURCE, SERVER_KINDS, GroupSpec, RoleSpec, tp_group_resources

API_VERSION = "workloads.x-k8s.io/v1alpha1"
LABEL_GROUP = "rolebasedgroup.workloads.x-k8s.io/name"
LABEL_ROLE = "rolebasedgroup.workloads.x-k8s.io/role"
IN_PLACE_GRACE_S = 30      # not-ready before the image is swapped: the router drains the member meanwhile
PROGRAMS = {"python": "python3"}
STATE_VOLUME = "kvstrata-state"
SECRET_KEY = "disaggregation-secret"


def render(spec: GroupSpec, image: Optional[str] = None) -> list[dict]:
    """The manifests: the RoleBasedGroup first, then one Service per role that others address."""
    net = KubeNetwork(spec.name)
    roles = [_role(spec, role, net, spec.image_for(role, image)) for role in spec.roles]
    rbg = {"apiVersion": API_VERSION, "kind": "RoleBasedGroup",
           "metadata": {"name": spec.name, "labels": {"app.kubernetes.io/name": "kvstrata"}},
           "spec": {"roles": roles}}
    docs = [rbg, *(_service(spec, role, net) for role in spec.roles if _role_ports(role, net))]
    pd_roles = [role for role in spec.roles if role.kind in PD_KINDS]
    if pd_roles:
        docs += [_pd_secret(spec, net), _pd_network_policy(spec, pd_roles, net)]
    return docs


def pd_secret_name(spec: GroupSpec) -> str:
    """The Secret holding the group's PD secret."""
    return f"{spec.name}-pd-secret"


def to_yaml(docs: list[dict]) -> str:
    """Multi-document YAML."""
    return yaml.safe_dump_all(docs, sort_keys=False, default_flow_style=False)


def write_manifests(docs: list[dict], out_dir: str) -> list[str]:
    """One file per manifest, named kind-name.yaml; returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for doc in docs:
        path = os.path.join(out_dir, f"{doc['kind'].lower()}-{doc['metadata']['name']}.yaml")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(yaml.safe_dump(doc, sort_keys=False))
        paths.append(path)
    return paths


def _role(spec: GroupSpec, role: RoleSpec, net: KubeNetwork, image: str) -> dict:
    cmd = member_command(spec, role, 0, net)
    item: dict[str, Any] = {"name": role.name, "replicas": role.replicas}
    if role.dependencies:
        item["dependencies"] = list(role.dependencies)
    if role.holds_cache:
        item["workload"] = {"apiVersion": API_VERSION, "kind": "InstanceSet"}
        item["rolloutStrategy"] = {"type": "RollingUpdate", "rollingUpdate": {
            "type": "InPlaceIfPossible", "maxUnavailable": 1, "maxSurge": 0,
            "inPlaceUpdateStrategy": {"gracePeriodSeconds": IN_PLACE_GRACE_S}}}
    else:
        item["rolloutStrategy"] = {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}}
    pod_spec: dict[str, Any] = {"containers": [_container(spec, role, cmd, image)]}
    if role.kind in SERVER_KINDS:         # the default 30 s can land before the drain and the L2 snapshot end
        pod_spec["terminationGracePeriodSeconds"] = math.ceil(cmd.stop_grace_s)
    if KUBE_STATE_DIR in " ".join(cmd.args):
        # the L2 snapshot's directory: an emptyDir lives as long as the pod, so it outlives the container
        # restart of an in-place update
        pod_spec["volumes"] = [{"name": STATE_VOLUME, "emptyDir": {}}]
        pod_spec["containers"][0]["volumeMounts"] = [{"name": STATE_VOLUME, "mountPath": KUBE_STATE_DIR}]
    if role.kind in SERVER_KINDS:
        pod_spec["subdomain"] = net.service(role)    # member DNS names: <pod>.<service>
    item["template"] = {"metadata": {"labels": {"app.kubernetes.io/name": "kvstrata",
                                                "app.kubernetes.io/component": role.kind}},
                        "spec": pod_spec}
    return item


def _container(spec: GroupSpec, role: RoleSpec, cmd: MemberCommand, image: str) -> dict:
    env = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    env += [{"name": k, "value": v} for k, v in cmd.env.items()]
    env += [{"name": k, "valueFrom": {"secretKeyRef": {"name": pd_secret_name(spec), "key": SECRET_KEY}}}
            for k in cmd.secret_env]
    container: dict[str, Any] = {
        "name": role.kind.replace("mooncake-", "mooncake"), "image": image,
        "command": [PROGRAMS.get(cmd.program, cmd.program)], "args": list(cmd.args), "env": env,
    }
    if cmd.ports:
        container["ports"] = [{"name": name, "containerPort": port, "protocol": "TCP"}
                              for name, port in cmd.ports.items()]
    container["readinessProbe"] = _probe(cmd.probe, cmd.ports, role)
    resources = _resources(role) if role.kind in SERVER_KINDS else {
        k: dict(v) for k, v in (("requests", role.resources.requests), ("limits", role.resources.limits)) if v}
    if resources:
        container["resources"] = resources
    return container


def _resources(role: RoleSpec) -> dict:
    """A server's requests and limits: the spec's, with its tensor-parallel group's needs filled in where the
    spec leaves them out (GPUs as a limit, Kubernetes' rule for devices; CPUs as a request)."""
    requests, limits = dict(role.resources.requests), dict(role.resources.limits)
    for name, needed in tp_group_resources(role).items():
        (limits if name == GPU_RESOURCE else requests).setdefault(name, f"{needed:g}")
    return {k: v for k, v in (("requests", requests), ("limits", limits)) if v}


def _probe(probe: Probe, ports: dict[str, int], role: RoleSpec) -> dict:
    timing = {"periodSeconds": max(1, round(role.readiness.period_s)), "failureThreshold": 3}
    if probe.kind == "http":
        return {"httpGet": {"path": probe.path, "port": ports[probe.ports[0]]}, **timing}
    if probe.kind == "tcp":
        return {"tcpSocket": {"port": ports[probe.ports[0]]}, **timing}
    return {"exec": {"command": ["test", "-f", probe.path]}, **timing}


def _role_ports(role: RoleSpec, net: KubeNetwork) -> dict[str, int]:
    return {name: net.port(role, 0, name) for name in KIND_PORTS[role.kind]}


def _service(spec: GroupSpec, role: RoleSpec, net: KubeNetwork) -> dict:
    """Server roles get a headless Service (per-member DNS for the router); others a ClusterIP."""
    svc: dict[str, Any] = {
        "selector": {LABEL_GROUP: spec.name, LABEL_ROLE: role.name},
        "ports": [{"name": name, "port": port, "targetPort": port, "protocol": "TCP"}
                  for name, port in _role_ports(role, net).items()],
    }
    if role.kind in SERVER_KINDS:
        svc["clusterIP"] = "None"
    else:
        svc["type"] = "ClusterIP"
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": net.service(role), "labels": {LABEL_GROUP: spec.name, LABEL_ROLE: role.name}},
            "spec": svc}


def _pd_secret(spec: GroupSpec, net: KubeNetwork) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": pd_secret_name(spec), "labels": {LABEL_GROUP: spec.name}},
            "stringData": {SECRET_KEY: net.pd_secret}}


def _pd_network_policy(spec: GroupSpec, pd_roles: list[RoleSpec], net: KubeNetwork) -> dict:
    """Ingress to the PD pods: HTTP from anywhere; bootstrap and transfer-engine ports from the group only."""
    low, high = net.transfer_ports
    pd_ports = [{"protocol": "TCP", "port": low, "endPort": high}]
    pd_ports += sorted(({"protocol": "TCP", "port": net.port(r, 0, "bootstrap")}
                        for r in pd_roles if "bootstrap" in KIND_PORTS[r.kind]), key=lambda p: p["port"])
    http = sorted({net.port(r, 0, "http") for r in pd_roles})
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": f"{spec.name}-pd", "labels": {LABEL_GROUP: spec.name}},
            "spec": {"podSelector": {"matchLabels": {LABEL_GROUP: spec.name},
                                     "matchExpressions": [{"key": LABEL_ROLE, "operator": "In",
                                                           "values": [r.name for r in pd_roles]}]},
                     "policyTypes": ["Ingress"],
                     "ingress": [{"ports": [{"protocol": "TCP", "port": p} for p in http]},
                                 {"from": [{"podSelector": {"matchLabels": {LABEL_GROUP: spec.name}}}],
                                  "ports": pd_ports}]}}
