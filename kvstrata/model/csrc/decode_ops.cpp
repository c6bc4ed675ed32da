// Decode-step kernels for CPU: a bf16 matrix-vector product for a few rows (AVX-512 BF16; CPUs with only
// AVX2 build decode_linear_avx2.cpp instead), and a fused residual-add + RMSNorm.
//
// decode_linear: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for bf16 x / w and up to a few dozen rows M
// (callers choose: it beats oneDNN up to ~64 rows on 2 Zen 4 threads). For one or two rows a projection is
// a stream over the weight (oneDNN's bf16 GEMM reads it at ~5-14 GB/s, this kernel, row after row, at
// ~25-35 GB/s); for more it is compute-bound: register blocks of 4 weight rows x 4 input rows (16
// accumulators, 8 loads per 16 vdpbf16ps, one transposed reduction) reach ~300 GFLOPS on 2 threads, ~2/3
// of the dot-product peak, with the weight of a block 4 ahead prefetched. float32 accumulation (vdpbf16ps:
// exact products, fp32 sums), one rounding of the output. Row m's arithmetic does not depend on M, on its
// place in a block or on the thread count (threads split the output columns), but it differs from oneDNN's
// summation order: callers keep it out of batch-invariant mode, where a decode row must match the same row
// computed in a larger (oneDNN) batch.
//
// add_rms_norm: residual' = x + residual (rounded to the input dtype, as the unfused add), and
// out = rms_norm(residual') with the arithmetic of transformers' LlamaRMSNorm: float32 inside, the
// normalized row rounded to the input dtype, then multiplied by the weight and rounded again (torch's
// F.rms_norm rounds once, so it differs from transformers by an ulp in ~25% of bf16 elements). One pass
// per row (16 lanes with AVX-512, 8 with AVX2, scalar otherwise); rows are independent and their sums of
// squares fixed in order for a given build (batch-invariant).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "decode_linear.h"
#include "vec_math.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using bf16 = c10::BFloat16;

inline float to_float(float v) { return v; }
inline float to_float(bf16 v) { return static_cast<float>(v); }

template <typename T>
inline T from_float(float v) { return static_cast<T>(v); }   // c10::BFloat16: round to nearest even

#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(bf16* p, __m512 v) {   // round to nearest even, as c10::BFloat16 (NaN kept quiet)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), kvstrata_cpu::pack_bf16x16(v));
}
#endif

#ifdef __AVX512BF16__

constexpr int NR = 4;                   // weight rows per register block
constexpr int MR = 4;                   // input rows per register block: NR x MR accumulators
constexpr int64_t BY_ROW_MAX_ROWS = 2;  // products of up to this many rows read the weight row by row
constexpr int64_t PREFETCH_AHEAD = 4;   // blocks between the one computed and the one fetched (>= DRAM latency)
constexpr int64_t GRAIN = 16;           // blocks of NR weight rows per parallel task (>= 32 KB of weight at K=256)

using kvstrata_cpu::unroll;

using Acc = __m512[NR * MR];   // acc[n * MR + m]: weight row n times input row m

// A later block's weight, fetched into L2 a few cache lines per step while this block computes: the memory
// stream keeps going while later groups of input rows reuse this block from L1 (without it, 4 interleaved
// weight rows are read at half the bandwidth of one, and the later groups leave memory idle).
struct Prefetch {
  const char* next;
  const char* end;
  int64_t lines_per_step;
  inline void step() {
    for (int64_t i = 0; i < lines_per_step && next < end; ++i, next += 64) _mm_prefetch(next, _MM_HINT_T1);
  }
};

// One 32-element step of the chains acc[n, m] += w[n] . x[m], n in [N0, N1), m < G (mask: the step's valid
// elements; K's tail is one more step of the same chains).
template <int G, int N0, int N1>
[[gnu::always_inline]] inline void dot_step(const bf16* const* w, const bf16* x, int64_t K, int64_t k,
                                            __mmask32 mask, Acc& acc, Prefetch& pf) {
  pf.step();
  __m512bh wv[NR], xv[MR];
  unroll<N1 - N0>([&](auto n) { wv[N0 + n] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w[N0 + n] + k); });
  unroll<G>([&](auto m) { xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k); });
  unroll<(N1 - N0) * G>([&](auto i) {
    constexpr int n = N0 + i / G, m = i % G;
    acc[n * MR + m] = _mm512_dpbf16_ps(acc[n * MR + m], wv[n], xv[m]);
  });
}

