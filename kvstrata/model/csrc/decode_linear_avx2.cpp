// decode_linear for CPUs with AVX2 and FMA but no AVX-512 BF16 (e.g. Zen 3): the contract of the AVX-512
// BF16 kernel in decode_ops.cpp (y = x @ w.T + bias for bf16 x / w and a few dozen rows), computed in
// float32 from the bf16 weight as it is stored.
//
// Without this kernel such a CPU multiplies a decode batch of 4 rows or more as a float32 GEMM on a float32
// copy of every weight, made again each step (the bench model writes ~160 MB of copies per step). Here each
// weight element is read once per block of input rows, as bf16, and widened in a register (a bf16 is the
// high half of a float32: zero-extend, shift left 16). The input rows are widened once per call into a
// float32 scratch that stays in cache. Register blocks of NR weight rows x MR input rows keep NR * MR
// 8-lane accumulators; an output is the sum of its accumulator's lanes over K in steps of 8, then one
// fixed tree, so row m's bits do not depend on M, on its place in a block or on the thread count (threads
// split the weight rows). Callers keep it out of batch-invariant mode, as the AVX-512 kernel.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "decode_linear.h"
#include "vec_math.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

using bf16 = c10::BFloat16;

constexpr int NR = 3;           // weight rows per register block
constexpr int MR = 4;           // input rows per register block: NR x MR accumulators, NR + 1 more registers
constexpr int64_t GRAIN = 16;   // blocks of NR weight rows per parallel task
constexpr int BY_ROW_MAX_ROWS = 2;     // products of up to this many rows read the weight row after row
constexpr int64_t PREFETCH_BYTES = 512;   // how far ahead in each weight row the interleaved loop fetches

using kvstrata_cpu::load8;
using kvstrata_cpu::sum_lanes8;
using kvstrata_cpu::unroll;

// out[m, n0 + n] for NR weight rows (pointers; a short last block repeats a row) and G <= MR input rows
// (float32, K8 long, zero past K). The weights are read up to K8 too: the caller pads a tail of K.
template <int G>
[[gnu::always_inline]] inline void block(const uint16_t* const* w, const float* x, int64_t K8, const float* bias,
                                         bf16* out, int64_t N, int64_t n0, int rows) {
  __m256 acc[NR * MR];
  unroll<NR * MR>([&](auto i) { acc[i] = _mm256_setzero_ps(); });   // the unused ones are dropped
  if constexpr (G <= BY_ROW_MAX_ROWS) {
    // Memory-bound: each weight row front to back (the block's rows are adjacent: one sequential stream
    // that the hardware prefetcher follows). Same sums in the same order as the interleaved loop.
    unroll<NR>([&](auto n) {
      for (int64_t k = 0; k < K8; k += 8) {
        const __m256 wv = load8(w[n] + k);
        unroll<G>([&](auto m) {
          acc[n * MR + m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K8 + k), acc[n * MR + m]);
        });
      }
    });
  } else {   // compute-bound: NR weight chunks widened once per step serve G input rows
    for (int64_t k = 0; k < K8; k += 8) {
      __m256 wv[NR];
      unroll<NR>([&](auto n) {
        _mm_prefetch(reinterpret_cast<const char*>(w[n] + k) + PREFETCH_BYTES, _MM_HINT_T0);
        wv[n] = load8(w[n] + k);
      });
      unroll<G>([&](auto m) {
        const __m256 xv = _mm256_loadu_ps(x + m * K8 + k);
        unroll<NR>([&](auto n) { acc[n * MR + m] = _mm256_fmadd_ps(wv[n], xv, acc[n * MR + m]); });
      });
    }
  }
  for (int m = 0; m < G; ++m)
    for (int n = 0; n < rows; ++n)
      out[m * N + n0 + n] = static_cast<bf16>(sum_lanes8(acc[n * MR + m]) + (bias ? bias[n] : 0.0f));
}

// Weight rows [n0, n0 + rows) for every input row: the first group of input rows reads them into cache,
// the later groups reuse them.
void linear_block(const uint16_t* const* w, const float* x, const float* bias, bf16* out, int64_t M, int64_t K8,
                  int64_t N, int64_t n0, int rows) {
  for (int64_t m = 0; m < M; m += MR) {
    const float* xm = x + m * K8;
    bf16* om = out + m * N;
    switch (std::min<int64_t>(MR, M - m)) {
      case 1: block<1>(w, xm, K8, bias, om, N, n0, rows); break;
      case 2: block<2>(w, xm, K8, bias, om, N, n0, rows); break;
      case 3: block<3>(w, xm, K8, bias, om, N, n0, rows); break;
      default: block<4>(w, xm, K8, bias, om, N, n0, rows); break;
    }
  }
}

at::Tensor decode_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  const at::Tensor b = kvstrata_cpu::check_decode_linear_args(x, weight, bias);
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const int64_t K8 = (K + 7) / 8 * 8, full = K / 8 * 8;
  at::Tensor out = at::empty({M, N}, x.options());
  // The input rows in float32, zero-padded to K8: widened once, read by every block of weight rows.
  std::vector<float> xf(M * K8, 0.0f);
  const bf16* xp = x.data_ptr<bf16>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xf[m * K8 + k] = static_cast<float>(xp[m * K + k]);
  std::vector<float> bf(N, 0.0f);
  if (b.defined())
    for (int64_t n = 0; n < N; ++n) bf[n] = static_cast<float>(b.data_ptr<bf16>()[n]);
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  bf16* op = out.data_ptr<bf16>();
  at::parallel_for(0, (N + NR - 1) / NR, GRAIN, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> padded(full < K ? NR * K8 : 0, 0);   // rows whose K is not a multiple of 8, zero-padded
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n0 = i * NR;
      const int rows = static_cast<int>(std::min<int64_t>(NR, N - n0));
      const uint16_t* w[NR];
      for (int n = 0; n < NR; ++n) {
        w[n] = wp + (n0 + std::min(n, rows - 1)) * K;
        if (full < K) {
          std::memcpy(padded.data() + n * K8, w[n], K * sizeof(uint16_t));
          w[n] = padded.data() + n * K8;
        }
      }
      linear_block(w, xf.data(), b.defined() ? bf.data() + n0 : nullptr, op, M, K8, N, n0, rows);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvstrata, m) {   // decode_ops.cpp registers the AVX-512 BF16 kernel instead where it builds
  m.def("decode_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.impl("decode_linear", c10::DispatchKey::CPU, TORCH_FN(decode_linear));
}

#endif  // AVX2 + FMA, no AVX-512 BF16
