"""`kvstrata cluster up/status/logs/upgrade/down` on a real group: Mooncake master and store, two tiny
workers on L1+L2+L3, the router. The tests share one group and run in order; the last one downs it."""

from __future__ import annotations

import os
import signal
import threading
import time

import requests

from kvstrata.args import ServerArgs
from kvstrata.cluster.spec import parse_spec
from tests.cluster.conftest import TEST_SPEC, pid_alive

ORDER = ["mooncake-master", "mooncake-store", "worker", "router"]


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def router_requests(group, worker_url: str) -> float:
    text = requests.get(group.router_url + "/metrics", timeout=10).text
    series = f'kvstrata_router_requests_total{{worker="{worker_url}"}} '
    return sum(float(line[len(series):]) for line in text.splitlines() if line.startswith(series))


def test_up_starts_every_role_in_dependency_order(group):
    status = group.status()
    assert [r["name"] for r in status["roles"]] == ORDER
    for role in status["roles"]:
        for m in role["members"]:
            assert m["state"] == "ready" and m["healthy"] and m["pid"], m
    log = group.log()
    # each role starts only after every member of the previous role reported ready
    positions = [log.index(f"starting {name} ") for name in ORDER]
    assert positions == sorted(positions)
    for prev, nxt in zip(ORDER, ORDER[1:]):
        for m in next(r for r in status["roles"] if r["name"] == prev)["members"]:
            assert log.index(f"{m['name']} ready") < log.index(f"starting {nxt} ")
    assert group.generate("hello cluster")["meta_info"]["completion_tokens"] == 4


def test_status_and_logs_commands(group):
    out = group.cli("status").stdout
    for name in ("mooncake-master-0", "mooncake-store-0", "worker-0", "worker-1", "router-0"):
        assert name in out
    assert "ready" in out
    logs = group.cli("logs", "worker", "-n", "5").stdout
    assert "worker-0.log" in logs and "worker-1.log" in logs


def test_killed_worker_is_restarted_and_readmitted(group):
    victim = group.member("worker-1")
    url = f"http://127.0.0.1:{victim['ports']['http']}"
    os.kill(victim["pid"], signal.SIGKILL)
    wait_for(lambda: (lambda m: m["restarts"] == 1 and m["state"] == "ready" and m["healthy"]
                      and m["pid"] != victim["pid"])(group.member("worker-1")), 180, "worker-1 restarted")
    assert group.member("worker-1")["ports"] == victim["ports"]          # same identity
    wait_for(lambda: any(w["url"] == url and w["healthy"]
                         for w in requests.get(group.router_url + "/list_workers", timeout=10).json()["workers"]),
             60, "the router to re-admit worker-1")
    before = router_requests(group, url)
    for i in range(6):
        group.generate(f"after the restart {i}")
    assert router_requests(group, url) > before                          # it gets traffic again
    assert "worker-1 exited with code -9; restart #1" in group.log()


def test_store_upgrade_keeps_the_l3_pages(group):
    """The store member is replaced (new process beside the old, objects moved, old stopped); then both
    workers are killed (their L1 and L2 gone, no L2 snapshot written) and a prompt sent before is still
    served from L3."""
    from kvstrata.cluster.store_migration import all_keys

    admin = f"http://127.0.0.1:{group.member('mooncake-master-0')['ports']['metrics']}"
    text = "A conversation the store must keep across its own upgrade. " * 12    # ~320 tokens: 5 groups
    first = group.generate(text)
    group_tokens = ServerArgs().hicache_storage_page_tokens          # one L3 object per page group
    stored = (first["meta_info"]["prompt_tokens"] - 1) // group_tokens * group_tokens
    wait_for(lambda: len(all_keys(admin)) >= stored // group_tokens, 60, "the prompt's groups backed up to L3")
    keys_before = set(all_keys(admin))
    old = group.member("mooncake-store-0")
    res = group.cli("upgrade", "--role", "mooncake-store")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "moving objects from segment" in res.stdout and '"moved": ' in res.stdout, res.stdout
    new = group.member("mooncake-store-0")
    assert new["pid"] != old["pid"] and new["state"] == "ready" and not pid_alive(old["pid"])
    assert keys_before <= set(all_keys(admin))
    victims = {name: group.member(name) for name in ("worker-0", "worker-1")}
    for m in victims.values():
        os.kill(m["pid"], signal.SIGKILL)
    def replaced() -> bool:
        now = {name: group.member(name) for name in victims}
        return all(now[n]["pid"] != m["pid"] and now[n]["state"] == "ready" and now[n]["healthy"]
                   for n, m in victims.items())

    wait_for(replaced, 180, "both workers restarted")
    wait_for(lambda: all(w["healthy"] for w in requests.get(group.router_url + "/list_workers",
                                                            timeout=10).json()["workers"]), 60, "both workers back")
    again = group.generate(text)
    assert again["meta_info"]["cached_tokens"] >= 0.9 * stored, again["meta_info"]


class Load:
    """Multi-turn conversations through the router on threads; records every request's outcome."""

    def __init__(self, url: str, conversations: int = 3):
        self.url = url
        self.records: list[dict] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._converse, args=(c,), daemon=True)
                        for c in range(conversations)]

    def _converse(self, c: int) -> None:
        history = f"Conversation {c} starts with a long shared preamble that each turn repeats. " * 4
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                r = requests.post(self.url + "/generate", timeout=120, json={
                    "text": history, "sampling_params": {"temperature": 0, "max_new_tokens": 8}})
                ok = r.status_code == 200
                meta = r.json()["meta_info"] if ok else {}
                error = None if ok else f"HTTP {r.status_code}: {r.text[:200]}"
            except (requests.RequestException, ValueError) as e:
                ok, meta, error = False, {}, str(e)
            self.records.append({"t": t0, "ok": ok, "error": error, "prompt": meta.get("prompt_tokens", 0),
                                 "cached": meta.get("cached_tokens", 0)})
            if ok:
                history += r.json()["text"] + f" And then turn {len(self.records)}."
            if len(history) > 1200:      # keep prompts inside the tiny pools: start a new conversation
                history = f"Conversation {c} again, round {len(self.records)}: "

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(150)


