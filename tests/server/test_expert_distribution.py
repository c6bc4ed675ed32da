"""SGLang's expert distribution recorder on bench-moe (8 MoE layers, 32 experts, top-4), over HTTP and the Engine:

- the three routes are admin actions (the API key is not enough);
- a dump before any start is all zeros; between start and stop every forwarded token adds top-k rows to each
  MoE layer, exactly; after stop the counts stay; the dump is what --init-expert-location reads back;
- without --expert-distribution-recorder-mode, or on a dense model, a 400 (InvalidRequest) says why.
"""

from __future__ import annotations

import json

import pytest
import requests

from kvstrata.model.expert_location import ExpertPlacement
from kvstrata.runtime.messages import EXPERT_RECORD_ACTIONS
from kvstrata.runtime.sampling_params import InvalidRequest
from tests.runtime.helpers import make_engine
from tests.server.conftest import API_KEY, ServerHandle, launch_server, stop_server

ADMIN_KEY = "admin-secret"
START, STOP, DUMP = (f"/{action}_expert_distribution_record" for action in EXPERT_RECORD_ACTIONS)
LAYERS, EXPERTS, TOP_K = 8, 32, 4
PROMPT = list(range(100, 112))
NEW_TOKENS = 5
SAMPLING = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
# With the radix cache off a request's forwards take each prompt token once (the prefill, which samples the first
# new token) and each new token but the last (a decode step feeds the token sampled before it): 12 + 5 - 1 = 16
# tokens, each routed to top-k experts in every MoE layer (64 rows per layer, checked empirically).
ROWS_PER_LAYER = (len(PROMPT) + NEW_TOKENS - 1) * TOP_K
RECORDER_FLAGS = ("--model-path", "bench-moe", "--max-total-tokens", "1024", "--disable-radix-cache",
                  "--expert-distribution-recorder-mode", "stat")


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory: pytest.TempPathFactory):
    """bench-moe recording expert loads, with an API key and an admin key."""
    handle = launch_server(tmp_path_factory.mktemp("experts"), *RECORDER_FLAGS, "--admin-api-key", ADMIN_KEY,
                           api_key=API_KEY)
    try:
        yield handle
    finally:
        stop_server(handle)


def as_admin(server: ServerHandle, path: str, method: str = "POST") -> requests.Response:
    """`method` on `path` with the admin key."""
    return requests.request(method, server.url + path, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60)


def generate(server: ServerHandle) -> None:
    """One greedy request of PROMPT for NEW_TOKENS tokens."""
    r = server.post("/generate", json={"input_ids": PROMPT, "sampling_params": SAMPLING})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == NEW_TOKENS, r.text


def assert_counts(dump: dict, rows_per_layer: int) -> None:
    """A [LAYERS][EXPERTS] table of ints whose every layer holds `rows_per_layer` rows."""
    counts = dump["logical_count"]
    assert (dump["num_layers"], dump["num_experts"]) == (LAYERS, EXPERTS)
    assert len(counts) == LAYERS and all(len(row) == EXPERTS for row in counts)
    assert all(isinstance(c, int) and c >= 0 for row in counts for c in row)
    assert [sum(row) for row in counts] == [rows_per_layer] * LAYERS


def test_routes_are_admin_actions(moe_server):
    for path in (START, STOP, DUMP):
        for method in ("GET", "POST"):
            for headers in (moe_server.headers, {}):      # the API key is not the admin key
                r = requests.request(method, moe_server.url + path, headers=headers, timeout=60)
                assert r.status_code == 401 and "admin" in r.json()["error"]["message"], (path, method, r.text)


def test_recording_counts_each_forwarded_token_top_k_times(moe_server):
    before = as_admin(moe_server, DUMP, "GET")
    assert before.status_code == 200 and before.json()["recording"] is False, before.text
    assert_counts(before.json(), 0)                    # a fresh server: nothing started yet

    assert as_admin(moe_server, START).status_code == 200
    generate(moe_server)
    assert as_admin(moe_server, STOP, "GET").status_code == 200
    recorded = as_admin(moe_server, DUMP).json()
    assert recorded["recording"] is False
    assert_counts(recorded, ROWS_PER_LAYER)

    generate(moe_server)                               # stopped: not counted
    assert as_admin(moe_server, DUMP).json() == recorded
    placement = ExpertPlacement.of(json.dumps(recorded), LAYERS, EXPERTS, ep_size=2, redundant=2)
    assert placement.redundant == 2 and len(placement.physical_to_logical) == LAYERS

    assert as_admin(moe_server, START, "GET").status_code == 200     # a new start clears the counts
    cleared = as_admin(moe_server, DUMP).json()
    assert cleared["recording"] is True
    assert_counts(cleared, 0)
    assert as_admin(moe_server, STOP).status_code == 200


def test_without_the_flag_the_routes_say_how_to_record(server):
    for path in (START, STOP, DUMP):
        for method in ("GET", "POST"):       # no admin key set: a loopback caller with the API key may ask
            r = requests.request(method, server.url + path, headers=server.headers, timeout=60)
            assert r.status_code == 400, (path, method, r.text)
            assert "--expert-distribution-recorder-mode stat" in r.json()["error"]["message"]


def test_engine_methods_record_as_the_routes_do():
    engine = make_engine(model_path="bench-moe", dtype="bfloat16", max_total_tokens=1024, disable_radix_cache=True,
                         expert_distribution_recorder_mode="stat")
    try:
        assert_counts(engine.dump_expert_distribution_record(), 0)
        engine.start_expert_distribution_record()
        engine.generate(input_ids=PROMPT, sampling_params=SAMPLING)
        engine.stop_expert_distribution_record()
        engine.generate(input_ids=PROMPT, sampling_params=SAMPLING)
        assert_counts(engine.dump_expert_distribution_record(), ROWS_PER_LAYER)
    finally:
        engine.shutdown()


def test_a_dense_model_refuses_and_an_unknown_action_is_named():
    engine = make_engine(expert_distribution_recorder_mode="stat")
    with pytest.raises(InvalidRequest, match="has no MoE layers"):
        engine.start_expert_distribution_record()
    scheduler = engine.detach_scheduler()
    try:
        out = scheduler.expert_distribution("reset")
        assert not out.success and "'reset'" in out.message and "start" in out.message
    finally:
        scheduler.close()
