// The bf16 matmul for CPUs with AVX2 and FMA but no AVX-512 BF16 (e.g. Zen 3): y = x @ w.T + bias for bf16
// x / w and any number of rows (decode steps and prefill), computed in float32 from a packed copy of the weight.
//
// decode_linear_pack lays a weight [N, K] out as blocks of 16 weight rows, column by column (zero past N):
// the 16 weights of a block at one k are 32 bytes, and widen into two 8-lane vectors in two instructions (a
// bf16 is the high half of a float32: shift the low one left 16, mask the high one). A step k multiplies
// them by a broadcast x[m, k] for each of G input rows: 2 G accumulators that hold outputs, so there are no
// horizontal sums and one widened weight serves G rows. Measured on Zen 3 this runs 1.3-1.6x the float32
// dot-product form on a row-major weight at 16 rows (docs/benchmarks.md), streams the weight at the memory
// bandwidth for one row, and at prefill runs 1.0-1.5x MKL's float32 GEMM on an upcast weight.
//
// Row invariance: out[m, n] = round_bf16(sum over k = 0, 1, ... of fma(w[n, k], x[m, k]) + bias[n]) in this
// one order, whatever M, the row group or panel that holds m, or the number of threads. A row's result is
// therefore the same in a decode step, a prefill chunk or any batch (batch-invariant mode uses it too).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "decode_linear.h"
#include "vec_math.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

using bf16 = c10::BFloat16;
using kvstrata_cpu::unroll;

constexpr int64_t BLOCK = 16;        // weight rows per packed block: two 8-lane vectors
constexpr int64_t SUPER = 4;         // blocks per parallel task: a one-row tile reads 4 adjacent blocks
constexpr int MAX_GROUP = 6;         // input rows per register tile: 12 accumulators + 2 weights + 1 broadcast
// Tiles of this many rows or more fetch their block's weights this far ahead: the first row group reads
// them from DRAM, and with the hardware prefetcher alone 4-16 rows ran 1.2-1.4x slower. Fewer rows are a
// memory stream, which the extra loads slowed by ~20% (measured on Zen 3, docs/benchmarks.md).
constexpr int PREFETCH_MIN_ROWS = 4;
constexpr int64_t PREFETCH_BYTES = 2048;
// Input rows are widened and swept in panels of about this many bytes, which stay in a core's L2 (512 KB on
// Zen 3) while every weight block passes against them.
constexpr int64_t PANEL_BYTES = 192 * 1024;
constexpr int64_t DECODE_ROWS = 64;   // up to this many rows the threads split the weight instead (decode)

// Where row j of a block sits among its 16 weights of one k: rows 0-7 in the low bf16 of each 32-bit lane,
// rows 8-15 in the high one, so that one 32-byte load widens into both vectors with a shift and a mask.
constexpr int64_t slot(int64_t j) { return j < 8 ? 2 * j : 2 * (j - 8) + 1; }

// 8 float32 rounded to bf16 at dst, as static_cast<bf16> rounds each.
inline void store_bf16x8(bf16* dst, __m256 y) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), kvstrata_cpu::pack_bf16x8(y));
}

// Blocks per tile for a group of G rows: enough independent accumulators (8-12) to hide the FMA latency,
// within the 16 vector registers. Three rows take one block: two would need 12 accumulators, 4 widened
// weights and a broadcast, and GCC's spills ran the tile at 0.6-0.7x of one block's rate (Zen 3).
constexpr int blocks_for(int G) { return G == 1 ? 4 : G == 2 ? 2 : 1; }

