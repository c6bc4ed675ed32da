"""`kvstrata cluster render`: manifests valid against the RBG CRD and core schemas, offline; local and
rendered deployments run the same roles, in the same order, with the same arguments."""

import subprocess
import sys

import jsonschema
import pytest
import yaml

from kvstrata.cluster.plan import KubeNetwork, member_command
from kvstrata.cluster.render import API_VERSION, render
from kvstrata.cluster.spec import SpecError, load_spec, parse_spec
from kvstrata.cluster.supervisor import Supervisor
from tests.capabilities import requires_rbg_crd
from tests.cluster.k8s_schema import validate_core, validate_crd_object

# Flags whose values are addresses: 127.0.0.1 and free ports locally, pod IP and Service names on Kubernetes.
ADDRESS_FLAGS = {"--host", "--port", "--rpc-port", "--metadata-port", "--metrics-port", "--master",
                 "--metadata", "--local-hostname", "--ready-file", "--worker-urls", "--prefill", "--decode",
                 "--disaggregation-bootstrap-port", "--hicache-snapshot-path"}
ADDRESS_ENV = {"MC_TCP_BIND_ADDRESS", "MOONCAKE_MASTER", "MOONCAKE_TE_META_DATA_SERVER", "MOONCAKE_LOCAL_HOSTNAME"}


@pytest.fixture(scope="module")
def docs():
    return render(load_spec(), image="registry.example/kvstrata:0.1")


@requires_rbg_crd
def test_rolebasedgroup_fits_the_crd_schema(docs):
    rbg = docs[0]
    assert rbg["apiVersion"] == API_VERSION and rbg["kind"] == "RoleBasedGroup"
    validate_crd_object(rbg, "v1alpha1")


@requires_rbg_crd
def test_schema_check_catches_mistakes(docs):
    bad = yaml.safe_load(yaml.safe_dump(docs[0]))
    bad["spec"]["roles"][0]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        validate_crd_object(bad, "v1alpha1")
    bad = yaml.safe_load(yaml.safe_dump(docs[0]))
    bad["spec"]["roles"][2]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {}
    with pytest.raises(jsonschema.ValidationError, match="httpGett"):
        validate_crd_object(bad, "v1alpha1")


def test_services_and_pod_templates_fit_the_core_schemas(docs):
    services = [d for d in docs if d["kind"] == "Service"]
    assert {s["metadata"]["name"] for s in services} == {"kvstrata-mooncake-master", "kvstrata-worker",
                                                          "kvstrata-router"}
    for svc in services:
        validate_core(svc)
    for role in docs[0]["spec"]["roles"]:
        validate_core({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role["name"]},
                       "template": role["template"]})


def test_roles_dependencies_probes_and_in_place_updates(docs):
    roles = {r["name"]: r for r in docs[0]["spec"]["roles"]}
    assert list(roles) == ["mooncake-master", "mooncake-store", "worker", "router"]
    assert roles["worker"]["replicas"] == 2
    assert roles["worker"]["dependencies"] == ["mooncake-master", "mooncake-store"]
    assert roles["router"]["dependencies"] == ["worker"]
    for name in ("worker", "mooncake-store"):
        update = roles[name]["rolloutStrategy"]["rollingUpdate"]
        assert update["type"] == "InPlaceIfPossible" and update["inPlaceUpdateStrategy"]["gracePeriodSeconds"] > 0
        assert roles[name]["workload"]["kind"] == "InstanceSet"
    assert "inPlaceUpdateStrategy" not in roles["router"]["rolloutStrategy"]["rollingUpdate"]
    worker = roles["worker"]["template"]["spec"]["containers"][0]
    assert worker["readinessProbe"]["httpGet"] == {"path": "/health", "port": 30000}
    assert worker["image"] == "registry.example/kvstrata:0.1"
    assert worker["resources"] == {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"cpu": "2", "memory": "4Gi"}}
    env = {e["name"]: e.get("value") for e in worker["env"]}
    assert env["MOONCAKE_MASTER"] == "kvstrata-mooncake-master:50051"
    router = roles["router"]["template"]["spec"]["containers"][0]
    urls = router["args"][router["args"].index("--worker-urls") + 1:]
    assert urls == ["http://kvstrata-worker-0.kvstrata-worker:30000", "http://kvstrata-worker-1.kvstrata-worker:30000"]


