// FP8 KV values (--kv-cache-dtype fp8_e4m3 / fp8_e5m2) widened to float32 where the attention kernels read
// them: the stored byte is exact in float32 and in bf16 (3 or 2 mantissa bits), so every kernel computes as
// on the bf16 pool's values, from half the bytes.
//
// e5m2 is the top byte of an IEEE fp16 (same exponent bias 15): (b << 8) as fp16, converted by the F16C /
// AVX-512 instruction. e4m3 (the `fn` variant: bias 7, no infinities) takes the same path: its exponent and
// mantissa shifted to fp16's positions ((b & 0x7F) << 7, sign to bit 15) read as an fp16 of bias 15, so the
// value is 2^-8 of the e4m3 one, subnormals included; one exact multiply by 256 restores it. The NaN bytes
// (0x7F / 0xFF) are never written: the pool saturates (memory/kv_format.py). Scalar code reads a 256-entry
// table built by the same rule.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kvstrata_cpu {

struct Fp8E4M3 { uint8_t bits; };   // the element types of a float8_e4m3fn / float8_e5m2 pool
struct Fp8E5M2 { uint8_t bits; };

template <typename T> struct is_fp8 { static constexpr bool value = false; };
template <> struct is_fp8<Fp8E4M3> { static constexpr bool value = true; };
template <> struct is_fp8<Fp8E5M2> { static constexpr bool value = true; };

// The value of byte b, computed once per format into a table.
inline float fp8_value(uint8_t b, bool e4m3) {
  const int sign = b >> 7;
  float v;
  if (e4m3) {
    const int e = (b >> 3) & 0xF, m = b & 0x7;
    v = e == 0 ? static_cast<float>(m) / 8.0f / 64.0f   // subnormal: m/8 * 2^-6
               : (1.0f + static_cast<float>(m) / 8.0f) * static_cast<float>(1u << e) / 128.0f;
  } else {
    const int e = (b >> 2) & 0x1F, m = b & 0x3;
    if (e == 31) return sign ? -__builtin_inff() : __builtin_inff();   // (not written: saturated)
    v = e == 0 ? static_cast<float>(m) / 4.0f / 16384.0f               // subnormal: m/4 * 2^-14
               : (1.0f + static_cast<float>(m) / 4.0f) * (e >= 15 ? static_cast<float>(1u << (e - 15))
                                                                  : 1.0f / static_cast<float>(1u << (15 - e)));
  }
  return sign ? -v : v;
}

template <typename F>
struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) value[b] = fp8_value(static_cast<uint8_t>(b), std::is_same<F, Fp8E4M3>::value);
  }
};

template <typename F>
inline const float* fp8_table() {
  static const Fp8Table<F> table;
  return table.value;
}

inline float widen(Fp8E4M3 x) { return fp8_table<Fp8E4M3>()[x.bits]; }
inline float widen(Fp8E5M2 x) { return fp8_table<Fp8E5M2>()[x.bits]; }

// The bf16 bits of an FP8 value (exact: its float32's top half).
template <typename F>
inline uint16_t fp8_to_bf16_bits(F x) {
  const float f = widen(x);
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return static_cast<uint16_t>(u >> 16);
}

// A pool element as float32 / as bf16 bits, whatever the pool stores (float, bf16, FP8): what the extend
// tiles' packing reads.
template <typename T>
inline float as_float(T x) {
  if constexpr (is_fp8<T>::value) return widen(x);
  else return static_cast<float>(x);
}
template <typename T>
inline uint16_t as_bf16_bits(T x) {   // T: uint16_t (bf16 bits) or FP8
  if constexpr (is_fp8<T>::value) return fp8_to_bf16_bits(x);
  else return x;
}

#if defined(__AVX2__) && defined(__F16C__)
// 8 bytes' fp16 bit patterns, from their bytes widened to 16 bits.
template <typename F>
inline __m128i fp8_as_half8(__m128i b16) {
  if constexpr (std::is_same<F, Fp8E5M2>::value) {
    return _mm_slli_epi16(b16, 8);
  } else {
    const __m128i sign = _mm_slli_epi16(_mm_and_si128(b16, _mm_set1_epi16(0x80)), 8);
    return _mm_or_si128(sign, _mm_slli_epi16(_mm_and_si128(b16, _mm_set1_epi16(0x7F)), 7));
  }
}

// 8 FP8 values at p as float32.
template <typename F>
inline __m256 load8_fp8(const F* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m256 f = _mm256_cvtph_ps(fp8_as_half8<F>(_mm_cvtepu8_epi16(bytes)));
  return std::is_same<F, Fp8E4M3>::value ? _mm256_mul_ps(f, _mm256_set1_ps(256.0f)) : f;
}
#endif

#ifdef __AVX512F__
// 16 FP8 values at p as float32.
template <typename F>
inline __m512 load16_fp8(const F* p) {
  const __m256i b16 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  __m256i half;
  if constexpr (std::is_same<F, Fp8E5M2>::value) {
    half = _mm256_slli_epi16(b16, 8);
  } else {
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b16, _mm256_set1_epi16(0x80)), 8);
    half = _mm256_or_si256(sign, _mm256_slli_epi16(_mm256_and_si256(b16, _mm256_set1_epi16(0x7F)), 7));
  }
  const __m512 f = _mm512_cvtph_ps(half);
  return std::is_same<F, Fp8E4M3>::value ? _mm512_mul_ps(f, _mm512_set1_ps(256.0f)) : f;
}
#endif

#ifdef __AVX512BF16__
// n FP8 values (n a multiple of 16) as bf16 bits at dst (exact).
template <typename F>
inline void widen_to_bf16(const F* src, uint16_t* dst, int64_t n) {
  for (int64_t c = 0; c < n; c += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(load16_fp8(src + c))));
}
#endif

}  // namespace kvstrata_cpu
