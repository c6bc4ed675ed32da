#!/usr/bin/env bash
# Issue 47's side by side: kvstrata vs llama.cpp (llama-cpp-python's server) on the same GGUF files, 2 threads,
# one server at a time, each measured by the peers' bench_server.py (2048-token prompt, 64 greedy tokens).
# Needs ../shared/peers set up (`setup.sh`) with its 1B-class model converted and quantized (see its README).
# usage: scripts/peers/gguf_side_by_side.sh PEERS_DIR OUT_DIR FILE... (a .gguf, or a safetensors folder
#        for kvstrata only; KVSTRATA_EXTRA="--quantization int8" adds server flags)
set -u
PEERS=$1; OUT=$2; shift 2; mkdir -p "$OUT"
HERE=$(cd "$(dirname "$0")" && pwd); REPO=$(cd "$HERE/../.." && pwd)
wait_ready() { for _ in $(seq 1 900); do curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null && return 0
               kill -0 "$2" 2>/dev/null || return 1; sleep 1; done; return 1; }
measure() {  # label port pid prompt-mode extra-json
  timeout 1200 "$PEERS/hf/bin/python" "$PEERS/scripts/bench_server.py" --port "$2" --pid "$3" --model tiny-llama \
    --prompt-mode "$4" --reps 1 --extra "$5" --label "$1" --out "$OUT/$1.json" 2>&1 | grep SUMMARY | sed "s/^/$1 /"
}
stop() { kill -- "-$1" 2>/dev/null; sleep 3; kill -9 -- "-$1" 2>/dev/null; true; }
for F in "$@"; do
  name=$(basename "$F" .gguf)
  setsid "$REPO/.venv/bin/python" -m kvstrata.launch_server --host 127.0.0.1 --port 33400 --model-path "$F" \
    --served-model-name tiny-llama --num-threads 2 --max-total-tokens 4160 ${KVSTRATA_EXTRA:-} > "$OUT/kv_$name.log" 2>&1 &
  pid=$!; wait_ready 33400 $pid && measure "kvstrata_$name" 33400 $pid ids '{"ignore_eos": true}'; stop $pid
  [[ $F == *.gguf ]] || continue
  # llama.cpp's AMX matmul crashes on some Xeons (docs/benchmarks.md, issue 47): its extra buffers are off.
  setsid "$PEERS/llamacpp/bin/python" "$HERE/llama_server_noextra.py" --model "$F" --model_alias tiny-llama \
    --host 127.0.0.1 --port 33401 --n_ctx 4096 --n_threads 2 --n_threads_batch 2 --n_batch 2048 --flash_attn true \
    > "$OUT/llamacpp_$name.log" 2>&1 &
  pid=$!; wait_ready 33401 $pid && measure "llamacpp_$name" 33401 $pid text '{"logit_bias": {"2": -100}}'; stop $pid
done
