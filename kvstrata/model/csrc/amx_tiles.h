// What the AMX kernels (extend_tile_amx.h, linear_amx.cpp) share: the OS permission and the tile config.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define KVSTRATA_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace kvstrata_cpu {

// Linux hands out the tile registers' state only to a process that asks for it (once, for all its threads).
inline bool amx_permitted() {
  static const bool granted = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

// Palette 1 with tiles 0-7 of rows[t] rows x colsb[t] bytes, loaded on the calling thread.
inline void load_tile_config(const uint8_t (&rows)[8], const uint16_t (&colsb)[8]) {
  struct alignas(64) Config {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = rows[t];
    c.colsb[t] = colsb[t];
  }
  // GCC does not see the config load read the struct, and may drop the stores above without this.
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

}  // namespace kvstrata_cpu

#endif  // AMX