// out rows [0, G) x weight rows [n0, n0 + 16 B) from B packed blocks at p (each K x 16), the group's input
// rows at x (float32, k-major: x[k * G + m]). Rows past N are computed (zero weights) and not stored.
// Not inlined: inside its caller GCC kept the caller's values in vector registers across the k loop and
// spilled two of the 6-row tile's 12 accumulators to the stack, a load-FMA-store chain per k that halved
// its rate (12-16 rows ran at ~35 GFLOPS per core instead of 55-85, docs/benchmarks.md).
template <int G, int B>
[[gnu::noinline]] void tile(const uint16_t* p, const float* x, int64_t K, const float* bias, bf16* out,
                            int64_t N, int64_t n0) {
  __m256 acc[G * B * 2];
  unroll<G * B * 2>([&](auto i) { acc[i] = _mm256_setzero_ps(); });
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t k = 0; k < K; ++k) {
    unroll<B>([&](auto b) {
      if constexpr (G >= PREFETCH_MIN_ROWS)
        _mm_prefetch(reinterpret_cast<const char*>(p + (b * K + k) * BLOCK) + PREFETCH_BYTES, _MM_HINT_T0);
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + (b * K + k) * BLOCK));
      const __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));     // rows 0-7: the low halves
      const __m256 hi = _mm256_castsi256_ps(_mm256_and_si256(w, high));   // rows 8-15: the high halves
      unroll<G>([&](auto m) {
        const __m256 xb = _mm256_broadcast_ss(x + k * G + m);
        acc[(m * B + b) * 2] = _mm256_fmadd_ps(lo, xb, acc[(m * B + b) * 2]);
        acc[(m * B + b) * 2 + 1] = _mm256_fmadd_ps(hi, xb, acc[(m * B + b) * 2 + 1]);
      });
    });
  }
  // Spill through constant indices (a runtime-indexed acc would be kept in memory, vec_math.h), then round.
  alignas(32) float sums[G * B * 2][8];
  unroll<G * B * 2>([&](auto i) { _mm256_store_ps(sums[i], acc[i]); });
  for (int m = 0; m < G; ++m) {
    for (int b = 0; b < B; ++b) {
      const float* row = sums[(m * B + b) * 2];   // 16 consecutive floats: rows n0 + 16 b + [0, 16)
      const int64_t first = n0 + b * BLOCK, count = std::min<int64_t>(BLOCK, N - first);
      if (count == BLOCK) {
        for (int64_t half = 0; half < BLOCK; half += 8) {
          __m256 y = _mm256_load_ps(row + half);
          if (bias) y = _mm256_add_ps(y, _mm256_loadu_ps(bias + first + half));
          store_bf16x8(out + m * N + first + half, y);
        }
        continue;
      }
      for (int64_t j = 0; j < count; ++j)
        out[m * N + first + j] = static_cast<bf16>(row[j] + (bias ? bias[first + j] : 0.0f));
    }
  }
}

// f(integral_constant<int, G>) for a group of 1 <= G <= MAX_GROUP rows.
template <typename F>
void with_group(int64_t G, F&& f) {
  switch (G) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    default: return f(std::integral_constant<int, 6>{});
  }
}

// The row groups of M input rows: one of M <= MAX_GROUP rows, else groups of 4-6 rows whose sizes differ by
// one at most, the largest first (it streams the weight from DRAM). f(first row, rows) for each, in order.
template <typename F>
void for_each_group(int64_t M, F&& f) {
  const int64_t groups = (M + MAX_GROUP - 1) / MAX_GROUP;
  for (int64_t g = 0, m = 0; g < groups; ++g) {
    const int64_t rows = (M - m + groups - g - 1) / (groups - g);
    f(m, rows);
    m += rows;
  }
}

// All M rows against `blocks` packed blocks from block index b0.
void rows_against_blocks(const uint16_t* packed, const float* x, int64_t M, int64_t K, const float* bias,
                         bf16* out, int64_t N, int64_t b0, int64_t blocks) {
  const auto at = [&](int64_t b) { return packed + b * K * BLOCK; };
  if (M <= MAX_GROUP) {   // one group, B blocks per tile, then the leftover blocks one at a time
    with_group(M, [&](auto G) {
      constexpr int B = blocks_for(G);
      int64_t b = b0;
      for (; b + B <= b0 + blocks; b += B) tile<G, B>(at(b), x, K, bias, out, N, b * BLOCK);
      for (; b < b0 + blocks; ++b) tile<G, 1>(at(b), x, K, bias, out, N, b * BLOCK);
    });
    return;
  }
  // Every group against one block while it is in L1.
  for (int64_t b = b0; b < b0 + blocks; ++b)
    for_each_group(M, [&](int64_t m, int64_t rows) {
      with_group(rows, [&](auto G) { tile<G, 1>(at(b), x + m * K, K, bias, out + m * N, N, b * BLOCK); });
    });
}

