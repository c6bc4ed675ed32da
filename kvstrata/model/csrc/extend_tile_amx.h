// The extend-attention tile of CPUs with AMX (Intel Xeon, Sapphire Rapids on): both products on the tile
// unit (`tdpbf16ps`: bf16 products, float32 sums, 16 rows at a time), softmax in AVX-512. On an AVX-512 BF16
// CPU the dot-product tile (extend_tile_avx512bf16.h) spends ~3/4 of a prefill's attention in the two
// products; here they cost little and the exponentials are what is left.
//
// It reads the dot-product tile's packed blocks as they are: a K block, [D/2][KB] bf16 pairs, is the tile
// unit's B operand of Q K^T (rows: pairs along the head dim, columns: keys), and a V block, [KB/2][D] pairs
// of consecutive keys, its B operand of P V (rows: key pairs, columns: the head dim). Per key block and 16
// rows: scores into two 16x16 float32 tiles, stored; softmax online (the same block boundaries, counted from
// key 0); the probabilities, rounded to bf16, are the A operand of P V, accumulated into the float32 rows
// of o, which are rescaled first only where a row's max moved. Every row's arithmetic is its own (a tile
// row's sums do not depend on the other rows), so a row's bits do not depend on its chunk or batch.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KVSTRATA_EXTEND_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "extend_plan.h"
#include "extend_tile_avx512bf16.h"
#include "vec_math.h"

