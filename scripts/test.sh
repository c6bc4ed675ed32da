#!/usr/bin/env bash
# One command: install everything, then run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test   # everything the suite needs, chromium and the test tools included
# shellcheck disable=SC1091
. .venv/bin/activate
export KVSTRATA_CACHE_DIR=${KVSTRATA_CACHE_DIR:-$PWD/.cache/kvstrata}
# The Mooncake tests must run, not skip, once install.sh has installed its libraries.
export KVSTRATA_REQUIRE_MOONCAKE=${KVSTRATA_REQUIRE_MOONCAKE:-1}
# Everything the scripts install must be there: a test that needs it fails instead of skipping
# (tests/capabilities.py). Only CPU capabilities and CUDA skip; -rs lists each skip with its reason.
export KVSTRATA_REQUIRE_ALL=${KVSTRATA_REQUIRE_ALL:-1}
ruff check kvstrata tests
# Build the CPU paged-attention kernel once, before the servers the tests start would each compile it.
python -m kvstrata.model.paged_kernels
python -m pytest -q -rs -p no:cacheprovider --durations=15 "$@"
