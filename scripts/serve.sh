#!/usr/bin/env bash
# One command: install everything, then start the server on the built-in tiny model.
# Extra flags are passed to `kvstrata serve` (e.g. --port 30001).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# shellcheck disable=SC1091
. .venv/bin/activate
exec kvstrata serve --model-path tiny "$@"
