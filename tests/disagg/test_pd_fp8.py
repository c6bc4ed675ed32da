"""PD disaggregation with FP8 KV (--kv-cache-dtype fp8_e4m3): the prefill writes FP8 bytes into the decode's
FP8 pool, and greedy output through the pair equals a co-located FP8 server's; a decode whose KV dtype
differs is refused with an error naming both dtypes, never served from bytes it would misread."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from kvstrata.bench.launcher import ServerProcess, free_port
from tests.disagg.conftest import (
    ROUTER_FLAGS,
    SECRET,
    SERVER_FLAGS,
    generate,
    greedy,
    pd_flags,
    wait_for,
    wait_idle,
)

FP8 = ["--kv-cache-dtype", "fp8_e4m3"]
PROMPTS = ["FP8 keys and values", "FP8 keys and values cross the wire", "A different opening entirely"]


@pytest.fixture(scope="module")
def fp8_pd(mooncake_env, tmp_path_factory):
    """An FP8 prefill serving an FP8 decode and a float32-KV decode (one router each), and an FP8 co-located
    reference."""
    logs = tmp_path_factory.mktemp("pd-fp8")
    bootstrap = free_port()
    prefill = ServerProcess([*pd_flags("prefill", bootstrap, SECRET), *FP8], str(logs / "prefill.log"))
    decode = ServerProcess([*pd_flags("decode", secret=SECRET), *FP8], str(logs / "decode.log"))
    other = ServerProcess(pd_flags("decode", secret=SECRET), str(logs / "decode-auto.log"))
    colocated = ServerProcess([*SERVER_FLAGS, *FP8], str(logs / "colocated.log"))
    routers = [ServerProcess(["--pd-disaggregation", "--prefill", prefill.url, str(bootstrap), "--decode", d.url,
                              *ROUTER_FLAGS], str(logs / f"router-{i}.log"), module="kvstrata.router")
               for i, d in enumerate((decode, other))]
    servers = [prefill, decode, other, colocated]
    try:
        with ThreadPoolExecutor(len(servers)) as pool:
            list(pool.map(lambda p: p.start(), servers))
        for router in routers:
            router.start()
        wait_for(lambda: generate(routers[0].url, greedy("warm", 1)).status_code == 200, what="router ready")
        yield prefill, decode, colocated, routers
    finally:
        for p in (*routers, *servers):
            p.stop()


def test_fp8_greedy_through_pd_matches_colocated(fp8_pd):
    prefill, decode, colocated, (router, _) = fp8_pd
    for prompt in PROMPTS:
        via_pd = generate(router.url, greedy(prompt, max_new_tokens=8))
        alone = generate(colocated.url, greedy(prompt, max_new_tokens=8))
        assert via_pd.status_code == 200, via_pd.text
        assert via_pd.json()["output_ids"] == alone.json()["output_ids"], prompt
    for url in (prefill.url, decode.url):
        state = wait_idle(url)
        assert state["integrity_ok"] and state["kv_cache"]["dtype"] == "float8_e4m3fn"


def test_a_decode_with_another_kv_dtype_gets_a_clear_error(fp8_pd):
    prefill, _, _, (_, mismatched) = fp8_pd
    answer = generate(mismatched.url, greedy(PROMPTS[0], max_new_tokens=4))
    assert 400 <= answer.status_code < 500, answer.text
    assert "KV cache dtypes differ" in answer.text and "float8_e4m3fn" in answer.text and "float32" in answer.text
    assert wait_idle(prefill.url)["integrity_ok"]