// M input rows [M, K] in float32, widened once and read (broadcast) by every tile, each row group k-major
// (x[k * rows + m] from the group's first row * K): a tile's broadcasts of one k are adjacent, and its rows
// no longer share L1 sets when K * 4 bytes divides 4 KB (measured on Zen 3: 1.2-1.4x for a prefill panel).
std::vector<float> widen(const bf16* x, int64_t M, int64_t K) {
  std::vector<float> xf(M * K);
  for_each_group(M, [&](int64_t m0, int64_t rows) {
    float* group = xf.data() + m0 * K;
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t k = 0; k < K; ++k) group[k * rows + m] = static_cast<float>(x[(m0 + m) * K + k]);
  });
  return xf;
}

// Rows per panel of a product with K inputs: a multiple of the row group whose float32 copy fits PANEL_BYTES.
int64_t panel_rows(int64_t K) {
  return std::max<int64_t>(1, PANEL_BYTES / (K * static_cast<int64_t>(sizeof(float))) / MAX_GROUP) * MAX_GROUP;
}

at::Tensor decode_linear_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(),
              "decode_linear_pack: a contiguous bf16 weight [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1), blocks = (N + BLOCK - 1) / BLOCK;
  at::Tensor packed = at::zeros({blocks, K, BLOCK}, weight.options());
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  auto* p = reinterpret_cast<uint16_t*>(packed.data_ptr());
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t j = 0; j < std::min<int64_t>(BLOCK, N - b * BLOCK); ++j)
        for (int64_t k = 0; k < K; ++k) p[(b * K + k) * BLOCK + slot(j)] = w[(b * BLOCK + j) * K + k];
  });
  return packed;
}

at::Tensor decode_linear_packed(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                                int64_t N) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == BLOCK && packed.size(0) == (N + BLOCK - 1) / BLOCK,
              "decode_linear_packed: a weight from decode_linear_pack for ", N, " rows");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(), "decode_linear_packed: bf16, contiguous");
  const at::Tensor b = kvstrata_cpu::check_decode_linear_inputs(x, packed.size(1), N, bias);
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;   // (with_group has no tile of 0 rows)
  std::vector<float> bf;
  if (b.defined()) {
    bf.resize(N);
    for (int64_t n = 0; n < N; ++n) bf[n] = static_cast<float>(b.data_ptr<bf16>()[n]);
  }
  const auto* pp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  bf16* op = out.data_ptr<bf16>();
  const float* bias_f = bf.empty() ? nullptr : bf.data();
  const int64_t panel = panel_rows(K);
  if (M <= std::max(panel, DECODE_ROWS)) {   // decode: the threads split the weight, each reads every row
    const std::vector<float> xf = widen(x.data_ptr<bf16>(), M, K);
    at::parallel_for(0, (blocks + SUPER - 1) / SUPER, 1, [&](int64_t begin, int64_t end) {
      for (int64_t s = begin; s < end; ++s) {
        const int64_t b0 = s * SUPER;
        rows_against_blocks(pp, xf.data(), M, K, bias_f, op, N, b0, std::min(SUPER, blocks - b0));
      }
    });
    return out;
  }
  // Prefill: the threads split the rows in panels, each widened into the core's L2 and swept against every
  // block of the weight (which the cores share in L3).
  at::parallel_for(0, (M + panel - 1) / panel, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m0 = i * panel, rows = std::min(panel, M - m0);
      const std::vector<float> xf = widen(x.data_ptr<bf16>() + m0 * K, rows, K);
      rows_against_blocks(pp, xf.data(), rows, K, bias_f, op + m0 * N, N, 0, blocks);
    }
  });
  return out;
}

}  // namespace

// decode_ops.cpp registers `decode_linear` (row-major weights) instead where AVX-512 BF16 builds;
// paged_kernels.decode_linear_op() picks whichever pair this build has.
TORCH_LIBRARY_FRAGMENT(kvstrata, m) {
  m.def("decode_linear_pack(Tensor weight) -> Tensor");
  m.def("decode_linear_packed(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.impl("decode_linear_pack", c10::DispatchKey::CPU, TORCH_FN(decode_linear_pack));
  m.impl("decode_linear_packed", c10::DispatchKey::CPU, TORCH_FN(decode_linear_packed));
}

#endif  // AVX2 + FMA, no AVX-512 BF16
