#!/usr/bin/env bash
# The CUDA checks (CI has no GPU): run on a machine with one, from the repository root.
#   1. the GPU-only unit tests (copy streams and layer events, pinned host pool, grammar bitmask on the device);
#   2. the numerics and cache-configuration tests with KVSTRATA_TEST_DEVICE=cuda: logits against transformers on
#      the GPU, batch invariance, greedy output identical without cache, with L1, L2 and L2 + file L3;
#   3. `kvstrata bench engine` on the GPU: TTFT, decode 1 and 16 streams next to transformers, and the cost of a
#      load-back from the host tier next to an L1 hit.
# Needs a python3 with CUDA torch, transformers, pytest, pytest-timeout, pyzmq and xgrammar (the project's
# other dependencies are not imported here). Wheels in ./.whl, if present, are installed into /tmp/site first
# (for machines without a package index). Logs go to $1, else $OUT, else /tmp. Exit status: 0 when every
# test passed.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${1:-${OUT:-/tmp}}
PY=${PYTHON:-python3}
if [ -d .whl ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export KVSTRATA_CACHE_DIR=${KVSTRATA_CACHE_DIR:-/tmp/kvstrata-cuda-cache}
nvidia-smi -L
"$PY" -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__, '|', torch.cuda.get_device_name())" || exit 1
PYTEST=("$PY" -m pytest -q -p no:cacheprovider --timeout 90 -rfE)
rc=0
timeout 120 "${PYTEST[@]}" -m gpu tests/cache/test_cache_controller.py tests/memory/test_host_pool.py tests/constrained/test_masks.py \
  2>&1 | tee "$LOG/cuda_units.log" || rc=1
KVSTRATA_TEST_DEVICE=cuda timeout 240 "${PYTEST[@]}" -k "not mooncake" --durations=10 \
  tests/model/test_llama_vs_hf.py tests/model/test_batch_invariance.py tests/runtime/test_prefix_cache.py \
  tests/cache/test_hicache_engine.py tests/cache/test_storage_engine.py tests/cache/test_tier_hit_accounting.py \
  tests/runtime/test_deterministic.py tests/runtime/test_engine.py \
  2>&1 | tee "$LOG/cuda_tests.log" || rc=1
for dtype in bfloat16 float32; do
  timeout 90 "$PY" -m kvstrata.cli bench engine --device cuda --dtype "$dtype" --context 2048 --streams 16 --repeat 2 \
    2>&1 | tee -a "$LOG/cuda_bench.log" | tail -4
done
timeout 90 "$PY" -m kvstrata.cli bench engine --device cuda --load-back --context 6144 --suffix 1024 --repeat 2 \
  2>&1 | tee -a "$LOG/cuda_bench.log" | tail -2
exit $rc