def _masked(args):
    """Arguments with address values replaced by a placeholder (--worker-urls takes every value after it)."""
    out, flag = [], None
    for token in args:
        if token.startswith("--"):
            flag = token
            out.append(token)
        else:
            out.append("<address>" if flag in ADDRESS_FLAGS else token)
    return out


def test_local_and_rendered_members_run_the_same_commands(docs, tmp_path):
    spec = load_spec()
    local = Supervisor(spec, tmp_path)   # not started: its members' commands are what `up` would spawn
    rendered = docs[0]["spec"]["roles"]
    local_roles = list(local.members)
    assert local_roles == [r.name for r in spec.start_order()]
    assert sorted(local_roles) == sorted(r["name"] for r in rendered)
    # the rendered dependencies give the same start order
    placed = []
    for name in local_roles:
        role = next(r for r in rendered if r["name"] == name)
        assert set(role.get("dependencies", [])) <= set(placed)
        placed.append(name)
    for role in rendered:
        container = role["template"]["spec"]["containers"][0]
        members = local.members[role["name"]]
        assert len(members) == role["replicas"]
        for m in members:
            assert container["command"] == ["python3"] and m.cmd.program == "python"
            assert _masked(m.cmd.args) == _masked(container["args"])
            rendered_env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
            assert set(rendered_env) == set(m.cmd.env)
            assert {k: v for k, v in rendered_env.items() if k not in ADDRESS_ENV} == \
                   {k: v for k, v in m.cmd.env.items() if k not in ADDRESS_ENV}
    # and one function made both
    kube = member_command(spec, spec.role("worker"), 1, KubeNetwork(spec.name))
    assert list(kube.args) == rendered[2]["template"]["spec"]["containers"][0]["args"]


PD_SPEC = """
name: kvpd
image: kvstrata:test
roles:
  - {name: prefill, kind: prefill, replicas: 2, args: {model-path: tiny}}
  - {name: decode, kind: decode, args: {model-path: tiny}}
  - {name: router, kind: router, dependencies: [prefill, decode]}
"""


@requires_rbg_crd
def test_prefill_decode_group(tmp_path):
    spec = parse_spec(PD_SPEC)
    docs = render(spec)
    validate_crd_object(docs[0], "v1alpha1")
    for svc in docs[1:]:
        validate_core(svc)
    roles = {r["name"]: r["template"]["spec"]["containers"][0] for r in docs[0]["spec"]["roles"]}
    assert roles["prefill"]["args"][6:10] == ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "8998"]
    assert {p["name"]: p["containerPort"] for p in roles["prefill"]["ports"]} == {"http": 30000, "bootstrap": 8998}
    assert roles["decode"]["args"][6:8] == ["--disaggregation-mode", "decode"]
    router = roles["router"]["args"]
    assert router[router.index("--pd-disaggregation"):] == [
        "--pd-disaggregation", "--prefill", "http://kvpd-prefill-0.kvpd-prefill:30000", "8998",
        "--prefill", "http://kvpd-prefill-1.kvpd-prefill:30000", "8998", "--decode", "http://kvpd-decode-0.kvpd-decode:30000"]
    local = Supervisor(spec, tmp_path).members["router"][0].cmd.args
    assert _masked(local) == _masked(router)
    assert "--worker-urls" not in router


def test_cli_render_to_stdout_and_to_files(tmp_path):
    base = [sys.executable, "-m", "kvstrata.cli", "cluster", "render", "--image", "kvstrata:x"]
    out = subprocess.run(base, capture_output=True, text=True, check=True).stdout
    kinds = [d["kind"] for d in yaml.safe_load_all(out)]
    assert kinds == ["RoleBasedGroup", "Service", "Service", "Service"]
    listed = subprocess.run(base + ["-o", str(tmp_path)], capture_output=True, text=True, check=True).stdout
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["rolebasedgroup-kvstrata.yaml", "service-kvstrata-mooncake-master.yaml",
                     "service-kvstrata-router.yaml", "service-kvstrata-worker.yaml"]
    assert len(listed.split()) == 4



