// The decode GEMV for CPUs with AVX2 and FMA but no AVX-512 BF16 (e.g. Zen 3): y = x @ w.T + bias for bf16
// x / w and up to a few dozen rows, computed in float32 from a packed bf16 copy of the weight.
//
// decode_linear_pack lays a weight [N, K] out as blocks of 16 weight rows, column by column (zero past N):
// the 16 weights of a block at one k are 32 bytes, and widen into two 8-lane vectors in two instructions (a
// bf16 is the high half of a float32: shift the low one left 16, mask the high one). A step k multiplies
// them by a broadcast x[m, k] for each of G input rows: 2 G accumulators that hold outputs, so there are no
// horizontal sums and one widened weight serves G rows. Measured on Zen 3 this runs 1.3-1.6x the float32
// dot-product form on a row-major weight at 16 rows (docs/benchmarks.md), and streams the weight at the
// memory bandwidth for one row.
//
// Row invariance: out[m, n] = round_bf16(sum over k = 0, 1, ... of fma(w[n, k], x[m, k]) + bias[n]) in this
// one order, whatever M, the row group that holds m or the number of threads (threads split the blocks).
// Callers keep it out of batch-invariant mode, as the AVX-512 BF16 kernel in decode_ops.cpp.

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

// Where row j of a block sits among its 16 weights of one k: rows 0-7 in the low bf16 of each 32-bit lane,
// rows 8-15 in the high one, so that one 32-byte load widens into both vectors with a shift and a mask.
constexpr int64_t slot(int64_t j) { return j < 8 ? 2 * j : 2 * (j - 8) + 1; }

// Blocks per tile for a group of G rows: enough independent accumulators (8-12) to hide the FMA latency.
constexpr int blocks_for(int G) { return G == 1 ? 4 : G <= 3 ? 2 : 1; }

// out rows [0, G) x weight rows [n0, n0 + 16 B) from B packed blocks at p (each K x 16), the input rows at
// x (float32, row stride K). Rows past N are computed (zero weights) and not stored.
template <int G, int B>
[[gnu::always_inline]] inline void tile(const uint16_t* p, const float* x, int64_t K, const float* bias,
                                        bf16* out, int64_t N, int64_t n0) {
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
        const __m256 xb = _mm256_broadcast_ss(x + m * K + k);
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
  // Groups of 4-6 rows (sizes differ by one at most), each against one block while it is in L1.
  const int64_t groups = (M + MAX_GROUP - 1) / MAX_GROUP;
  for (int64_t b = b0; b < b0 + blocks; ++b) {
    for (int64_t g = 0, m = 0; g < groups; ++g) {
      const int64_t rows = (M - m + groups - g - 1) / (groups - g);   // the largest first: it streams from DRAM
      with_group(rows, [&](auto G) { tile<G, 1>(at(b), x + m * K, K, bias, out + m * N, N, b * BLOCK); });
      m += rows;
    }
  }
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
  // The input rows in float32, widened once and read (broadcast) by every tile.
  std::vector<float> xf(M * K);
  const bf16* xp = x.data_ptr<bf16>();
  for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(xp[i]);
  std::vector<float> bf;
  if (b.defined()) {
    bf.resize(N);
    for (int64_t n = 0; n < N; ++n) bf[n] = static_cast<float>(b.data_ptr<bf16>()[n]);
  }
  const auto* pp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  bf16* op = out.data_ptr<bf16>();
  at::parallel_for(0, (blocks + SUPER - 1) / SUPER, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const int64_t b0 = s * SUPER;
      rows_against_blocks(pp, xf.data(), M, K, bf.empty() ? nullptr : bf.data(), op, N, b0,
                          std::min(SUPER, blocks - b0));
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
