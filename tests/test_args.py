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
