"""ServerArgs.resolve in two steps: the HTTP process without torch, the scheduler process with the device."""

from __future__ import annotations

import subprocess
import sys

from kvstrata.args import ServerArgs


def test_resolve_without_device_fills_everything_but_the_device_values():
    args = ServerArgs(model_path="tiny").resolve(with_device=False)
    assert (args.device, args.dtype, args.chunked_prefill_size) == ("auto", "auto", None)
    assert args.tokenizer_path == args.served_model_name == "tiny"
    assert args.random_seed is not None and args.max_running_requests == 256
    full = args.resolve()
    assert full.device in ("cpu", "cuda") and full.dtype != "auto" and full.chunked_prefill_size > 0
    assert full.random_seed == args.random_seed          # the HTTP process's seed is the one the scheduler uses
    assert full.resolve() == full


def test_resolve_without_device_does_not_import_torch():
    code = ("import sys\nfrom kvstrata.args import ServerArgs\nServerArgs(device='cuda').resolve(with_device=False)\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_kv_run_spare_tokens_is_a_flag_and_a_negative_count_is_refused():
    import argparse

    import pytest

    from kvstrata.args import ConfigError, add_dataclass_cli_args, dataclass_from_cli_args

    parser = argparse.ArgumentParser()
    add_dataclass_cli_args(parser, ServerArgs)
    assert dataclass_from_cli_args(ServerArgs, parser.parse_args(["--kv-run-spare-tokens", "0"])).kv_run_spare_tokens == 0
    with pytest.raises(ConfigError, match="--kv-run-spare-tokens must be >= 0"):
        ServerArgs(kv_run_spare_tokens=-1)


# SGLang launch flags users commonly pass, with example values, taken from SGLang's
# python/sglang/srt/server_args.py (2026-12). Each must parse; the ones we cannot honour are refused when
# ServerArgs is built (a ConfigError saying why), never by argparse.
SGLANG_FLAGS: list[list[str]] = [
    ["--model-path", "tiny"], ["--model", "tiny"], ["--tokenizer-path", "tiny"], ["--revision", "main"],
    ["--load-format", "dummy"], ["--load-format", "safetensors"], ["--trust-remote-code"],
    ["--context-length", "2048"], ["--is-embedding"], ["--enable-multimodal"], ["--skip-tokenizer-init"],
    ["--tokenizer-mode", "slow"], ["--tokenizer-worker-num", "2"], ["--model-impl", "sglang"],
    ["--json-model-override-args", '{"rope_scaling": null}'], ["--served-model-name", "my-model"],
    ["--dtype", "half"], ["--dtype", "float"], ["--dtype", "bfloat16"], ["--quantization", "fp8"],
    ["--kv-cache-dtype", "fp8_e5m2"], ["--mem-fraction-static", "0.8"], ["--max-running-requests", "64"],
    ["--max-queued-requests", "128"], ["--max-total-tokens", "8192"], ["--chunked-prefill-size", "4096"],
    ["--max-prefill-tokens", "8192"], ["--schedule-policy", "lpm"], ["--schedule-policy", "lof"],
    ["--schedule-policy", "random"], ["--schedule-policy", "priority"], ["--schedule-policy", "dfs-weight"],
    ["--enable-priority-scheduling"], ["--disable-priority-preemption"], ["--default-priority-value", "5"],
    ["--abort-on-priority-when-disabled"], ["--schedule-low-priority-values-first"],
    ["--priority-scheduling-preemption-threshold", "5"], ["--schedule-conservativeness", "0.5"],
    ["--page-size", "16"], ["--radix-eviction-policy", "slru"], ["--radix-eviction-policy", "priority"],
    ["--disable-radix-cache"], ["--disable-overlap-schedule"], ["--num-continuous-decode-steps", "2"],
    ["--enable-mixed-chunk"], ["--nccl-port", "29500"], ["--dist-timeout", "600"],
    ["--dist-init-addr", "10.0.0.2:25000"], ["--nccl-init-addr", "10.0.0.2:25000"], ["--nnodes", "2"],
    ["--node-rank", "1"], ["--tp-size", "2"], ["--tp", "2"], ["--tensor-parallel-size", "2"],
    ["--pp-size", "2"], ["--dp-size", "2"], ["--dp", "2"], ["--ep-size", "8"], ["--enable-dp-attention"],
    ["--enable-p2p-check"], ["--device", "cpu"], ["--base-gpu-id", "0"], ["--gpu-id-step", "2"],
    ["--random-seed", "42"], ["--watchdog-timeout", "600"], ["--sleep-on-idle"], ["--host", "0.0.0.0"],
    ["--port", "30001"], ["--skip-server-warmup"], ["--api-key", "k"], ["--admin-api-key", "a"],
    ["--chat-template", "chatml"], ["--enable-cache-report"], ["--reasoning-parser", "qwen3"],
    ["--tool-call-parser", "qwen25"], ["--stream-interval", "4"], ["--log-level", "warning"],
    ["--log-level-http", "warning"], ["--log-requests"], ["--log-requests-level", "2"], ["--show-time-cost"],
    ["--enable-metrics"], ["--decode-log-interval", "40"], ["--constrained-json-whitespace-pattern", "[ ]*"],
    ["--constrained-json-disable-any-whitespace"], ["--attention-backend", "flashinfer"],
    ["--decode-attention-backend", "triton"], ["--prefill-attention-backend", "fa3"],
    ["--sampling-backend", "pytorch"], ["--grammar-backend", "xgrammar"], ["--grammar-backend", "outlines"],
    ["--disable-cuda-graph"], ["--cuda-graph-max-bs", "160"], ["--cuda-graph-bs", "1", "2", "4"],
    ["--disable-cuda-graph-padding"], ["--enable-nccl-nvls"], ["--enable-torch-compile"],
    ["--disable-custom-all-reduce"], ["--triton-attention-reduce-in-fp32"], ["--cpu-offload-gb", "8"],
    ["--enable-lora"], ["--lora-paths", "a=/x", "b=/y"], ["--enable-lmcache"],
    ["--speculative-algorithm", "EAGLE"], ["--speculative-draft-model-path", "/d"],
    ["--speculative-num-steps", "3"], ["--speculative-eagle-topk", "1"], ["--speculative-num-draft-tokens", "4"],
    ["--moe-runner-backend", "triton"], ["--moe-a2a-backend", "deepep"], ["--enable-eplb"],
    ["--enable-hierarchical-cache"], ["--hicache-ratio", "2"], ["--hicache-size", "0"],
    ["--hicache-write-policy", "write_through_selective"], ["--hicache-io-backend", "direct"],
    ["--hicache-mem-layout", "page_first"], ["--hicache-mem-layout", "page_first_direct"],
    ["--hicache-storage-backend", "file"], ["--hicache-storage-backend", "hf3fs"],
    ["--hicache-storage-prefetch-policy", "timeout"], ["--hicache-storage-backend-extra-config", "{}"],
    ["--disaggregation-mode", "prefill"], ["--disaggregation-transfer-backend", "mooncake"],
    ["--disaggregation-bootstrap-port", "8998"], ["--disaggregation-ib-device", "mlx5_0"],
]


def _sglang_parser():
    import argparse

    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return parser


def test_every_common_sglang_flag_parses_and_is_implemented_ignored_or_refused_with_a_reason():
    import pytest

    from kvstrata.args import ConfigError

    parser = _sglang_parser()
    refused = []
    for flags in SGLANG_FLAGS:
        ns = parser.parse_args(flags)          # argparse.ArgumentError here is the defect this test catches
        try:
            ServerArgs.from_cli_args(ns)
        except ConfigError as e:
            refused.append((flags[0], str(e)))
    by_flag = dict(refused)
    assert set(by_flag) == {
        "--is-embedding", "--enable-multimodal", "--skip-tokenizer-init", "--json-model-override-args",
        "--schedule-policy", "--nnodes", "--node-rank", "--pp-size", "--dp-size", "--dp", "--ep-size", "--enable-dp-attention",
        "--grammar-backend", "--cpu-offload-gb", "--enable-lora", "--lora-paths", "--enable-lmcache",
        "--speculative-algorithm", "--speculative-draft-model-path", "--speculative-num-steps",
        "--speculative-eagle-topk", "--speculative-num-draft-tokens", "--moe-runner-backend", "--moe-a2a-backend",
        "--enable-eplb", "--hicache-mem-layout", "--hicache-storage-backend"}, by_flag
    assert "--nnodes > 1 needs --dist-init-addr" in by_flag["--nnodes"]
    assert "--node-rank must be in 0..0" in by_flag["--node-rank"]
    assert "--ep-size 8 must be 1 or --tp-size (1)" in by_flag["--ep-size"]
    # --quantization fp8 is a real choice now, checked against the checkpoint at resolve() (tests/model/test_quant_load.py)
    assert ServerArgs.from_cli_args(parser.parse_args(["--kv-cache-dtype", "fp8_e4m3"])).kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ConfigError, match=r"--kv-cache-dtype must be one of \['auto', 'fp8_e4m3', 'fp8_e5m2'\]"):
        ServerArgs(kv_cache_dtype="fp4_e2m1")
    assert "--schedule-policy must be one of" in by_flag["--schedule-policy"]      # dfs-weight
    assert "--hicache-storage-backend must be one of ['file', 'mooncake'], got 'hf3fs'" in by_flag[
        "--hicache-storage-backend"]
    with pytest.raises(ConfigError, match="--load-format gguf needs a .gguf file"):
        ServerArgs(load_format="gguf")


def test_sglang_flags_with_no_effect_are_logged_and_aliases_land_on_their_field():
    parser = _sglang_parser()
    args = ServerArgs.from_cli_args(parser.parse_args(
        ["--model", "bench", "--disable-cuda-graph", "--hicache-io-backend", "direct", "--nccl-init-addr", "h:1",
         "--dtype", "half"]))
    assert args.model_path == "bench" and args.dist_init_addr == "h:1"
    notes = "\n".join(args.no_effect_notes())
    assert "--disable-cuda-graph has no effect" in notes and "--hicache-io-backend has no effect" in notes
    assert "--dist-init-addr" not in notes     # the ranks meet there (--tp-size)
    assert args.resolve(with_device=False).dtype == "float16"


def test_serve_help_groups_the_flags_like_sglang():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "kvstrata.launch_server", "--help"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    for heading in ("Model and tokenizer:", "HTTP server:", "Memory and scheduling:",
                    "Hierarchical cache: host tier (L2):", "SGLang settings with no effect here"):
        assert heading in out
    body = out[out.index("Model and tokenizer:"):]            # after the usage line
    assert body.index("--revision") < body.index("HTTP server:") < body.index("--stream-interval")
