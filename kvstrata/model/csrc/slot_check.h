// The check every attention op makes before it follows a slot: each index of its plan names a row of the pool.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>

namespace kvstrata_cpu {

// Raises, naming the first bad slot, unless every slots[0, n) is in [0, pool_rows). One branch-free pass
// that vectorizes, and a search only on failure: checked one by one, each slot cost ~6 ns (a call and a
// branch per element), 12-16% of the decode attention op at 16 rows x 2069 keys (docs/benchmarks.md).
inline void check_slots(const int64_t* slots, int64_t n, int64_t pool_rows) {
  const auto rows = static_cast<uint64_t>(pool_rows);
  bool bad = false;   // as unsigned, a negative slot is past every pool
  for (int64_t i = 0; i < n; ++i) bad |= static_cast<uint64_t>(slots[i]) >= rows;
  if (!bad) return;
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(slots[i] >= 0 && slots[i] < pool_rows, "slot ", slots[i], " is outside the pool");
}

}  // namespace kvstrata_cpu
