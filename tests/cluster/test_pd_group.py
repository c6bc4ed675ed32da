"""A prefill/decode group run by `kvstrata cluster up`: the router's PD flags are derived from the spec and
a request through it is answered by the pair."""

import requests

from tests.cluster.conftest import RunningGroup, pid_alive

PD_GROUP = """
name: kvpdt
roles:
  - name: prefill
    kind: prefill
    args: {model-path: tiny, max-total-tokens: 1024, log-level: warning}
    resources: {threads: 1}
  - name: decode
    kind: decode
    args: {model-path: tiny, max-total-tokens: 1024, log-level: warning}
    resources: {threads: 1}
  - name: router
    kind: router
    dependencies: [prefill, decode]
    args: {log-level: warning}
"""


def test_pd_group_answers_through_the_router(mooncake_env, tmp_path):
    group = RunningGroup(tmp_path, PD_GROUP)
    try:
        group.start()
        status = group.status()
        prefill = next(r for r in status["roles"] if r["name"] == "prefill")["members"][0]
        decode = next(r for r in status["roles"] if r["name"] == "decode")["members"][0]
        log = group.log()
        assert log.index("starting decode") < log.index("prefill-0 ready")   # independent roles start together
        out = group.generate("Hello from a prefill/decode pair", max_new_tokens=6)
        assert out["meta_info"]["completion_tokens"] == 6
        served = requests.get(f"http://127.0.0.1:{decode['ports']['http']}/server_info", timeout=10).json()
        handoff = served["internal_states"][0]["disaggregation"]
        assert handoff["mode"] == "decode" and handoff["transfers_ok"] >= 1, handoff   # the KV came from the prefill
        assert handoff["rejected_messages_total"] == 0, handoff     # both got the group's generated secret
        pids = [prefill["pid"], decode["pid"]]
        assert group.cli("down").returncode == 0
        group.proc.wait(60)
        assert not any(pid_alive(p) for p in pids)
    finally:
        group.kill_everything()