def test_cache_roles_keep_their_l2_snapshot_in_a_pod_volume(docs):
    worker = next(r for r in docs[0]["spec"]["roles"] if r["name"] == "worker")
    pod = worker["template"]["spec"]
    args = pod["containers"][0]["args"]
    path = args[args.index("--hicache-snapshot-path") + 1]
    mount = pod["containers"][0]["volumeMounts"][0]
    assert path.startswith(mount["mountPath"] + "/")
    assert {"name": mount["name"], "emptyDir": {}} in pod["volumes"]


def test_pd_group_gets_a_secret_by_reference_and_a_network_policy(tmp_path, monkeypatch):
    monkeypatch.delenv("KVSTRATA_DISAGGREGATION_SECRET", raising=False)
    spec = parse_spec(PD_SPEC)
    docs = render(spec)
    by_kind = {d["kind"]: d for d in docs}
    secret, policy = by_kind["Secret"], by_kind["NetworkPolicy"]
    validate_core(secret)
    validate_core(policy)
    value = secret["stringData"]["disaggregation-secret"]
    assert len(value) >= 32 and value not in yaml.safe_dump(docs[0])      # pods hold a reference, not the value
    roles = {r["name"]: r["template"]["spec"]["containers"][0] for r in docs[0]["spec"]["roles"]}
    for name in ("prefill", "decode"):
        env = {e["name"]: e for e in roles[name]["env"]}
        assert env["KVSTRATA_DISAGGREGATION_SECRET"]["valueFrom"]["secretKeyRef"] == {
            "name": secret["metadata"]["name"], "key": "disaggregation-secret"}
        assert (env["MC_MIN_RPC_PORT"]["value"], env["MC_MAX_RPC_PORT"]["value"]) == ("15000", "15063")
    assert "KVSTRATA_DISAGGREGATION_SECRET" not in {e["name"] for e in roles["router"]["env"]}
    # the policy: PD pods only; HTTP from anywhere; bootstrap and the transfer range from the group's pods only
    selector = policy["spec"]["podSelector"]
    assert selector["matchLabels"] == {"rolebasedgroup.workloads.x-k8s.io/name": "kvpd"}
    assert selector["matchExpressions"][0]["values"] == ["prefill", "decode"]
    open_rule, group_rule = policy["spec"]["ingress"]
    assert "from" not in open_rule and [p["port"] for p in open_rule["ports"]] == [30000]
    assert group_rule["from"] == [{"podSelector": {"matchLabels": {"rolebasedgroup.workloads.x-k8s.io/name": "kvpd"}}}]
    assert {(p["port"], p.get("endPort")) for p in group_rule["ports"]} == {(15000, 15063), (8998, None)}
    # a second render makes a new secret unless one is given; a local group shares one across its PD members
    assert render(spec)[-2]["stringData"]["disaggregation-secret"] != value
    monkeypatch.setenv("KVSTRATA_DISAGGREGATION_SECRET", "pinned-secret-0123456789")
    assert render(spec)[-2]["stringData"]["disaggregation-secret"] == "pinned-secret-0123456789"
    monkeypatch.delenv("KVSTRATA_DISAGGREGATION_SECRET")
    members = Supervisor(spec, tmp_path).members
    secrets = {m.cmd.secret_env["KVSTRATA_DISAGGREGATION_SECRET"] for r in ("prefill", "decode") for m in members[r]}
    assert len(secrets) == 1 and not members["router"][0].cmd.secret_env
    assert secrets.pop() not in " ".join(members["prefill"][0].cmd.args)


def test_no_pd_objects_without_pd_roles(docs):
    assert {d["kind"] for d in docs} == {"RoleBasedGroup", "Service"}


