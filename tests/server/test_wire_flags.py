"""SGLang launch flags: each is listed by --help, starts the server (meaningful or no-op, logged once),
or stops the start with a clear error naming the flag (a value we cannot honour)."""

from __future__ import annotations

import json

import pytest

from kvstrata.server.launch import main
from kvstrata.server.reasoning import ReasoningStreamer, split_reasoning
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
             "--enable-torch-compile", "--enable-mixed-chunk", "--skip-server-warmup"]


def test_help_lists_every_sglang_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in {f[0] for f in ACCEPTED} | {"--tensor-parallel-size", "--no-enable-metrics", "--pp-size",
                                           "--ep-size", "--nnodes", "--quantization", "--lora-paths"}:
        assert flag in out, flag


@pytest.mark.parametrize("argv,named", [
    (["--tensor-parallel-size", "4", "--nnodes", "2", "--dist-init-addr", "h:1", "--disaggregation-mode", "prefill"],
     "--tp-size 4 with --disaggregation-mode prefill and --nnodes 2"),
    (["--tp", "3", "--nnodes", "2", "--dist-init-addr", "h:1"], "--tp-size 3 must be a multiple of --nnodes 2"),
    (["--dp", "2"], "--dp-size 2"),
    (["--pp-size", "2"], "--pp-size 2"),
    (["--nnodes", "2"], "--nnodes > 1 needs --dist-init-addr"),
    (["--ep-size", "2"], "--ep-size 2 must be 1 or --tp-size (1)"),
    (["--ep-num-redundant-experts", "2"], "with --ep-size 1 there is nothing to place"),
    (["--init-expert-location", "loads.json"], "with --ep-size 1 there is nothing to place"),
    (["--tp", "2", "--ep-size", "2", "--ep-num-redundant-experts", "-1"], "--ep-num-redundant-experts must be 0"),
    (["--expert-distribution-recorder-mode", "per_token"], "--expert-distribution-recorder-mode"),
    (["--enable-dp-attention"], "--enable-dp-attention"),
    (["--speculative-algorithm", "EAGLE"], "--speculative-algorithm EAGLE"),
    (["--quantization", "fp8"], "--quantization fp8"),
    (["--kv-cache-dtype", "fp4_e2m1"], "--kv-cache-dtype"),
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


TEMPLATE_WITH_VARIABLE = (
    "{% if greeting is defined %}{{ greeting }}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_chat_template_flag_values(tmp_path):
    from kvstrata.model.chat_template_flag import ChatTemplateNotFound, resolve_chat_template
    from kvstrata.model.chat_templates import CHATML_TEMPLATE

    assert resolve_chat_template("chatml") == CHATML_TEMPLATE
    (tmp_path / "t.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert resolve_chat_template(str(tmp_path / "t.json")) == "{{ messages }}"
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(ChatTemplateNotFound, match="chat_template"):
        resolve_chat_template(str(tmp_path / "bad.json"))


def test_server_starts_with_all_accepted_flags_and_logs_each_no_op_once(tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE_WITH_VARIABLE)
    flags = [arg for f in ACCEPTED for arg in f]
    flags[flags.index("chatml")] = str(template)          # --chat-template FILE
    handle = launch_server(tmp_path, *flags)
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = handle.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        greeted = handle.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {
            "greeting": "Hello there, dear friend"}})
        assert greeted.json()["usage"]["prompt_tokens"] > r.json()["usage"]["prompt_tokens"] + 3
        assert handle.get("/metrics").status_code == 200
        log = handle.log()
        for flag in NO_EFFECT:
            assert log.count(f"{flag} has no effect on kvstrata") == 1, flag
        assert "request finished: rid=" in log       # --log-requests
        check_reasoning_is_separated(handle)          # --reasoning-parser qwen3
    finally:
        stop_server(handle)


def test_metrics_can_be_turned_off(tmp_path):
    handle = launch_server(tmp_path, "--no-enable-metrics")
    try:
        assert handle.get("/metrics").status_code == 404
    finally:
        stop_server(handle)


def check_reasoning_is_separated(handle):
    """A reply forced (by a regex) to think first comes back split, whole and streamed."""
    body = {"messages": [{"role": "user", "content": "hi"}], "regex": "<think>Let me see\\.</think>\\nDone\\.",
            "max_tokens": 60, "temperature": 0}
    message = handle.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Let me see.", "Done.")
    r = handle.post("/v1/chat/completions", json={**body, "stream": True})
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.text.splitlines()
              if line.startswith("data: {")]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Let me see."
    assert "".join(d.get("content") or "" for d in deltas) == "Done."


@pytest.mark.parametrize("name,reply,expected", [
    ("qwen3", "<think>plan</think>\nanswer", ("plan", "answer")),
    ("qwen3", "no thinking here", ("", "no thinking here")),
    ("qwen3", "<think>cut short", ("cut short", "")),
    ("deepseek-r1", "plan</think>answer", ("plan", "answer")),
])
def test_reasoning_split_at_any_chunking(name, reply, expected):
    assert split_reasoning(name, reply) == expected
    for step in (1, 3):
        streamer, got = ReasoningStreamer(name), ["", ""]
        for i in range(0, len(reply), step):
            for k, part in enumerate(streamer.feed(reply[i:i + step])):
                got[k] += part
        for k, part in enumerate(streamer.finish()):
            got[k] += part
        assert tuple(got) == expected