template <int G, int N0, int N1>
[[gnu::always_inline]] inline void dots(const bf16* const* w, const bf16* x, int64_t K, Acc& acc, Prefetch& pf) {
  const int64_t full = K & ~int64_t{31};
  for (int64_t k = 0; k < full; k += 32) dot_step<G, N0, N1>(w, x, K, k, ~0u, acc, pf);
  if (full < K) dot_step<G, N0, N1>(w, x, K, full, (1u << (K - full)) - 1u, acc, pf);
}

// Lane by lane, v[i] + v[i + width] for a pair of vectors (a, b), a's sums packed next to b's. Four folds
// turn 16 vectors into one vector of their 16 sums, each summed in the pairs of a plain tree (lane i +
// i+8, then i+4, i+2, i+1), whichever position it is in.
inline __m512 fold_256(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
}
inline __m512 fold_128(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}
inline __m512 fold_64(__m512 a, __m512 b) {
  const __m512d ad = _mm512_castps_pd(a), bd = _mm512_castps_pd(b);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(ad, bd)), _mm512_castpd_ps(_mm512_unpackhi_pd(ad, bd)));
}
inline __m512 fold_32(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Lane m * NR + n of the result: the sum of acc[n * MR + m]'s 16 lanes.
[[gnu::always_inline]] inline __m512 sum_lanes(const Acc& acc) {
  __m512 s[8], t[4];
  unroll<8>([&](auto i) { s[i] = fold_256(acc[2 * i], acc[2 * i + 1]); });
  unroll<4>([&](auto i) { t[i] = fold_128(s[2 * i], s[2 * i + 1]); });
  return fold_32(fold_64(t[0], t[1]), fold_64(t[2], t[3]));
}

// out[m, n0 + n] = w[n] . x[m] + bias for NR weight rows (the first `rows` of them real) and G <= MR input
// rows: one float32 accumulator per output, summed over K in steps of 32 whatever G, the block or the loop
// order, so that an output's bits do not depend on M. Interleaved: all NR rows per step, NR + G loads per
// NR * G products (compute-bound products); BY_ROW: each weight row front to back, one after the other, a
// single sequential stream that the hardware prefetcher follows (memory-bound ones: one or two rows).
template <int G, bool BY_ROW>
[[gnu::flatten]] void block(const bf16* const* w, const bf16* x, int64_t K, __m512 bias, bf16* out, int64_t N,
                           int64_t n0, int rows, Prefetch& pf) {
  Acc acc;
  unroll<NR * MR>([&](auto i) { acc[i] = _mm512_setzero_ps(); });
  if constexpr (BY_ROW)
    unroll<NR>([&](auto n) { dots<G, n, n + 1>(w, x, K, acc, pf); });
  else
    dots<G, 0, NR>(w, x, K, acc, pf);
  alignas(64) bf16 y[NR * MR];
  store16(y, _mm512_add_ps(sum_lanes(acc), bias));
  for (int m = 0; m < G; ++m) std::memcpy(out + m * N + n0, y + m * NR, rows * sizeof(bf16));
}

template <bool BY_ROW>
void row_groups(const bf16* const* w, const bf16* x, int64_t M, int64_t K, __m512 bias, bf16* out, int64_t N,
                int64_t n0, int rows, Prefetch& pf) {
  for (int64_t m = 0; m < M; m += MR) {
    const bf16* xm = x + m * K;
    bf16* om = out + m * N;
    switch (std::min<int64_t>(MR, M - m)) {
      case 1: block<1, BY_ROW>(w, xm, K, bias, om, N, n0, rows, pf); break;
      case 2: block<2, BY_ROW>(w, xm, K, bias, om, N, n0, rows, pf); break;
      case 3: block<3, BY_ROW>(w, xm, K, bias, om, N, n0, rows, pf); break;
      default: block<4, BY_ROW>(w, xm, K, bias, om, N, n0, rows, pf); break;
    }
  }
}

// Weight rows [n0, n0 + rows) (rows <= NR: a block at the end of N repeats its last row) for every input
// row: read into L1 by the first group of input rows and reused by the others.
void linear_block(const bf16* x, const bf16* w, const bf16* bias, bf16* out, int64_t M, int64_t K, int64_t N,
                  int64_t n0, int rows) {
  const bf16* wr[NR];
  alignas(64) float b[NR * MR] = {};
  for (int n = 0; n < NR; ++n) {
    wr[n] = w + (n0 + std::min(n, rows - 1)) * K;
    for (int m = 0; bias && n < rows && m < MR; ++m) b[m * NR + n] = static_cast<float>(bias[n0 + n]);
  }
  const __m512 bv = _mm512_load_ps(b);
  const auto row = [&](int64_t n) { return reinterpret_cast<const char*>(w + std::min(n, N) * K); };
  Prefetch pf{row(n0 + PREFETCH_AHEAD * NR), row(n0 + (PREFETCH_AHEAD + 1) * NR), 0};
  if (M <= BY_ROW_MAX_ROWS) {   // the hardware prefetcher follows the one stream (faster than with pf here)
    row_groups<true>(wr, x, M, K, bv, out, N, n0, rows, pf);
  } else {
    const int64_t steps = std::max<int64_t>(1, (M + MR - 1) / MR * ((K + 31) / 32));
    pf.lines_per_step = (pf.end - pf.next + 64 * steps - 1) / (64 * steps);
    row_groups<false>(wr, x, M, K, bv, out, N, n0, rows, pf);
  }
}

at::Tensor decode_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  const at::Tensor b = kvstrata_cpu::check_decode_linear_args(x, weight, bias);
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* wp = weight.data_ptr<bf16>();
  const bf16* bp = b.defined() ? b.data_ptr<bf16>() : nullptr;
  bf16* op = out.data_ptr<bf16>();
  at::parallel_for(0, (N + NR - 1) / NR, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      linear_block(xp, wp, bp, op, M, K, N, i * NR, static_cast<int>(std::min<int64_t>(NR, N - i * NR)));
  });
  return out;
}

