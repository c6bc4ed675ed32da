// A bf16 linear layer on AMX tiles whose rows do not depend on the batch: y[m, n] = sum_k x[m, k] w[n, k]
// (+ bias[n]), bf16 in and out, float32 sums. For batch-invariant mode on CPUs with AMX, where oneDNN's
// AMX kernels change a row's bits with the row count (docs/benchmarks.md, fifteenth round) and the AVX-512
// GEMV runs prefill products ~15x slower than they do.
//
// amx_linear_pack lays a weight [N, K] out as the tile unit's B operand: blocks of 16 output columns x 32
// k, each [16 k pairs][16 columns] of bf16 pairs, zero past N and K. amx_linear then computes 16 rows x 64
// columns at a time: four float32 tiles summed over the k chunks in order (a tile's element sums only its
// own row's and column's products), the bias added and rounded to bf16 once. A row's bits depend neither on
// the other rows, nor on the row count, nor on the threads (they split the columns).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "amx_tiles.h"
#include "decode_linear.h"
#include "vec_math.h"

#if defined(KVSTRATA_AMX) && defined(__AVX512BF16__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t NB = 16;   // output columns per B tile
constexpr int64_t KC = 32;   // k per tile product
constexpr int64_t MB = 16;   // rows per A tile
constexpr int64_t NG = 4;    // B tiles per pass: 64 columns in tiles 0-3
constexpr int64_t MP = 256;  // rows per panel (a multiple of MB): 256-768 KB of x at K = 512-1536

at::Tensor amx_linear_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(),
              "amx_linear_pack: a contiguous bf16 weight [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t nb = (N + NB - 1) / NB, kc = (K + KC - 1) / KC;
  at::Tensor packed = at::zeros({nb * kc * (KC / 2) * NB * 2}, weight.options());
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  auto* p = reinterpret_cast<uint16_t*>(packed.data_ptr());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t b = n / NB, c = k / KC, pair = (k % KC) / 2;
      p[(((b * kc + c) * (KC / 2) + pair) * NB + n % NB) * 2 + k % 2] = w[n * K + k];
    }
  // Seen as [N blocks, K]: the shape amx_linear checks x against; the blocks lie in the storage as above.
  return packed.as_strided({nb, K}, {kc * (KC / 2) * NB * 2, 1});
}

// Tiles 0-3: C of columns g*64 + 16j; 4: A (16 rows x 32 k); 5: B.
template <int J>
inline void accumulate(const uint16_t* b) {
  _tile_loadd(5, b, NB * 2 * sizeof(uint16_t));
  if constexpr (J == 0) _tile_dpbf16ps(0, 4, 5);
  if constexpr (J == 1) _tile_dpbf16ps(1, 4, 5);
  if constexpr (J == 2) _tile_dpbf16ps(2, 4, 5);
  if constexpr (J == 3) _tile_dpbf16ps(3, 4, 5);
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t N) {
  const int64_t kc = (packed.size(1) + KC - 1) / KC;
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kBFloat16 && packed.size(0) == (N + NB - 1) / NB &&
              packed.stride(0) == kc * (KC / 2) * NB * 2 && packed.stride(1) == 1 && packed.storage_offset() == 0,
              "amx_linear: a weight from amx_linear_pack for ", N, " rows");
  TORCH_CHECK(kvstrata_cpu::amx_permitted(), "amx_linear: the OS does not grant the AMX tile state");
  const at::Tensor b = kvstrata_cpu::check_decode_linear_inputs(x, packed.size(1), N, bias);
  const int64_t M = x.size(0), K = x.size(1), Kp = kc * KC, Mp = (M + MB - 1) / MB * MB;
  at::Tensor out = at::empty({M, N}, x.options());
  // x as whole tiles: a zero-padded copy where M or K is not a multiple of the tile.
  at::Tensor xp = x;
  if (Mp != M || Kp != K) {
    xp = at::zeros({Mp, Kp}, x.options());
    xp.narrow(0, 0, M).narrow(1, 0, K).copy_(x);
  }
  const auto* xa = reinterpret_cast<const uint16_t*>(xp.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const auto* bp = b.defined() ? reinterpret_cast<const uint16_t*>(b.data_ptr()) : nullptr;
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t nb = packed.size(0), groups = (nb + NG - 1) / NG;   // 64-column groups
  // Panels of MP rows, one after another: a panel's x stays in cache while every column group reads it.
  for (int64_t p0 = 0; p0 < M; p0 += MP) {
    const int64_t p1 = std::min(M, p0 + MP);
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      kvstrata_cpu::load_tile_config({16, 16, 16, 16, 16, 16, 0, 0}, {64, 64, 64, 64, 64, 64, 0, 0});
      alignas(64) float c[MB * NG * NB];   // [row][64 columns]
      for (int64_t g = begin; g < end; ++g) {
        const int64_t tiles = std::min(NG, nb - g * NG);
        const uint16_t* wg = wp + g * NG * kc * (KC / 2) * NB * 2;
        for (int64_t m0 = p0; m0 < p1; m0 += MB) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int64_t k = 0; k < kc; ++k) {
            _tile_loadd(4, xa + m0 * Kp + k * KC, Kp * sizeof(uint16_t));
            const int64_t step = kc * (KC / 2) * NB * 2, at = k * (KC / 2) * NB * 2;
            accumulate<0>(wg + at);
            if (tiles > 1) accumulate<1>(wg + step + at);
            if (tiles > 2) accumulate<2>(wg + 2 * step + at);
            if (tiles > 3) accumulate<3>(wg + 3 * step + at);
          }
          _tile_stored(0, c, NG * NB * sizeof(float));
          _tile_stored(1, c + NB, NG * NB * sizeof(float));
          _tile_stored(2, c + 2 * NB, NG * NB * sizeof(float));
          _tile_stored(3, c + 3 * NB, NG * NB * sizeof(float));
          for (int64_t r = 0; r < MB && m0 + r < M; ++r)
            for (int64_t j = 0; j < tiles; ++j) {
              const int64_t n0 = (g * NG + j) * NB, live = std::min(NB, N - n0);
              const __mmask16 mask = live >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << live) - 1);
              __m512 v = _mm512_load_ps(c + r * NG * NB + j * NB);
              if (bp)
                v = _mm512_add_ps(v, kvstrata_cpu::load_bf16x16(bp + n0, mask));
              _mm256_mask_storeu_epi16(op + (m0 + r) * N + n0, mask, kvstrata_cpu::pack_bf16x16(v));
            }
        }
      }
      _tile_release();
    });
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvstrata, m) {
  m.def("amx_ready() -> bool", [] { return kvstrata_cpu::amx_permitted(); });
  m.def("amx_linear_pack(Tensor weight) -> Tensor");
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.impl("amx_linear_pack", c10::DispatchKey::CPU, TORCH_FN(amx_linear_pack));
  m.impl("amx_linear", c10::DispatchKey::CPU, TORCH_FN(amx_linear));
}

#endif  // AMX + AVX-512 BF16
