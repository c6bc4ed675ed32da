// The extend-attention tile of CPUs with AVX-512 BF16 (extend_attention.cpp drives it): bf16 dot products
// with float32 accumulation (`vdpbf16ps`, twice the float32 FMA rate). Scores = Q K^T, then the
// probabilities, rounded to bf16, times V; softmax online over blocks of KB keys counted from key 0.
//
// A unit's (sequence, KV head) key blocks are packed once into the layouts the dot product wants: K as
// [D/2][KB] pairs along the head dim, V as [KB/2][D] pairs of consecutive keys. A task (QB query positions x
// the heads sharing the KV head) walks the unit's blocks: MR-row score tiles in registers, softmax, and the
// weighted V added into float32 rows.
#pragma once

#ifdef __AVX512BF16__
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "extend_plan.h"
#include "fp8.h"
#include "vec_math.h"

namespace kvstrata_cpu {

struct ExtendTileBf16Dot {
  using Scalar = uint16_t;     // q, K, V and the output: bf16 bits
  using PackWord = uint32_t;   // a bf16 pair
  static constexpr int64_t KB = 32;   // keys per block: two 16-lane score vectors per row
  static constexpr int64_t QB = 16;   // query positions per task
  static constexpr int MR = 8;        // score rows held in registers at a time
  static int64_t block_words(int64_t dim) { return (dim / 2) * KB; }   // of K, and of V

  // K block: [D/2][KB] uint32, lane j = (K[j][2p], K[j][2p+1]); V block: [KB/2][D] uint32, lane d =
  // (V[2q][d], V[2q+1][d]). Keys past the sequence's end are zero (and masked). KV: uint16_t (bf16 bits) or
  // FP8, widened to bf16 here (exact).
  template <typename KV>
  static void pack_block(const KV* k_buf, const KV* v_buf, const int64_t* slots, int64_t first,
                  int64_t count, int64_t kvh, const ExtendDims& d, uint32_t* kp, uint32_t* vp) {
    const int64_t D = d.dim, row = d.kv_heads * D;
    std::memset(kp, 0, sizeof(uint32_t) * (D / 2) * KB);
    std::memset(vp, 0, sizeof(uint32_t) * (KB / 2) * D);
    for (int64_t j = 0; j < count; ++j) {
      const KV* k = k_buf + slots[first + j] * row + kvh * D;
      for (int64_t p = 0; p < D / 2; ++p)
        kp[p * KB + j] = as_bf16_bits(k[2 * p]) | static_cast<uint32_t>(as_bf16_bits(k[2 * p + 1])) << 16;
      const KV* v = v_buf + slots[first + j] * row + kvh * D;
      uint16_t* dst = reinterpret_cast<uint16_t*>(vp + (j / 2) * D) + (j % 2);
      for (int64_t c = 0; c < D; ++c) dst[2 * c] = as_bf16_bits(v[c]);
    }
  }

