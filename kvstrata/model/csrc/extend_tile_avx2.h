// The extend-attention tile of CPUs with AVX2 + FMA and no AVX-512 BF16 (e.g. Zen 3; extend_attention.cpp
// drives it), for bf16 or float32 models: float32 arithmetic throughout (a bf16 value widens exactly).
//
// A unit's (sequence, KV head) key blocks are packed once into float32: K transposed, [D][KB] (dim d of
// the block's KB keys side by side), V as it is, [KB][D]. Both products then run as small GEMMs with no
// horizontal sums: a score tile of MR rows x KB keys broadcasts one query element per dim against two
// 8-key vectors, and the weighted values broadcast one probability per key against 16 dims of V. Softmax
// is online over the blocks counted from key 0, so a row's result depends only on its query, its keys and
// KB, never on the chunk, the batch, its place in a tile or the thread count.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512BF16__)
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "attend_tile_avx2.h"   // exp8
#include "extend_plan.h"
#include "fp8.h"
#include "vec_math.h"

namespace kvstrata_cpu {

template <typename T>   // float or c10::BFloat16: q, K, V and the output
struct ExtendTileAvx2 {
  using Scalar = T;
  using PackWord = float;
  static constexpr int64_t KB = 16;   // keys per block: two 8-lane score vectors per row
  static constexpr int64_t QB = 16;   // query positions per task
  static constexpr int MR = 4;        // score rows per register tile: 8 accumulators
  static int64_t block_words(int64_t dim) { return dim * KB; }   // of K, and of V

  // Keys [first, first + count) of one KV head into a K block [D][KB] and a V block [KB][D]; keys past the
  // sequence's end are zero (and masked).
  // KV: T, or FP8 (widened here, exactly).
  template <typename KV>
  static void pack_block(const KV* k_buf, const KV* v_buf, const int64_t* slots, int64_t first, int64_t count,
                         int64_t kvh, const ExtendDims& d, float* kp, float* vp) {
    const int64_t D = d.dim, row = d.kv_heads * D;
    if (count < KB) {
      std::memset(kp, 0, sizeof(float) * D * KB);
      std::memset(vp, 0, sizeof(float) * KB * D);
    }
    for (int64_t j = 0; j < count; ++j) {
      const KV* k = k_buf + slots[first + j] * row + kvh * D;
      const KV* v = v_buf + slots[first + j] * row + kvh * D;
      for (int64_t c = 0; c < D; ++c) kp[c * KB + j] = as_float(k[c]);
      for (int64_t c = 0; c < D; ++c) vp[j * D + c] = as_float(v[c]);
    }
  }

  // One task's rows: position i (0-based in the extend) and head g, row r = (i - i0) * group + g.
  template <int64_t D>
  static void attend_task(const T* q, const ExtendSeq& s, int64_t kvh, int64_t i0, int64_t i1, const ExtendDims& d,
                          const float* kpack, const float* vpack, double scale, T* out) {
    const int64_t G = d.group, R = (i1 - i0) * G, H = d.heads, RP = R + MR;
    // MR padding rows past R let the last register tile have MR rows; their results are never read.
    std::vector<float> qf(RP * D, 0.0f), o(RP * D, 0.0f), m(RP, -std::numeric_limits<float>::infinity()),
        l(RP, 0.0f), probs(RP * KB);
    std::vector<int64_t> limit(RP, std::numeric_limits<int64_t>::max() / 2);   // the last key a row sees
    const float sc = static_cast<float>(scale);
    for (int64_t r = 0; r < R; ++r) {   // queries widened and scaled once
      const int64_t i = i0 + r / G, g = r % G;
      limit[r] = s.prefix + i;
      const T* src = q + ((s.q_start + i) * H + kvh * G + g) * D;
      for (int64_t c = 0; c < D; ++c) qf[r * D + c] = static_cast<float>(src[c]) * sc;
    }
    const int64_t last_block = limit[R - 1] / KB;
    int64_t first_row = 0;   // rows are ordered by limit: those that end before a block skip it
    for (int64_t b = 0; b <= last_block; ++b) {
      const int64_t k0 = b * KB;
      while (first_row < R && limit[first_row] < k0) ++first_row;
      for (int64_t r0 = first_row; r0 < R; r0 += MR)
        tile<D>(qf.data() + r0 * D, kpack + b * D * KB, vpack + b * KB * D, limit.data() + r0, k0, m.data() + r0,
                l.data() + r0, probs.data() + r0 * KB, o.data() + r0 * D);
    }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t i = i0 + r / G, g = r % G;
      T* dst = out + ((s.q_start + i) * H + kvh * G + g) * D;
      const float inv = 1.0f / l[r];
      for (int64_t c = 0; c < D; ++c) dst[c] = static_cast<T>(o[r * D + c] * inv);
    }
  }

