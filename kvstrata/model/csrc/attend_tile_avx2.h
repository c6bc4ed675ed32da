// The float32 paged-attention tile (paged_attention.cpp's attend_tile) with AVX2 + FMA, for CPUs without
// AVX-512 (e.g. Zen 3), head dims 8 * NC.
//
// Scores: 8 keys at a time, their rows widened once into a small float32 block that every query head of
// their KV head then reads from L1; the 8 dot products of a head end in one horizontal-add tree that
// leaves the 8 scores in one vector. Values: the tile's keys are swept once per 16 dims, 16 dims of up to
// four heads accumulating in 8 registers, so each value element is widened once per four heads. Every
// key takes the same lanes and operations whatever the row's length or tile count, so a row's result
// depends only on its query, its keys and the tile size (batch-invariant, as the portable loop).
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include "fp8.h"
#include "vec_math.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace kvstrata_cpu {

template <typename KV>
inline void prefetch_row(const KV* row, int64_t n) {   // every cache line of n elements, into L1
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(KV)); off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
}

// exp(x) for x <= 0, 8 lanes: vec_math.h's exp_cephes, as the portable exp_nonpositive.
inline __m256 exp8(__m256 x) {
  namespace c = exp_cephes;
  x = _mm256_max_ps(x, _mm256_set1_ps(c::kMin));
  const __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(c::kLog2e), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(c::kLn2Hi), x);
  r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(c::kLn2Lo), r);
  __m256 p = _mm256_set1_ps(c::kPoly[0]);
  for (int i = 1; i <= c::kDegree; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c::kPoly[i]));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// Lane j of the result: the sum of a[j]'s 8 lanes (two horizontal-add levels, then the 128-bit halves).
inline __m256 sum_lanes8x8(const __m256* a) {
  const __m256 ab = _mm256_hadd_ps(a[0], a[1]), cd = _mm256_hadd_ps(a[2], a[3]);
  const __m256 ef = _mm256_hadd_ps(a[4], a[5]), gh = _mm256_hadd_ps(a[6], a[7]);
  const __m256 abcd = _mm256_hadd_ps(ab, cd), efgh = _mm256_hadd_ps(ef, gh);
  return _mm256_add_ps(_mm256_permute2f128_ps(abcd, efgh, 0x20), _mm256_permute2f128_ps(abcd, efgh, 0x31));
}

// 16 values from p as two 8-lane vectors: float32 in order; bf16 split into the even dims (0, 2, .., 14) and
// the odd ones (1, 3, .., 15): one 32-byte load, a shift and a mask (a bf16 is the high half of a float32).
inline void load16_split(const float* p, __m256& a, __m256& b) {
  a = _mm256_loadu_ps(p);
  b = _mm256_loadu_ps(p + 8);
}
template <typename F, typename = std::enable_if_t<is_fp8<F>::value>>
inline void load16_split(const F* p, __m256& a, __m256& b) {   // FP8: in order, as float32
  a = load8_fp8(p);
  b = load8_fp8(p + 8);
}
inline __m256 load8(const Fp8E4M3* p) { return load8_fp8(p); }
inline __m256 load8(const Fp8E5M2* p) { return load8_fp8(p); }
inline void load16_split(const c10::BFloat16* p, __m256& a, __m256& b) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  a = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
  b = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// 16 dims of `out` in load16_split's order for KV, and back.
template <typename KV>
inline void split16(const float* out, __m256& a, __m256& b) {
  a = _mm256_loadu_ps(out);
  b = _mm256_loadu_ps(out + 8);
  if constexpr (std::is_same_v<KV, c10::BFloat16>) {
    const __m256 even = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0));   // 0 2 8 10 | 4 6 12 14
    const __m256 odd = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
    a = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(even), 0xD8));
    b = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(odd), 0xD8));
  }
}
template <typename KV>
inline void merge16(float* out, __m256 a, __m256 b) {
  if constexpr (std::is_same_v<KV, c10::BFloat16>) {
    const __m256 lo = _mm256_unpacklo_ps(a, b), hi = _mm256_unpackhi_ps(a, b);   // 0-3 | 8-11, 4-7 | 12-15
    a = _mm256_permute2f128_ps(lo, hi, 0x20);
    b = _mm256_permute2f128_ps(lo, hi, 0x31);
  }
  _mm256_storeu_ps(out, a);
  _mm256_storeu_ps(out + 8, b);
}

// Adds to out[g * D + d0 ..][16] the weighted values of 16 dims [d0, d0 + 16) for GN <= 4 heads whose
// probabilities are rows of `probs` (tile_stride apart), over keys [0, count). Each dim gets the same
// products and sums in the same order whichever lane it takes.
template <int GN, typename KV>
inline void weigh_values16(const KV* v_head, const int64_t* slots, int64_t count, int64_t W, int64_t d0,
                           const float* probs, int64_t tile_stride, float* out, int64_t D) {
  __m256 acc[2 * GN];
  unroll<GN>([&](auto g) { split16<KV>(out + g * D + d0, acc[2 * g], acc[2 * g + 1]); });
  for (int64_t j = 0; j < count; ++j) {
    __m256 v0, v1;
    load16_split(v_head + slots[j] * W + d0, v0, v1);
    unroll<GN>([&](auto g) {
      const __m256 p = _mm256_broadcast_ss(probs + g * tile_stride + j);
      acc[2 * g] = _mm256_fmadd_ps(p, v0, acc[2 * g]);
      acc[2 * g + 1] = _mm256_fmadd_ps(p, v1, acc[2 * g + 1]);
    });
  }
  unroll<GN>([&](auto g) { merge16<KV>(out + g * D + d0, acc[2 * g], acc[2 * g + 1]); });
}

