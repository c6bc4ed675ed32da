// Vector math shared by the SIMD kernels of this folder, and the head dims their templates serve.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <type_traits>
#include <utility>

namespace kvstrata_cpu {

// f(std::integral_constant<int64_t, D>{}) for the head dims the bf16 attention kernels are instantiated for
// (paged_kernels.py lists the same); any other raises.
template <typename F>
void with_head_dim(int64_t dim, F&& f) {
  switch (dim) {
    case 16: return f(std::integral_constant<int64_t, 16>{});
    case 32: return f(std::integral_constant<int64_t, 32>{});
    case 64: return f(std::integral_constant<int64_t, 64>{});
    case 128: return f(std::integral_constant<int64_t, 128>{});
    case 256: return f(std::integral_constant<int64_t, 256>{});
    default: TORCH_CHECK(false, "head dim 16, 32, 64, 128 or 256 only, not ", dim);
  }
}

// exp(x) for x <= 0 in the float32 paged-attention kernels (paged_attention.cpp's portable exp_nonpositive and
// AVX-512 exp16, attend_tile_avx2.h's exp8), Cephes-style: x = n ln2 + r with ln2 in two parts for an exact
// reduction, e^r = 1 + r + r^2 p(r) with p of degree 5 (about 1 ulp), times 2^n built from the exponent bits.
namespace exp_cephes {
constexpr float kMin = -87.0f;                                   // e^-87 still has a normal float32 2^n
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr int kDegree = 5;
constexpr float kPoly[kDegree + 1] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                      4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};   // highest first
}  // namespace exp_cephes

// f(integral_constant<int, i>) for i < Count, unrolled. An accumulator array stays in registers only where
// it is indexed by constants in one inlined body: GCC keeps a loop-indexed or by-reference vector array in
// memory and stores it on every iteration.
template <int Count, typename F>
[[gnu::always_inline]] inline void unroll(F&& f) {
  [&]<int... I>(std::integer_sequence<int, I...>) { (f(std::integral_constant<int, I>{}), ...); }(
      std::make_integer_sequence<int, Count>{});
}

}  // namespace kvstrata_cpu

#ifdef __AVX512F__
#include <immintrin.h>

namespace kvstrata_cpu {

// e^r for |r| <= ln2/2: degree-6 Taylor in Horner form (relative error ~2e-7). Callers split their argument
// as x = n * ln2 + r (or 2^x as 2^n * e^(f ln2)) and scale the result by 2^n with _mm512_scalef_ps.
inline __m512 exp_reduced(__m512 r) {
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
}

// 2^x for x <= 0 (x = a log2-scaled score minus the running max): 2^n * e^(f ln 2), f in [-0.5, 0.5]
// (relative error ~2e-7, far below the bf16 rounding the probabilities then get).
inline __m512 exp2_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 t = _mm512_mul_ps(_mm512_sub_ps(x, n), _mm512_set1_ps(0.69314718055994531f));
  return _mm512_scalef_ps(exp_reduced(t), n);
}

// 2^x for -126 <= x <= 127 to 7.5e-5 relative: 2^n times a degree-3 minimax fit of 2^f on [-0.5, 0.5]. For
// probabilities that are rounded to bf16 next (2^-9 relative) and summed in float32: the AMX extend tile.
inline __m512 exp2_coarse(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.0551713444f), f, _mm512_set1_ps(0.242610335f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.693260968f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.999928117f));
  return _mm512_scalef_ps(p, n);
}

// v rounded to bf16 as c10::BFloat16 rounds each lane (to nearest, ties to even; NaN to 0x7FC0), kept in
// float32: the low 16 bits cleared in place. Not _mm512_cvtneps_pbh: Intel's conversion flushes denormal
// inputs and results to zero (AMD's keeps them), where torch keeps every denormal.
inline __m512 round_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_and_si512(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))),
                               _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
  return _mm512_castsi512_ps(r);
}

// 16 float32 rounded to bf16 (round_bf16), packed.
inline __m256i pack_bf16x16(__m512 v) {
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(round_bf16(v)), 16));
}

// 16 bf16 (the `live` lanes; the others 0) widened to float32.
inline __m512 load_bf16x16(const uint16_t* p, __mmask16 live) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, p)), 16));
}

#ifdef __AVX512BF16__
// acc + the products of a and b's bf16 pairs (lane i: a[2i] b[2i] + a[2i+1] b[2i+1], float32).
inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
}
#endif

}  // namespace kvstrata_cpu

#endif  // __AVX512F__

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace kvstrata_cpu {

// 8 float32 from float32, or from bf16 exactly (a bf16 is the high half of a float32: zero-extend, shift 16).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const c10::BFloat16* p) { return load8(reinterpret_cast<const uint16_t*>(p)); }

// v rounded to bf16 as c10::BFloat16 rounds each lane (to nearest, ties to even; NaN to 0x7FC0), kept in
// float32: the low 16 bits cleared in place.
inline __m256 round_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_and_si256(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))),
                               _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  return _mm256_castsi256_ps(r);
}

// 8 float32 rounded to bf16 (round_bf16), packed.
inline __m128i pack_bf16x8(__m256 v) {
  const __m256i r = _mm256_srli_epi32(_mm256_castps_si256(round_bf16(v)), 16);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8));   // lanes 0-7 first
}

inline float sum_lanes8(__m256 v) {   // a fixed tree: halves, then pairs, then the last two
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace kvstrata_cpu

#endif  // AVX2 + FMA
