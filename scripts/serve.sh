#!/usr/bin/env bash
# One command: install what serving needs, then start the server on the built-in tiny model with all three
# cache tiers: device radix cache (L1), host memory (L2) and local files (L3, under ~/.cache/kvstrata/kv).
# Extra flags are passed to `kvstrata serve` (e.g. --port 30001, or --hicache-storage-backend mooncake).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh serve   # what serving needs: no test tools, no browser
# shellcheck disable=SC1091
. .venv/bin/activate
python -m kvstrata.model.paged_kernels    # build (or find) the CPU attention kernel before the server starts
exec kvstrata serve --model-path tiny --enable-hierarchical-cache --hicache-storage-backend file "$@"