  // MR rows against one block of KB keys (first key k0): scores, the online softmax update of m and l, and
  // o = o * alpha + probs . V.
  template <int64_t D>
  [[gnu::always_inline]] static inline void tile(const float* qf, const float* kp, const float* vp,
                                                 const int64_t* limit, int64_t k0, float* m, float* l, float* probs,
                                                 float* o) {
    alignas(32) float scores[MR * KB];
    alignas(32) float alpha[8];
    score_tile<D>(qf, kp, scores);
    // Rows are ordered by limit, so when the first row sees the whole block every row does: only blocks on
    // the causal diagonal need masks. Once no row's max moves (most blocks), alpha is exactly 1 and o is
    // not rescaled. Both shortcuts give the same bits as the general path.
    const bool moved = limit[0] - k0 + 1 >= KB ? softmax<false>(scores, limit, k0, m, l, probs, alpha)
                                               : softmax<true>(scores, limit, k0, m, l, probs, alpha);
    if (moved)
      weigh_values<D, true>(probs, vp, alpha, o);
    else
      weigh_values<D, false>(probs, vp, alpha, o);
  }

  // The online softmax of one block for MR rows: each row's max m and sum l updated, probs = exp(scores - m)
  // (hidden keys exactly 0), alpha = exp(m_old - m_new). Returns whether any row's max moved (else alpha is 1).
  template <bool Masked>
  [[gnu::always_inline]] static inline bool softmax(float* scores, const int64_t* limit, int64_t k0, float* m,
                                                    float* l, float* probs, float* alpha) {
    const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    alignas(32) float shift[8] = {0};   // m_old - m_new per row: exp gives alpha
    bool moved = false;
    for (int r = 0; r < MR; ++r) {
      __m256 s0 = _mm256_load_ps(scores + r * KB), s1 = _mm256_load_ps(scores + r * KB + 8);
      if constexpr (Masked) {
        const __m256 visible = _mm256_set1_ps(static_cast<float>(limit[r] - k0 + 1));   // >= 1
        const __m256 lane0 = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), lane1 = _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15);
        s0 = _mm256_blendv_ps(neg_inf, s0, _mm256_cmp_ps(lane0, visible, _CMP_LT_OQ));
        s1 = _mm256_blendv_ps(neg_inf, s1, _mm256_cmp_ps(lane1, visible, _CMP_LT_OQ));
        _mm256_store_ps(scores + r * KB, s0);
        _mm256_store_ps(scores + r * KB + 8, s1);
      }
      const float m_new = std::max(m[r], max_lanes8(_mm256_max_ps(s0, s1)));
      shift[r] = m[r] - m_new;   // -inf on a row's first block: alpha ~0 then scales o = 0 and l = 0
      moved |= m_new != m[r];
      m[r] = m_new;
    }
    if (moved) _mm256_store_ps(alpha, exp8(_mm256_load_ps(shift)));
    for (int r = 0; r < MR; ++r) {
      const __m256 mr = _mm256_set1_ps(m[r]);
      const __m256 s0 = _mm256_load_ps(scores + r * KB), s1 = _mm256_load_ps(scores + r * KB + 8);
      __m256 p0 = exp8(_mm256_sub_ps(s0, mr)), p1 = exp8(_mm256_sub_ps(s1, mr));
      if constexpr (Masked) {   // hidden keys (-inf) get exactly 0: exp8 clamps -inf to a tiny positive
        p0 = _mm256_and_ps(p0, _mm256_cmp_ps(s0, neg_inf, _CMP_NEQ_OQ));
        p1 = _mm256_and_ps(p1, _mm256_cmp_ps(s1, neg_inf, _CMP_NEQ_OQ));
      }
      const float sum = sum_lanes8(_mm256_add_ps(p0, p1));
      l[r] = moved ? l[r] * alpha[r] + sum : l[r] + sum;   // l * 1 + sum is l + sum
      _mm256_storeu_ps(probs + r * KB, p0);
      _mm256_storeu_ps(probs + r * KB + 8, p1);
    }
    return moved;
  }

  // The products and sums below live in their own functions: inlined into the tile, GCC kept the
  // accumulators in memory and stored them on every step (2.5x slower, measured).

  // scores[r * KB + j] = qf row r . K key j, for the MR rows of `qf` (D apart) and the block's KB keys.
  template <int64_t D>
  [[gnu::noinline]] static void score_tile(const float* qf, const float* kp, float* scores) {
    __m256 acc[MR][2];
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int64_t c = 0; c < D; ++c) {
      const __m256 ka = _mm256_loadu_ps(kp + c * KB), kb = _mm256_loadu_ps(kp + c * KB + 8);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m256 qq = _mm256_broadcast_ss(qf + r * D + c);
        acc[r][0] = _mm256_fmadd_ps(qq, ka, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(qq, kb, acc[r][1]);
      }
    }
    for (int r = 0; r < MR; ++r) {
      _mm256_store_ps(scores + r * KB, acc[r][0]);
      _mm256_store_ps(scores + r * KB + 8, acc[r][1]);
    }
  }

  // o[r] = o[r] * alpha[r] (Rescale; else alpha is 1) + sum over the block's keys j of probs[r * KB + j] * V[j],
  // 16 dims at a time.
  template <int64_t D, bool Rescale>
  [[gnu::noinline]] static void weigh_values(const float* probs, const float* vp, const float* alpha, float* o) {
    for (int64_t c0 = 0; c0 < D; c0 += 16) {
      __m256 acc[MR][2];
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        acc[r][0] = _mm256_loadu_ps(o + r * D + c0);
        acc[r][1] = _mm256_loadu_ps(o + r * D + c0 + 8);
        if constexpr (Rescale) {
          const __m256 a = _mm256_set1_ps(alpha[r]);
          acc[r][0] = _mm256_mul_ps(acc[r][0], a);
          acc[r][1] = _mm256_mul_ps(acc[r][1], a);
        }
      }
#pragma GCC unroll 4
      for (int64_t j = 0; j < KB; ++j) {
        const __m256 va = _mm256_loadu_ps(vp + j * D + c0), vb = _mm256_loadu_ps(vp + j * D + c0 + 8);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          const __m256 p = _mm256_broadcast_ss(probs + r * KB + j);
          acc[r][0] = _mm256_fmadd_ps(p, va, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(p, vb, acc[r][1]);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        _mm256_storeu_ps(o + r * D + c0, acc[r][0]);
        _mm256_storeu_ps(o + r * D + c0 + 8, acc[r][1]);
      }
    }
  }

  static float max_lanes8(__m256 v) {   // a fixed tree, as sum_lanes8
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
  }
};

}  // namespace kvstrata_cpu

#endif  // AVX2 + FMA, no AVX-512 BF16