namespace kvstrata_cpu {

// Linux hands out the tile registers' state only to a process that asks for it (once, for all its threads).
inline bool amx_permitted() {
  static const bool granted = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

struct ExtendTileAmx : ExtendTileBf16Dot {   // the same block size and packed layouts
  static constexpr int TR = 16;   // rows per tile

  // Tiles: 0, 1 scores of keys 0-15 / 16-31; 2 a chunk of q (up to 32 dims); 3 the K pairs of that chunk;
  // 4 the probabilities; 5 V pairs of 16 columns; 6 o's 16 columns.
  struct alignas(64) Config {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  };

  static void configure(int64_t dim) {
    Config c;
    const int chunk = static_cast<int>(std::min<int64_t>(dim, 32));   // head dims per q . K product
    for (int t = 0; t < 7; ++t) { c.rows[t] = TR; c.colsb[t] = 64; }
    c.colsb[2] = static_cast<uint16_t>(chunk * 2);
    c.rows[3] = static_cast<uint8_t>(chunk / 2);
    _tile_loadconfig(&c);
  }

  template <int64_t D>
  static void attend_task(const uint16_t* q, const ExtendSeq& s, int64_t kvh, int64_t i0, int64_t i1, const ExtendDims& d,
                          const uint32_t* kpack, const uint32_t* vpack, double scale, uint16_t* out) {
    const float scale_log2 = static_cast<float>(scale * 1.4426950408889634);
    constexpr int64_t CH = D < 32 ? D : 32;   // head dims per q . K chunk
    const int64_t G = d.group, R = (i1 - i0) * G, H = d.heads, RP = R + TR;   // TR padding rows
    // q rows gathered contiguous (the tile unit reads rows at one stride); padding rows are zero.
    std::vector<uint16_t> qrows(RP * D, 0);
    std::vector<float> o(RP * D, 0.0f), m(RP, -std::numeric_limits<float>::infinity()), l(RP, 0.0f);
    std::vector<int64_t> limit(RP, std::numeric_limits<int64_t>::max() / 2);   // last key a row sees
    alignas(64) float scores[TR * KB];
    alignas(64) uint32_t probs[TR * (KB / 2)];
    for (int64_t r = 0; r < R; ++r) {
      const int64_t i = i0 + r / G, g = r % G;
      limit[r] = s.prefix + i;
      std::memcpy(qrows.data() + r * D, q + ((s.q_start + i) * H + kvh * G + g) * D, D * sizeof(uint16_t));
    }
    configure(D);
    const int64_t last_block = limit[R - 1] / KB;
    const int64_t block_words = (D / 2) * KB;
    const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t b = 0; b <= last_block; ++b) {
      const uint32_t* kp = kpack + b * block_words;
      const uint32_t* vp = vpack + b * block_words;
      const int64_t k0 = b * KB;
      int64_t first_row = 0;                 // rows are ordered by limit: skip those that end before k0
      while (first_row < R && limit[first_row] < k0) ++first_row;
      for (int64_t r0 = first_row; r0 < R; r0 += TR) {
        // Scores of 16 rows x 32 keys.
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t c = 0; c < D; c += CH) {
          _tile_loadd(2, qrows.data() + r0 * D + c, D * sizeof(uint16_t));
          _tile_loadd(3, kp + (c / 2) * KB, KB * sizeof(uint32_t));
          _tile_dpbf16ps(0, 2, 3);
          _tile_loadd(3, kp + (c / 2) * KB + 16, KB * sizeof(uint32_t));
          _tile_dpbf16ps(1, 2, 3);
        }
        _tile_stored(0, scores, KB * sizeof(float));
        _tile_stored(1, scores + 16, KB * sizeof(float));
        // Softmax, online: each row's max, its o and l rescaled where the max moved, bf16 probabilities.
        for (int r = 0; r < TR; ++r) {
          const int64_t row = r0 + r;
          const int64_t visible = limit[row] - k0 + 1;   // keys of this block the row sees (>= 1)
          const __mmask16 v0 = visible >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << visible) - 1);
          const __mmask16 v1 = visible >= 32 ? 0xFFFF : visible <= 16 ? 0 : static_cast<__mmask16>((1u << (visible - 16)) - 1);
          const __m512 s0 = _mm512_mask_mul_ps(neg_inf, v0, _mm512_load_ps(scores + r * KB), _mm512_set1_ps(scale_log2));
          const __m512 s1 = _mm512_mask_mul_ps(neg_inf, v1, _mm512_load_ps(scores + r * KB + 16), _mm512_set1_ps(scale_log2));
          const float m_old = m[row];
          const float m_new = std::max(m_old, _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)));
          const __m512 mr = _mm512_set1_ps(m_new);
          // Hidden keys (-inf) get exactly 0: the exp2 clamp alone would leave 2^-126.
          const __m512 p0 = _mm512_maskz_mov_ps(v0, exp2_nonpositive(_mm512_sub_ps(s0, mr)));
          const __m512 p1 = _mm512_maskz_mov_ps(v1, exp2_nonpositive(_mm512_sub_ps(s1, mr)));
          const float row_sum = _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
          _mm512_store_si512(probs + r * (KB / 2), reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p1, p0)));
          if (m_new != m_old) {   // a row's first block has o = 0, l = 0: any factor leaves them so
            const float alpha = _mm512_cvtss_f32(exp2_nonpositive(_mm512_set1_ps(m_old - m_new)));
            const __m512 a = _mm512_set1_ps(alpha);
            float* orow = o.data() + row * D;
            for (int64_t c = 0; c < D; c += 16) _mm512_storeu_ps(orow + c, _mm512_mul_ps(_mm512_loadu_ps(orow + c), a));
            l[row] *= alpha;
            m[row] = m_new;
          }
          l[row] += row_sum;
        }
        // o += P V, 16 columns at a time.
        _tile_loadd(4, probs, (KB / 2) * sizeof(uint32_t));
        for (int64_t c = 0; c < D; c += 16) {
          _tile_loadd(6, o.data() + r0 * D + c, D * sizeof(float));
          _tile_loadd(5, vp + c, D * sizeof(uint32_t));
          _tile_dpbf16ps(6, 4, 5);
          _tile_stored(6, o.data() + r0 * D + c, D * sizeof(float));
        }
      }
    }
    _tile_release();
    for (int64_t r = 0; r < R; ++r) {
      const int64_t i = i0 + r / G, g = r % G;
      uint16_t* dst = out + ((s.q_start + i) * H + kvh * G + g) * D;
      const float inv = 1.0f / l[r];
      for (int64_t c = 0; c < D; ++c) dst[c] = c10::BFloat16(o[r * D + c] * inv).x;
    }
  }
};

}  // namespace kvstrata_cpu

#endif  // AMX