// The scores of 8 keys (float32 rows of `keys`, D apart) against one head's query.
template <int NC>
inline __m256 score8(const float* q, const float* keys) {
  constexpr int64_t D = 8 * NC;
  __m256 acc[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
#pragma GCC unroll 16
  for (int c = 0; c < NC; ++c) {
    const __m256 qv = _mm256_loadu_ps(q + 8 * c);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(_mm256_load_ps(keys + j * D + 8 * c), qv, acc[j]);
  }
  return sum_lanes8x8(acc);
}

// One tile (keys slots[first .. first + count), count <= tile_stride) for every head of one query row:
// partial = [H] max, [H] sum of exp, [H, D] weighted values, as the portable attend_tile. `qf`: the row's
// queries in float32, scaled; `scores`: H * tile_stride floats of scratch (tile_stride a multiple of 8).
template <int NC, typename KV>
[[gnu::flatten]] void attend_tile_avx2(const float* qf, const KV* k_buf, const KV* v_buf, const int64_t* slots,
                                       int64_t first, int64_t count, int64_t heads, int64_t kv_heads,
                                       int64_t tile_stride, float* scores, float* partial) {
  constexpr int64_t D = 8 * NC;
  const int64_t G = heads / kv_heads, W = kv_heads * D;
  const int64_t padded = (count + 7) / 8 * 8;
  alignas(32) float keys[8 * D];
  for (int64_t j0 = 0; j0 < count; j0 += 8) {   // both KV heads of a key block: its rows read front to back
    const int64_t n = std::min<int64_t>(8, count - j0);
    const KV* rows[8];
    for (int64_t j = 0; j < 8; ++j)   // keys past the tile's end repeat its last key; masked below
      rows[j] = k_buf + slots[first + j0 + std::min(j, n - 1)] * W;
    // Fetched while this block is scored: the next block's K rows and this block's V rows, for the value
    // pass (the rows' pages are scattered in the pool: the hardware prefetcher sees no stream across them).
    // A few rows after each head's scores: issued all at once, they fill the core's miss buffers and stall
    // the scoring (measured on Zen 3: ~1.5x slower with the KV in DRAM).
    const KV* fetch[16];
    int64_t fetches = 0, issued = 0;
    for (int64_t j = 0; j < 8; ++j) {
      if (j0 + 8 + j < count) fetch[fetches++] = k_buf + slots[first + j0 + 8 + j] * W;
      if (j < n) fetch[fetches++] = v_buf + slots[first + j0 + j] * W;
    }
    const int64_t per_head = (fetches + heads - 1) / heads;
    for (int64_t kvh = 0; kvh < kv_heads; ++kvh) {
      unroll<8>([&](auto j) {
        unroll<NC>([&](auto c) { _mm256_store_ps(keys + j * D + 8 * c, load8(rows[j] + kvh * D + 8 * c)); });
      });
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = kvh * G + g;
        _mm256_storeu_ps(scores + h * tile_stride + j0, score8<NC>(qf + h * D, keys));
        for (int64_t r = 0; r < per_head && issued < fetches; ++r) prefetch_row(fetch[issued++], W);
      }
    }
  }
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t h = 0; h < heads; ++h) {
    float* sc = scores + h * tile_stride;
    std::fill(sc + count, sc + padded, neg_inf);
    __m256 m8 = _mm256_set1_ps(neg_inf);
    for (int64_t j = 0; j < padded; j += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(sc + j));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m8);
    const float m = *std::max_element(lanes, lanes + 8);
    __m256 l8 = _mm256_setzero_ps();
    for (int64_t j = 0; j < padded; j += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), _mm256_set1_ps(m)));
      _mm256_storeu_ps(sc + j, e);
      if (j + 8 <= count) l8 = _mm256_add_ps(l8, e);
    }
    std::fill(sc + count, sc + padded, 0.0f);   // exp8 clamps -inf to a tiny positive, not 0
    if (count % 8) l8 = _mm256_add_ps(l8, _mm256_loadu_ps(sc + count / 8 * 8));
    partial[h] = m;
    partial[heads + h] = sum_lanes8(l8);
  }
  // Values: blocks of VALUE_BLOCK keys, whose V rows (one KV head) stay in L1 while the block is swept once
  // per 16 dims. The sums carry over from block to block in `partial` (stored and reloaded exactly).
  constexpr int64_t VALUE_BLOCK = 64;
  float* acc_out = partial + 2 * heads;
  std::fill(acc_out, acc_out + heads * D, 0.0f);
  for (int64_t kvh = 0; kvh < kv_heads; ++kvh) {
    const KV* v_head = v_buf + kvh * D;
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
      const int64_t h0 = kvh * G + g0;
      float* out = acc_out + h0 * D;
      for (int64_t j0 = 0; j0 < count; j0 += VALUE_BLOCK) {
        const int64_t n = std::min(VALUE_BLOCK, count - j0);
        const float* probs = scores + h0 * tile_stride + j0;
        const int64_t* sl = slots + first + j0;
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
          switch (std::min<int64_t>(4, G - g0)) {
            case 1: weigh_values16<1>(v_head, sl, n, W, d0, probs, tile_stride, out, D); break;
            case 2: weigh_values16<2>(v_head, sl, n, W, d0, probs, tile_stride, out, D); break;
            case 3: weigh_values16<3>(v_head, sl, n, W, d0, probs, tile_stride, out, D); break;
            default: weigh_values16<4>(v_head, sl, n, W, d0, probs, tile_stride, out, D); break;
          }
        }
      }
    }
  }
}

}  // namespace kvstrata_cpu

#endif  // AVX2 + FMA
