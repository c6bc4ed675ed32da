"""SGLang launch flags: each is listed by --help, starts the server (meaningful or no-op, logged once),
or stops the start with a clear error naming the flag (a value we cannot honour)."""

from __future__ import annotations

import pytest

from kvstrata.server.launch import main
from tests.server.conftest import launch_server, stop_server

# SGLang flags a Llama/Qwen launch line commonly carries, with a value each.
ACCEPTED = [
    ["--enable-metrics"], ["--tp", "1"], ["--tp-size", "1"], ["--dp-size", "1"], ["--trust-remote-code"],
    ["--disable-cuda-graph"], ["--chat-template", "chatml"], ["--attention-backend", "triton"],
    ["--log-requests"], ["--log-requests-level", "2"], ["--tool-call-parser", "qwen25"],
    ["--reasoning-parser", "qwen3"], ["--context-length", "2048"], ["--enable-cache-report"],
    ["--show-time-cost"], ["--mem-fraction-static", "0.2"], ["--cuda-graph-max-bs", "8"],
    ["--sampling-backend", "pytorch"], ["--disable-overlap-schedule"], ["--enable-torch-compile"],
    ["--enable-mixed-chunk"], ["--skip-server-warmup"], ["--kv-cache-dtype", "auto"],
    ["--constrained-json-whitespace-pattern", r"[\n\t ]{0,2}"], ["--watchdog-timeout", "300"],
]
NO_EFFECT = ["--trust-remote-code", "--disable-cuda-graph", "--attention-backend", "--enable-cache-report",
             "--show-time-cost", "--cuda-graph-max-bs", "--sampling-backend", "--disable-overlap-schedule",
             "--enable-torch-compile", "--enable-mixed-chunk", "--skip-server-warmup", "--watchdog-timeout"]


def test_help_lists_every_sglang_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in {f[0] for f in ACCEPTED} | {"--tensor-parallel-size", "--no-enable-metrics", "--pp-size",
                                           "--ep-size", "--nnodes", "--quantization", "--lora-paths"}:
        assert flag in out, flag


@pytest.mark.parametrize("argv,named", [
    (["--tp", "2"], "--tp-size 2 cannot be honoured: tensor parallelism"),
    (["--tensor-parallel-size", "4"], "--tp-size 4"),
    (["--dp", "2"], "--dp-size 2"),
    (["--pp-size", "2"], "--pp-size 2"),
    (["--nnodes", "2"], "--nnodes 2"),
    (["--enable-dp-attention"], "--enable-dp-attention"),
    (["--speculative-algorithm", "EAGLE"], "--speculative-algorithm EAGLE"),
    (["--quantization", "fp8"], "--quantization fp8"),
    (["--kv-cache-dtype", "fp8_e5m2"], "--kv-cache-dtype fp8_e5m2"),
    (["--chat-template", "no-such-template"], "--chat-template 'no-such-template' is neither a file"),
    (["--tool-call-parser", "no-such-parser"], "--tool-call-parser"),
    (["--constrained-json-whitespace-pattern", "("], "--constrained-json-whitespace-pattern"),
])
def test_values_we_cannot_honour_stop_the_start_with_a_clear_error(capsys, argv, named):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert named in err and "unrecognized arguments" not in err


def test_server_starts_with_all_accepted_flags_and_logs_each_no_op_once(tmp_path):
    flags = [arg for f in ACCEPTED for arg in f]
    handle = launch_server(tmp_path, *flags)
    try:
        r = handle.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert handle.get("/metrics").status_code == 200
        log = handle.log()
        for flag in NO_EFFECT:
            assert log.count(f"{flag} has no effect on kvstrata") == 1, flag
        assert "request finished: rid=" in log       # --log-requests
    finally:
        stop_server(handle)


def test_metrics_can_be_turned_off(tmp_path):
    handle = launch_server(tmp_path, "--no-enable-metrics")
    try:
        assert handle.get("/metrics").status_code == 404
    finally:
        stop_server(handle)
