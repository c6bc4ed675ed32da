"""`kvstrata bench multiturn` and `kvstrata bench compare` end to end against real servers (tiny model)."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvstrata.bench import compare, multiturn
from kvstrata.bench.launcher import ServerProcess
from kvstrata.bench.runner import MultiTurnRunner, RunConfig
from kvstrata.bench.workload import Conversation

SERVER_FLAGS = ["--model-path", "tiny", "--max-total-tokens", "4096", "--random-seed", "0",
                "--log-level", "warning"]
ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    """A tiny-model server, stopped by PID at the end."""
    proc = ServerProcess(SERVER_FLAGS, str(tmp_path_factory.mktemp("bench") / "server.log"), env=ENV)
    with proc.start(timeout_s=300):
        yield proc


def run_two_rounds(server: ServerProcess, tmp_path, *flags: str) -> dict:
    """2 clients x 2 rounds of 24-token questions and 3-token answers, round barrier; the logged result."""
    log = tmp_path / "results.jsonl"
    rc = multiturn.main(["--port", str(server.port), "--model-path", "tiny", "--num-clients", "2",
                         "--num-rounds", "2", "--request-length", "24", "--output-length", "3",
                         "--max-parallel", "2", "--request-rate", "inf", "--enable-round-barrier",
                         "--log-file", str(log), "--no-progress", *flags])
    assert rc == 0
    return json.loads(log.read_text().splitlines()[-1])


def test_multiturn_cli_reports_hits_from_round_two(server: ServerProcess, tmp_path):
    result = run_two_rounds(server, tmp_path)
    s = result["summary"]
    for key in ("cache_hit_rate", "ideal_hit_rate", "hit_rate_vs_ideal", "mean_ttft", "p50_ttft", "p90_ttft",
                "p99_ttft", "input_throughput", "duration_s", "failed", "skipped"):
        assert key in s, key
    assert (s["completed"], s["failed"], s["skipped"]) == (4, 0, 0)
    assert s["prompt_tokens"] == 2 * 24 + 2 * (24 + 3 + 24)
    rounds = {r["round"]: r for r in result["rounds"]}
    assert rounds[0]["cache_hit_rate"] == 0.0
    assert rounds[1]["cache_hit_rate"] > 0
    # Round 2 re-sends round 1's prompt and output: the ideal is 24 + 2 of its 51 tokens.
    assert rounds[1]["ideal_hit_rate"] == pytest.approx(26 / 51)
    assert 0.9 <= s["hit_rate_vs_ideal"] <= 1.0
    assert s["mean_ttft"] > 0 and s["input_throughput"] > 0
    assert "cache_hit_rate" in result["tiers"]


def test_multiturn_over_v1_completions_resends_the_generated_ids(server: ServerProcess, tmp_path):
    result = run_two_rounds(server, tmp_path, "--api", "completions")
    s = result["summary"]
    assert result["workload"]["api"] == "completions"
    assert (s["completed"], s["failed"], s["output_tokens"]) == (4, 0, 4 * 3)
    assert s["prompt_tokens"] == 2 * 24 + 2 * (24 + 3 + 24)
    # The next prompt carries the exact generated ids, so the server finds all of what the ideal counts.
    assert s["cached_tokens"] == s["ideal_cached_tokens"] == 2 * (24 + 2)


def test_sharegpt_prompts_are_cut_to_the_requested_length(server: ServerProcess, tmp_path):
    dataset = tmp_path / "sharegpt.json"
    turns = [{"from": "human", "value": "Tell me about caches."}, {"from": "gpt", "value": "Sure."}]
    long_turn = [{"from": "human", "value": "radix " * 200}, {"from": "gpt", "value": "ok"}]
    dataset.write_text(json.dumps([{"conversations": turns}, {"conversations": long_turn},
                                   {"conversations": turns[:1]}]))
    log = tmp_path / "results.jsonl"
    rc = multiturn.main(["--port", str(server.port), "--model-path", "tiny", "--dataset-path", str(dataset),
                         "--num-clients", "2", "--num-rounds", "2", "--request-length", "30",
                         "--output-length", "2", "--request-rate", "inf", "--log-file", str(log),
                         "--no-progress"])
    assert rc == 0
    result = json.loads(log.read_text())
    assert result["workload"]["source"].startswith("ShareGPT") and "2 conversations" in result["workload"]["source"]
    assert result["summary"]["completed"] == 4
    assert result["summary"]["prompt_tokens"] == 2 * 30 + 2 * (30 + 2 + 30)


def test_a_request_the_server_rejects_is_counted_and_the_round_completes(server: ServerProcess):
    out_of_vocab = 5000   # the tiny model's vocabulary has 1024 tokens: the server answers 400
    convs = [Conversation(0, list(range(100, 120)), [list(range(200, 210))]),
             Conversation(1, list(range(300, 320)), [[out_of_vocab] * 4])]
    cfg = RunConfig(output_length=2, max_parallel=2, request_rate=float("inf"), enable_round_barrier=True,
                    request_timeout_s=120, progress=False)
    outcome = asyncio.run(MultiTurnRunner(server.url + "/generate", convs, cfg).run())
    status = sorted((r.client, r.round, r.ok) for r in outcome.records)
    assert status == [(0, 0, True), (0, 1, True), (1, 0, True), (1, 1, False)]
    failed = next(r for r in outcome.records if not r.ok)
    assert failed.error.startswith("HTTP 400")
    ok_round1 = next(r for r in outcome.records if r.client == 0 and r.round == 1)
    assert ok_round1.cached_tokens > 0


def test_compare_writes_the_table_and_chart(tmp_path, monkeypatch):
    out = tmp_path / "cmp"
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)      # inherited by the server compare launches
    rc = compare.main(["--model-path", "tiny", "--configs", "l1", "--num-clients", "2", "--num-rounds", "2",
                       "--request-length", "16", "--output-length", "2", "--device-tokens", "1024",
                       "--page-size", "4", "--out-dir", str(out), "--no-progress", "--log-level", "warning"])
    assert rc == 0
    md = (out / "compare.md").read_text()
    assert "| Config | KV cache hit rate |" in md and "L1 only (device)" in md
    assert "Command: `kvstrata bench compare" in md
    assert (out / "compare.png").stat().st_size > 1000
    row = json.loads((out / "compare.jsonl").read_text().splitlines()[-1])
    assert row["summary"]["completed"] == 4 and row["server_exit_code"] == 0


def test_runner_asks_url_for_each_request_and_calls_before_send_first(server: ServerProcess):
    convs = [Conversation(0, list(range(100, 120)), [list(range(200, 210))]),
             Conversation(1, list(range(300, 320)), [list(range(400, 410))])]
    cfg = RunConfig(output_length=2, max_parallel=2, request_rate=float("inf"), request_timeout_s=120, progress=False)
    routed, seen = [], []

    def url_for(client: int, rnd: int) -> str:
        routed.append((client, rnd))
        return server.url + "/generate"

    def before_send(rec) -> None:
        assert rec.ttft is None and not rec.output_ids      # not sent yet
        seen.append((rec.client, rec.round, len(rec.prompt_ids)))

    runner = MultiTurnRunner("http://127.0.0.1:1/nowhere", convs, cfg, url_for=url_for, before_send=before_send)
    outcome = asyncio.run(runner.run())
    assert all(r.ok for r in outcome.records) and len(outcome.records) == 4
    assert sorted(routed) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert sorted(seen) == [(0, 0, 20), (0, 1, 32), (1, 0, 20), (1, 1, 32)]