  // One task's rows: position i (0-based in the extend) and head g, row r = (i - i0) * group + g.
  // kpack / vpack: the unit's packed blocks, block b at b * D/2 * KB words.
  template <int64_t D>
  static void attend_task(const uint16_t* q, const ExtendSeq& s, int64_t kvh, int64_t i0, int64_t i1, const ExtendDims& d,
                   const uint32_t* kpack, const uint32_t* vpack, double scale, uint16_t* out) {
    const float scale_log2 = static_cast<float>(scale * 1.4426950408889634);
    constexpr int64_t P = D / 2, NC = D / 16;
    const int64_t G = d.group, R = (i1 - i0) * G, H = d.heads;
    // MR padding rows past R let every register tile have MR rows (fixed loop bounds keep tiles in registers).
    std::vector<float> o((R + MR) * D, 0.0f), m(R + MR, -std::numeric_limits<float>::infinity()), l(R + MR, 0.0f),
        alpha(R + MR);
    std::vector<int64_t> limit(R + MR, std::numeric_limits<int64_t>::max() / 2);   // last key a row sees
    std::vector<uint32_t> probs((R + MR) * (KB / 2));
    std::vector<const uint32_t*> qrow(R + MR);
    static const uint32_t zeros[P] = {0};
    for (int64_t r = 0; r < R; ++r) {
      const int64_t i = i0 + r / G, g = r % G;
      limit[r] = s.prefix + i;
      qrow[r] = reinterpret_cast<const uint32_t*>(q + ((s.q_start + i) * H + kvh * G + g) * D);
    }
    for (int64_t r = R; r < R + MR; ++r) qrow[r] = zeros;   // padding rows of the last register tile
    const int64_t last_block = limit[R - 1] / KB;
    const int64_t block_words = P * KB;   // = (KB / 2) * D
    for (int64_t b = 0; b <= last_block; ++b) {
      const uint32_t* kp = kpack + b * block_words;
      const uint32_t* vp = vpack + b * block_words;
      const int64_t k0 = b * KB;
      int64_t first_row = 0;                 // rows are ordered by limit: skip those that end before k0
      while (first_row < R && limit[first_row] < k0) ++first_row;
      for (int64_t r0 = first_row; r0 < R; r0 += MR) {
        __m512 acc[MR][2];
        for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int64_t p = 0; p < P; ++p) {
          const __m512i ka = _mm512_loadu_si512(kp + p * KB), kb = _mm512_loadu_si512(kp + p * KB + 16);
          for (int r = 0; r < MR; ++r) {
            const __m512i qq = _mm512_set1_epi32(static_cast<int>(qrow[r0 + r][p]));
            acc[r][0] = dot_pairs(acc[r][0], ka, qq);
            acc[r][1] = dot_pairs(acc[r][1], kb, qq);
          }
        }
        // Softmax of the MR rows (padding rows past R included: their results land in padding slots).
        alignas(64) float block_max[16], row_sum[16];
        __m512 sc[MR][2];
        for (int r = 0; r < MR; ++r) {
          const int64_t visible = limit[r0 + r] - k0 + 1;   // keys of this block the row sees (>= 1)
          const __mmask16 v0 = visible >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << visible) - 1);
          const __mmask16 v1 = visible >= 32 ? 0xFFFF : visible <= 16 ? 0 : static_cast<__mmask16>((1u << (visible - 16)) - 1);
          const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
          sc[r][0] = _mm512_mask_blend_ps(v0, neg_inf, _mm512_mul_ps(acc[r][0], _mm512_set1_ps(scale_log2)));
          sc[r][1] = _mm512_mask_blend_ps(v1, neg_inf, _mm512_mul_ps(acc[r][1], _mm512_set1_ps(scale_log2)));
          block_max[r] = _mm512_reduce_max_ps(_mm512_max_ps(sc[r][0], sc[r][1]));
        }
        const __m256 m_old = _mm256_loadu_ps(m.data() + r0);
        const __m256 m_new = _mm256_max_ps(m_old, _mm256_load_ps(block_max));
        _mm256_storeu_ps(m.data() + r0, m_new);
        const __m256 a8 = _mm512_castps512_ps256(exp2_nonpositive(_mm512_castps256_ps512(_mm256_sub_ps(m_old, m_new))));
        _mm256_storeu_ps(alpha.data() + r0, a8);   // 0 on a row's first block (m_old = -inf)
        for (int r = 0; r < MR; ++r) {
          const __m512 mr = _mm512_set1_ps(m[r0 + r]);
          // Hidden keys (-inf) get exactly 0: the exp2 clamp alone would leave 2^-126.
          const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
          const __mmask16 v0 = _mm512_cmp_ps_mask(sc[r][0], neg_inf, _CMP_NEQ_OQ);
          const __mmask16 v1 = _mm512_cmp_ps_mask(sc[r][1], neg_inf, _CMP_NEQ_OQ);
          const __m512 p0 = _mm512_maskz_mov_ps(v0, exp2_nonpositive(_mm512_sub_ps(sc[r][0], mr)));
          const __m512 p1 = _mm512_maskz_mov_ps(v1, exp2_nonpositive(_mm512_sub_ps(sc[r][1], mr)));
          row_sum[r] = _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
          const __m512bh pb = _mm512_cvtne2ps_pbh(p1, p0);   // keys 0..15 from p0, 16..31 from p1
          _mm512_storeu_si512(probs.data() + (r0 + r) * (KB / 2), reinterpret_cast<__m512i>(pb));
        }
        _mm256_storeu_ps(l.data() + r0, _mm256_fmadd_ps(_mm256_loadu_ps(l.data() + r0), a8, _mm256_load_ps(row_sum)));
        // o[row] = o[row] * alpha + probs . V, RG rows at a time (16 accumulators).
        constexpr int RG = std::min<int>(16 / NC, MR);
        for (int rg = 0; rg < MR; rg += RG) {
          __m512 oa[RG][NC];
          for (int r = 0; r < RG; ++r) {
            const __m512 a = _mm512_set1_ps(alpha[r0 + rg + r]);
            for (int c = 0; c < NC; ++c) oa[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o.data() + (r0 + rg + r) * D + 16 * c), a);
          }
          for (int64_t pq = 0; pq < KB / 2; ++pq) {
            __m512i vv[NC];
            for (int c = 0; c < NC; ++c) vv[c] = _mm512_loadu_si512(vp + pq * D + 16 * c);
            for (int r = 0; r < RG; ++r) {
              const __m512i pp = _mm512_set1_epi32(static_cast<int>(probs[(r0 + rg + r) * (KB / 2) + pq]));
              for (int c = 0; c < NC; ++c) oa[r][c] = dot_pairs(oa[r][c], vv[c], pp);
            }
          }
          for (int r = 0; r < RG; ++r)
            for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o.data() + (r0 + rg + r) * D + 16 * c, oa[r][c]);
        }
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t i = i0 + r / G, g = r % G;
      uint16_t* dst = out + ((s.q_start + i) * H + kvh * G + g) * D;
      const float inv = 1.0f / l[r];
      for (int64_t c = 0; c < D; ++c) dst[c] = c10::BFloat16(o[r * D + c] * inv).x;
    }
  }
};

}  // namespace kvstrata_cpu

#endif  // __AVX512BF16__
