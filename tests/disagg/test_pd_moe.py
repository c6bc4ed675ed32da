"""PD disaggregation and the PD router serve an MoE model (a tiny Qwen3-MoE): greedy output through a
prefill + decode pair equals a co-located server's, and both sides end with their accounting intact."""

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
from tests.model.hf_ckpt import write_servable_moe_checkpoint

PROMPTS = ["Mixture of experts", "Mixture of experts route each token", "A different opening entirely"]


@pytest.fixture(scope="module")
def moe_pd(mooncake_env, tmp_path_factory):
    """Prefill + decode + PD router + a co-located reference, all on the same tiny MoE checkpoint."""
    logs = tmp_path_factory.mktemp("pd-moe")
    model = ["--model-path", write_servable_moe_checkpoint(str(tmp_path_factory.mktemp("tiny-moe")))]
    bootstrap = free_port()
    prefill = ServerProcess([*pd_flags("prefill", bootstrap, SECRET), *model], str(logs / "prefill.log"))
    decode = ServerProcess([*pd_flags("decode", secret=SECRET), *model], str(logs / "decode.log"))
    colocated = ServerProcess([*SERVER_FLAGS, *model], str(logs / "colocated.log"))
    router = ServerProcess(["--pd-disaggregation", "--prefill", prefill.url, str(bootstrap), "--decode", decode.url,
                            *ROUTER_FLAGS], str(logs / "router.log"), module="kvstrata.router")
    servers = [prefill, decode, colocated]
    try:
        with ThreadPoolExecutor(len(servers)) as pool:
            list(pool.map(lambda p: p.start(), servers))
        router.start()
        wait_for(lambda: generate(router.url, greedy("warm", 1)).status_code == 200, what="router ready")
        yield prefill, decode, colocated, router
    finally:
        for p in (router, *servers):
            p.stop()


def test_moe_greedy_through_pd_matches_colocated(moe_pd):
    prefill, decode, colocated, router = moe_pd
    for prompt in PROMPTS:
        via_pd = generate(router.url, greedy(prompt, max_new_tokens=8))
        alone = generate(colocated.url, greedy(prompt, max_new_tokens=8))
        assert via_pd.status_code == 200, via_pd.text
        assert via_pd.json()["output_ids"] == alone.json()["output_ids"], prompt
        assert via_pd.json()["meta_info"]["completion_tokens"] == 8
    for url in (prefill.url, decode.url):
        assert wait_idle(url)["integrity_ok"]
