"""The scheduler process keeps transformers' model-config imports out: once the server has recorded transformers'
tokenizer fingerprint (server/launch.py), a Scheduler on a generic tokenizer folder holds a LightTokenizer, and
neither it nor the model load imports sympy (~32 MB of RSS) or transformers' config classes (issue 47)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.server.conftest import REPO_ROOT, server_env

SCRIPT = """
import sys
from kvstrata.args import ServerArgs
from kvstrata.runtime.scheduler import Scheduler
from kvstrata.server.launch import prepare_model_folders

args = ServerArgs(model_path="tiny", max_total_tokens=1024)
prepare_model_folders(args)          # a child process records transformers' fingerprint if none is yet
scheduler = Scheduler(args.resolve())
heavy = ("sympy", "transformers.activations", "transformers.models.llama.configuration_llama")
print(type(scheduler.tokenizer).__name__, [m for m in heavy if m in sys.modules])
"""


def test_the_scheduler_uses_the_light_tokenizer_without_transformers_config_classes():
    env = {**os.environ, **server_env()}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "LightTokenizer []", out.stdout + out.stderr[-3000:]