def test_termination_grace_covers_drain_and_l2_snapshot(docs):
    pods = {r["name"]: r["template"]["spec"] for r in docs[0]["spec"]["roles"]}
    assert pods["worker"]["terminationGracePeriodSeconds"] == 30 + 120 + 15     # drain + snapshot + margin
    assert "terminationGracePeriodSeconds" not in pods["router"]
    spec = parse_spec(PD_SPEC.replace("args: {model-path: tiny}}", "args: {model-path: tiny, graceful-shutdown-timeout: 90}}", 1))
    pods = {r["name"]: r["template"]["spec"] for r in render(spec)[0]["spec"]["roles"]}
    assert pods["prefill"]["terminationGracePeriodSeconds"] == 90 + 10 + 15      # no L2 snapshot: scheduler stop
    assert pods["decode"]["terminationGracePeriodSeconds"] == 30 + 10 + 15


def test_the_pd_secret_is_not_a_spec_arg():
    with pytest.raises(SpecError, match="disaggregation-secret: derived by the launcher"):
        parse_spec(PD_SPEC.replace("{model-path: tiny}}", "{model-path: tiny, disaggregation-secret: x}}", 1))


TP_SPEC = """
name: kvtp
image: kvstrata:test
roles:
  - name: cpu
    kind: worker
    replicas: 2
    args: {model-path: tiny, tp-size: 2}
    resources: {threads: 3, limits: {memory: 4Gi}}
  - {name: gpu, kind: worker, args: {model-path: tiny, tp-size: 4, device: cuda}}
  - {name: router, kind: router, dependencies: [cpu, gpu]}
"""


def test_a_tensor_parallel_role_is_one_member_per_group_whose_pod_holds_every_rank(tmp_path):
    spec = parse_spec(TP_SPEC)
    roles = {r["name"]: r for r in render(spec)[0]["spec"]["roles"]}
    assert roles["cpu"]["replicas"] == 2 and roles["gpu"]["replicas"] == 1    # a replica is a whole TP group
    cpu, gpu = (roles[name]["template"]["spec"]["containers"][0] for name in ("cpu", "gpu"))
    # CPU: 2 ranks x 3 threads; the spec's own limits stay
    assert cpu["resources"] == {"requests": {"cpu": "6"}, "limits": {"memory": "4Gi"}}
    assert _flag(cpu["args"], "--tp-size") == "2" and _flag(cpu["args"], "--num-threads") == "3"
    assert {"name": "OMP_NUM_THREADS", "value": "3"} in cpu["env"]
    # CUDA: one GPU per rank, as a limit (Kubernetes' rule for devices); the ranks start at cuda:0 of the pod
    assert gpu["resources"] == {"limits": {"nvidia.com/gpu": "4"}}
    assert _flag(gpu["args"], "--tp-size") == "4" and "--base-gpu-id" not in gpu["args"]
    for role in roles.values():
        validate_core({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role["name"]},
                       "template": role["template"]})
    # locally each member is the same one `kvstrata serve --tp-size N` (it starts its ranks itself)
    local = Supervisor(spec, tmp_path)
    for name in ("cpu", "gpu"):
        for m in local.members[name]:
            assert _masked(m.cmd.args) == _masked(roles[name]["template"]["spec"]["containers"][0]["args"])


@pytest.mark.parametrize("old, new, message", [
    ("resources: {threads: 3, limits: {memory: 4Gi}}", "resources: {threads: 3, requests: {cpu: 5500m}}",
     r"roles\[0\]\.resources\.requests\.cpu: 5500m is less than the 6 its tensor-parallel group needs"),
    ("device: cuda}", "device: cuda}, resources: {limits: {nvidia.com/gpu: 2}}",
     r"roles\[1\]\.resources\.limits\.nvidia\.com/gpu: 2 is less than the 4"),
    ("tp-size: 2}", "tp-size: 2, nnodes: 2, dist-init-addr: '10.0.0.1:5000'}",
     r"roles\[0\]\.args\.nnodes: a role's tensor-parallel group runs in one member"),
])
def test_a_tensor_parallel_role_whose_resources_or_nodes_do_not_fit_is_refused(old, new, message):
    assert old in TP_SPEC
    with pytest.raises(SpecError, match=message):
        parse_spec(TP_SPEC.replace(old, new, 1))


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]
