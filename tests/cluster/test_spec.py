"""Spec parsing and validation: the default spec, and clear errors that name the field."""

import subprocess
import sys

import pytest

from kvstrata.cluster.render import render
from kvstrata.cluster.spec import DEFAULT_SPEC_YAML, SpecError, load_spec, parse_spec

BASE = """
name: g
roles:
  - name: mooncake-master
    kind: mooncake-master
  - name: worker
    kind: worker
    dependencies: [mooncake-master]
    args: {model-path: tiny}
  - name: router
    kind: router
    dependencies: [worker]
"""


def test_default_spec_is_valid_and_ordered():
    spec = load_spec()
    assert [r.name for r in spec.start_order()] == ["mooncake-master", "mooncake-store", "worker", "router"]
    worker = spec.role("worker")
    assert worker.replicas == 2 and worker.args["hicache-storage-backend"] == "mooncake"
    assert worker.holds_cache and not spec.role("router").holds_cache


def test_cli_spec_prints_the_default_spec():
    out = subprocess.run([sys.executable, "-m", "kvstrata.cli", "cluster", "spec"], capture_output=True,
                         text=True, check=True).stdout
    assert out == DEFAULT_SPEC_YAML
    assert parse_spec(out).name == "kvstrata"


@pytest.mark.parametrize("old,new,message", [
    ("kind: worker", "kind: wokrer", r"roles\[1\]\.kind: unknown role kind 'wokrer'"),
    ("dependencies: [mooncake-master]", "dependencies: [router]", r"dependency cycle (worker -> router -> worker|router -> worker -> router)"),
    ("dependencies: [mooncake-master]", "dependencies: [nope]", r"roles\[1\]\.dependencies\[0\]: unknown role 'nope'"),
    ("args: {model-path: tiny}", "args: {model-path: tiny, page-size: -3}", r"roles\[1\]\.args: --page-size must be positive"),
    ("args: {model-path: tiny}", "args: {no-such-flag: 1}", r"roles\[1\]\.args: unknown worker argument '--no-such-flag'"),
    ("args: {model-path: tiny}", "args: {port: 1234}", r"roles\[1\]\.args\.port: derived by the launcher"),
    ("args: {model-path: tiny}", "replicas: 0", r"roles\[1\]\.replicas: must be an integer >= 1"),
    ("args: {model-path: tiny}", "colour: red", r"roles\[1\]\.colour: unknown field"),
    ("dependencies: [worker]", "dependencies: [mooncake-master]", r"roles\[2\]\.dependencies: the router learns its workers"),
    ("name: worker", "name: Worker_1", r"roles\[1\]\.name: 'Worker_1' must be a lowercase DNS label"),
    ("kind: worker", "kind: decode", r"roles\[2\]\.dependencies: a router fronts either worker roles or both"),
    ("args: {model-path: tiny}", "args: {disaggregation-mode: prefill}", r"roles\[1\]\.args\.disaggregation-mode: derived"),
])
def test_invalid_spec_names_the_field(old, new, message):
    with pytest.raises(SpecError, match=message):
        parse_spec(BASE.replace(old, new, 1))


def test_a_worker_role_runs_a_tensor_parallel_group_of_its_own_size():
    spec = parse_spec(BASE.replace("args: {model-path: tiny}", "args: {model-path: tiny, tp-size: 2}", 1))
    assert spec.role("worker").args["tp-size"] == 2        # each replica: one `kvstrata serve --tp-size 2`
    storage = "args: {model-path: tiny, tp-size: 2, enable-hierarchical-cache: true, hicache-storage-backend: file}"
    parse_spec(BASE.replace("args: {model-path: tiny}", storage, 1))     # L3 is sharded per rank
    bad = "args: {model-path: tiny, tp-size: 2, ep-size: 3}"                 # the server's own checks apply
    with pytest.raises(SpecError, match=r"roles\[1\]\.args: --ep-size 3 must be 1 or --tp-size"):
        parse_spec(BASE.replace("args: {model-path: tiny}", bad, 1))


def test_mooncake_worker_needs_a_master():
    text = BASE.replace("args: {model-path: tiny}", "args: {enable-hierarchical-cache: true, "
                        "hicache-storage-backend: mooncake}")
    parse_spec(text)
    without_master = text.replace("  - name: mooncake-master\n    kind: mooncake-master\n", "").replace(
        "dependencies: [mooncake-master]", "dependencies: []")
    with pytest.raises(SpecError, match=r"roles\[0\]: role 'worker' needs Mooncake"):
        parse_spec(without_master)


def test_store_args_are_checked():
    text = DEFAULT_SPEC_YAML.replace("args: {segment-size: 256mb}", "args: {segment-size: 1gb, page-size: 4}")
    with pytest.raises(SpecError, match=r"roles\[1\]\.args\.page-size: unknown mooncake-store argument"):
        parse_spec(text)


def test_not_yaml_and_not_a_mapping():
    with pytest.raises(SpecError, match="not valid YAML"):
        parse_spec("roles: [")
    with pytest.raises(SpecError, match="spec: must be a mapping"):
        parse_spec("- a\n- b\n")


def test_render_without_an_image_is_an_error():
    spec = parse_spec(BASE)
    with pytest.raises(SpecError, match=r"roles\[0\]\.image: role 'mooncake-master' has no image.*--image"):
        render(spec)
    assert render(spec, image="kvstrata:test")[0]["kind"] == "RoleBasedGroup"


def test_cli_reports_an_invalid_spec(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(BASE.replace("kind: worker", "kind: gpu"))
    res = subprocess.run([sys.executable, "-m", "kvstrata.cli", "cluster", "render", str(path), "--image", "x"],
                         capture_output=True, text=True)
    assert res.returncode == 2
    assert "invalid spec: roles[1].kind: unknown role kind 'gpu'" in res.stderr