#endif  // __AVX512BF16__

// One row: residual_out = round(x + residual) (when residual is given), out = norm of that row (scalar code:
// rows whose size is not a multiple of the vector lanes, or CPUs without AVX2).
template <typename T>
void add_rms_norm_row(const T* x, const T* residual, const T* weight, T* out, T* residual_out, int64_t H,
                      float eps, float* scratch) {
  float sum_sq = 0.0f;
  for (int64_t i = 0; i < H; ++i) {
    float v = to_float(x[i]);
    if (residual) {
      const T rounded = from_float<T>(v + to_float(residual[i]));
      residual_out[i] = rounded;
      v = to_float(rounded);
    }
    scratch[i] = v;
    sum_sq += v * v;
  }
  const float inv = 1.0f / std::sqrt(sum_sq / static_cast<float>(H) + eps);
  for (int64_t i = 0; i < H; ++i) {
    const float normalized = to_float(from_float<T>(scratch[i] * inv));
    out[i] = from_float<T>(normalized * to_float(weight[i]));
  }
}

// The vector lanes of this build for the norm's row loop: 16 with AVX-512, 8 with AVX2 + FMA.
#if defined(__AVX512F__)
#define KVSTRATA_NORM_LANES 1
struct Lanes {
  using V = __m512;
  static constexpr int64_t N = 16;
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const bf16* p) { return load16(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static void store(bf16* p, V v) { store16(p, v); }
  static V widened_bf16(V v) { return kvstrata_cpu::round_bf16(v); }
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float v) { return _mm512_set1_ps(v); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
};
#elif defined(__AVX2__) && defined(__FMA__)
#define KVSTRATA_NORM_LANES 1
struct Lanes {
  using V = __m256;
  static constexpr int64_t N = 8;
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const bf16* p) { return kvstrata_cpu::load8(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static void store(bf16* p, V v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), kvstrata_cpu::pack_bf16x8(v)); }
  static V widened_bf16(V v) { return kvstrata_cpu::round_bf16(v); }
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float v) { return _mm256_set1_ps(v); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(V v) { return kvstrata_cpu::sum_lanes8(v); }
};
#endif