def hit_rate(records) -> float:
    prompt = sum(r["prompt"] for r in records)
    return sum(r["cached"] for r in records) / prompt if prompt else 0.0


def test_in_place_upgrade_under_load_fails_no_request(group):
    before = {m: group.member(m) for m in ("worker-0", "worker-1")}
    with Load(group.router_url) as load:
        time.sleep(6)
        started = time.monotonic()
        res = group.cli("upgrade", "--role", "worker", "--set", "max-running-requests=64")
        finished = time.monotonic()
        time.sleep(6)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "worker-0: draining" in res.stdout and "worker-1: re-admitted" in res.stdout
    failed = [r for r in load.records if not r["ok"]]
    assert not failed, failed[:3]
    assert len(load.records) > 20 and len([r for r in load.records if r["t"] > finished]) >= 5
    for name, old in before.items():
        new = group.member(name)
        assert new["pid"] != old["pid"] and new["ports"] == old["ports"] and new["state"] == "ready"
        # the worker's own L2 came back from the snapshot its old process wrote when it stopped
        info = requests.get(f"http://127.0.0.1:{new['ports']['http']}/server_info", timeout=10).json()
        loaded = info["internal_states"][0]["hicache"]["snapshot"]["last_load"]
        assert loaded["pages"] > 0 and loaded["skipped_records"] == 0 and not loaded["rejected"], loaded
    # the cache survives: L2 from the snapshot, L3 (the Mooncake store role) for the rest
    steady = [r for r in load.records if r["t"] < started]
    after = [r for r in load.records if r["t"] > finished]
    assert hit_rate(steady) > 0.5
    assert hit_rate(after) >= 0.95 * hit_rate(steady), (hit_rate(steady), hit_rate(after))


def test_upgrade_rejects_a_bad_setting(group):
    res = group.cli("upgrade", "--role", "worker", "--set", "page-size=-1")
    assert res.returncode == 1
    assert "--page-size must be positive" in res.stdout + res.stderr
    res = group.cli("upgrade", "--role", "worker", "--set", "image=kvstrata:2")
    assert res.returncode == 1 and "images are for Kubernetes" in res.stdout + res.stderr
    assert group.member("worker-0")["state"] == "ready"


def test_down_stops_everything_in_reverse_order(group):
    status = group.status()
    pids = {m["pid"] for r in status["roles"] for m in r["members"]} | {status["supervisor_pid"]}
    res = group.cli("down")
    assert res.returncode == 0 and "stopped" in res.stdout
    group.proc.wait(60)
    assert group.proc.returncode == 0
    log = group.log()
    stops = [log.index(f"stopping {name}-0") for name in reversed(ORDER)]
    assert stops == sorted(stops)
    wait_for(lambda: not any(pid_alive(p) for p in pids), 30, "every member process to exit")
    assert not (group.run_dir / "state.json").exists() and not (group.run_dir / "control.sock").exists()
    assert parse_spec(TEST_SPEC).name == "kvt"
