"""Property-based fuzzing of the whole HTTP API from its own /openapi.json (schemathesis), bounded in
examples and time: no 5xx, no hang, /health answering throughout, page accounting back to its start.

The server runs with a small context (128 tokens) so that any generated request finishes quickly.
"""

from __future__ import annotations

import time

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from kvstrata.runtime.messages import EXPERT_RECORD_ACTIONS
from tests.server.conftest import launch_server, stop_server
from tests.server.helpers import HealthProbe

EXAMPLES_PER_OPERATION = 30
CALL_TIMEOUT_S = 30.0
pytestmark = pytest.mark.timeout(240)      # per test: the fuzzing of one operation in one mode


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    handle = launch_server(tmp_path_factory.mktemp("fuzz"), "--context-length", "128", "--max-running-requests",
                           "16")
    probe = HealthProbe(handle.url).__enter__()
    handle.health_probe = probe
    handle.start_state = handle.wait_idle()
    try:
        yield handle
    finally:
        probe.__exit__()
        stop_server(handle)


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")


# Every operation of /openapi.json (test_every_operation_is_fuzzed keeps this list complete).
OPERATIONS = [
    ("GET", "/health"), ("GET", "/health_generate"), ("GET", "/model_info"), ("GET", "/get_model_info"),
    ("GET", "/server_info"), ("GET", "/get_server_info"), ("GET", "/metrics"), ("GET", "/flush_cache"),
    ("POST", "/flush_cache"), ("POST", "/generate"), ("POST", "/abort_request"),
    ("POST", "/concate_and_append_request"), ("GET", "/v1/models"), ("GET", "/v1/models/{model_id}"),
    ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/load"), ("GET", "/dashboard"),
    ("GET", "/dashboard/data"), ("POST", "/prefetch"),
    *[(method, f"/{action}_expert_distribution_record") for action in EXPERT_RECORD_ACTIONS
      for method in ("GET", "POST")],
]
MODES = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]


def test_every_operation_is_fuzzed(api_schema):
    listed = {(r.ok().method.upper(), r.ok().path) for r in api_schema.get_all_operations()}
    assert listed == set(OPERATIONS)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=lambda x: str(x))
def test_no_request_gets_a_5xx_or_hangs(api_schema, fuzz_server, method, path, mode):
    operation = api_schema[path][method]
    bodies = operation.body if method == "POST" else None
    if mode is schemathesis.GenerationMode.NEGATIVE and not bodies:
        pytest.skip("nothing to negate: no request body (any path string is valid)")

    @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck), derandomize=True, database=None)
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case) -> None:
        started = time.monotonic()
        response = case.call(base_url=fuzz_server.url, timeout=CALL_TIMEOUT_S)
        assert response.status_code < 500, (case.as_curl_command(), response.status_code, response.text[:500])
        assert time.monotonic() - started < CALL_TIMEOUT_S

    fuzz()


def test_health_answered_throughout_and_accounting_is_back(fuzz_server):
    probe = fuzz_server.health_probe
    assert not probe.failures and probe.worst < 2.0, (probe.worst, probe.failures[:5])
    state = fuzz_server.wait_idle(timeout=60)
    assert state["integrity_ok"], state.get("integrity_error")
    assert fuzz_server.post("/flush_cache").status_code == 200
    after = fuzz_server.scheduler_state()
    start = fuzz_server.start_state
    for key in ("running_requests", "waiting_requests"):
        assert after[key] == start[key] == 0
    free = [k for k in after if k.startswith("free_") or k.startswith("available_")]
    assert free and all(after[k] == start[k] for k in free), {k: (start[k], after[k]) for k in free}
