// What the extend-attention tiles (extend_tile_*.h) share with their driver (extend_attention.cpp).
#pragma once

#include <cstdint>

namespace kvstrata_cpu {

struct ExtendDims {
  int64_t heads, kv_heads, dim, group;   // group: query heads per KV head
};

// One sequence of an extend call: its first row in q, its cached and new tokens, the pool row of each key.
struct ExtendSeq {
  int64_t q_start, prefix, extend;
  const int64_t* slots;
  int64_t blocks(int64_t keys_per_block) const { return (prefix + extend + keys_per_block - 1) / keys_per_block; }
};

}  // namespace kvstrata_cpu