#ifdef KVSTRATA_NORM_LANES
// The same row in vectors of Lanes::N (H % Lanes::N == 0).
template <typename T>
void add_rms_norm_row_lanes(const T* x, const T* residual, const T* weight, T* out, T* residual_out, int64_t H,
                            float eps, float* scratch) {
  using L = Lanes;
  const auto rounded = [](L::V v) {   // v rounded to T and widened back
    if constexpr (std::is_same_v<T, float>)
      return v;
    else
      return L::widened_bf16(v);
  };
  L::V sum_sq = L::zero();
  for (int64_t i = 0; i < H; i += L::N) {
    L::V v = L::load(x + i);
    if (residual) {
      v = L::add(v, L::load(residual + i));
      L::store(residual_out + i, v);
      v = rounded(v);
    }
    L::store(scratch + i, v);
    sum_sq = L::fmadd(v, v, sum_sq);
  }
  const L::V inv = L::set1(1.0f / std::sqrt(L::sum(sum_sq) / static_cast<float>(H) + eps));
  for (int64_t i = 0; i < H; i += L::N) {
    const L::V normalized = rounded(L::mul(L::load(scratch + i), inv));
    L::store(out + i, L::mul(normalized, L::load(weight + i)));
  }
}
#endif

template <typename T>
void add_rms_norm_rows(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, at::Tensor& out,
                       at::Tensor& residual_out, double eps) {
  const int64_t rows = x.size(0), H = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* rp = residual.defined() ? residual.data_ptr<T>() : nullptr;
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  T* rop = residual_out.defined() ? residual_out.data_ptr<T>() : nullptr;
  // ~64 rows per task at hidden 512-4096: small batches run on one thread (no fork/join).
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(H, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(H);
    for (int64_t r = begin; r < end; ++r) {
      const T* res = rp ? rp + r * H : nullptr;
      T* res_out = rop ? rop + r * H : nullptr;
#ifdef KVSTRATA_NORM_LANES
      if (H % Lanes::N == 0) {
        add_rms_norm_row_lanes<T>(xp + r * H, res, wp, op + r * H, res_out, H, static_cast<float>(eps),
                                  scratch.data());
        continue;
      }
#endif
      add_rms_norm_row<T>(xp + r * H, res, wp, op + r * H, res_out, H, static_cast<float>(eps), scratch.data());
    }
  });
}

void check_norm_args(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "rms_norm: x [T, H] contiguous");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "rms_norm: bf16 or float32");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight [H] in x's dtype");
}

void norm_rows(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, at::Tensor& out,
               at::Tensor& residual_out, double eps) {
  const at::Tensor w = weight.contiguous();
  if (x.scalar_type() == at::kBFloat16)
    add_rms_norm_rows<bf16>(x, residual, w, out, residual_out, eps);
  else
    add_rms_norm_rows<float>(x, residual, w, out, residual_out, eps);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm_args(x, weight);
  at::Tensor out = at::empty_like(x);
  at::Tensor none;
  norm_rows(x, none, weight, out, none, eps);
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_norm_args(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: residual shaped and typed like x");
  const at::Tensor res = residual.contiguous();
  at::Tensor out = at::empty_like(x);
  at::Tensor residual_out = at::empty_like(x);
  norm_rows(x, res, weight, out, residual_out, eps);
  return {out, residual_out};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvstrata, m) {
#ifdef __AVX512BF16__   // not registered on CPUs without it: paged_kernels.decode_linear_op() is then None
  m.def("decode_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.impl("decode_linear", c10::DispatchKey::CPU, TORCH_FN(decode_linear));
#endif
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.impl("add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm));
}
