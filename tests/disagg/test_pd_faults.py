"""PD faults and bad input: bad/duplicate/unknown rooms, a prefill killed mid-transfer, a decode that never
asks; after each case both sides' accounting is back where it started (check_integrity, free pages)."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvstrata.bench.launcher import ServerProcess, free_port
from kvstrata.disagg.prefill import FAULT_DELAY_ENV
from tests.disagg.conftest import TIMEOUT_S, generate, greedy, pd_flags, state, wait_for, wait_idle


def boot(pd, room, port=None) -> dict:
    return {"bootstrap_host": "127.0.0.1", "bootstrap_port": port or pd.bootstrap_port, "bootstrap_room": room}


@pytest.mark.parametrize("fields, message", [
    ({"bootstrap_room": "x"}, "bootstrap_room"),
    ({"bootstrap_room": -1}, "bootstrap_room"),
    ({"bootstrap_port": 70000}, "bootstrap_port"),
    ({"bootstrap_host": ""}, "bootstrap_host"),
    ({"bootstrap_host": None}, "missing bootstrap_host"),
    ({"bootstrap_room": [1, 2]}, "batch"),
])
def test_malformed_bootstrap_fields_are_400(pd, fields, message):
    body = {**greedy("bad room"), **boot(pd, 1), **fields}
    body = {k: v for k, v in body.items() if v is not None}
    for url in (pd.prefill.url, pd.decode.url):
        r = generate(url, body)
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


def test_bootstrap_on_a_colocated_server_or_with_n_is_400(pd):
    r = generate(pd.colocated.url, {**greedy("x"), **boot(pd, 5)})
    assert r.status_code == 400 and "disaggregation-mode null" in r.text
    body = {**greedy("x"), **boot(pd, 6)}
    body["sampling_params"]["n"] = 2
    assert generate(pd.decode.url, body).status_code == 400


def test_duplicate_room_is_400_on_either_side(pd):
    with ThreadPoolExecutor(2) as pool:
        for first, second in ((pd.decode.url, pd.prefill.url), (pd.prefill.url, pd.decode.url)):
            room = time.monotonic_ns()
            body = {**greedy("duplicate room", 5), **boot(pd, room)}
            pending = pool.submit(generate, first, body)
            wait_for(lambda url=first: _room_open(url), what="the first request's room")
            dup = generate(first, body)
            assert dup.status_code == 400 and "already in use" in dup.json()["error"]["message"], dup.text
            assert generate(second, body).status_code == 200    # the first request's counterpart completes it
            assert pending.result().status_code == 200
    for url in (pd.prefill.url, pd.decode.url):
        assert wait_idle(url)["integrity_ok"]


def _room_open(url: str) -> bool:
    d = state(url)["disaggregation"]
    return d.get("rooms_open", 0) + d.get("bootstrap_queue", 0) + d.get("transfers_in_flight", 0) > 0


def test_unknown_room_and_missing_decode_time_out_and_free(pd):
    free = {url: wait_idle(url)["free_pages"] for url in (pd.prefill.url, pd.decode.url)}
    start = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        # The decode asks for a room the prefill never gets; the prefill gets a room no decode asks for.
        on_decode = pool.submit(generate, pd.decode.url, {**greedy("nobody prefills me"), **boot(pd, 11)})
        on_prefill = pool.submit(generate, pd.prefill.url, {**greedy("nobody decodes me"), **boot(pd, 12)})
        d, p = on_decode.result(), on_prefill.result()
    assert time.monotonic() - start < TIMEOUT_S + 10
    assert d.status_code == 400 and "unknown to this prefill server" in d.json()["error"]["message"], d.text
    assert p.status_code == 504 and "timed out" in p.json()["error"]["message"], p.text
    for url in (pd.prefill.url, pd.decode.url):
        s = wait_idle(url)
        assert s["integrity_ok"], s
        assert s["free_pages"] + s["evictable_tokens"] // s["page_size"] >= free[url]


def test_prefill_killed_during_transfer(pd, tmp_path):
    """The decode frees its reserved slots and fails the request within its timeout."""
    port = free_port()
    prefill = ServerProcess(pd_flags("prefill", port), str(tmp_path / "doomed-prefill.log"),
                            env={FAULT_DELAY_ENV: "30"})
    decode_before = wait_idle(pd.decode.url)
    with prefill, ThreadPoolExecutor(2) as pool:
        body = {**greedy("killed mid-transfer " * 6, 8), **boot(pd, 21, port)}
        on_decode = pool.submit(generate, pd.decode.url, body)
        pool.submit(generate, prefill.url, body)
        wait_for(lambda: state(prefill.url)["disaggregation"]["transfers_in_flight"] == 1, what="write in flight")
        assert state(pd.decode.url)["disaggregation"]["transfers_in_flight"] == 1
        killed_at = time.monotonic()
        os.killpg(prefill.proc.pid, signal.SIGKILL)
        r = on_decode.result()
    assert time.monotonic() - killed_at < TIMEOUT_S + 5
    assert r.status_code == 504 and "timed out" in r.json()["error"]["message"], r.text
    after = wait_idle(pd.decode.url)
    assert after["integrity_ok"], after
    assert after["free_pages"] == decode_before["free_pages"]
    assert after["disaggregation"]["timeouts"] == decode_before["disaggregation"]["timeouts"] + 1
    assert generate(pd.router.url, greedy("still serving", 4)).status_code == 200
