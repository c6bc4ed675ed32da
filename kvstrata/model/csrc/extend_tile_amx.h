// The extend-attention tile of CPUs with AMX (Intel Xeon, Sapphire Rapids on): both products on the tile
// unit (`tdpbf16ps`: bf16 products, float32 sums), the softmax in AVX-512. On an AVX-512 BF16 CPU the
// dot-product tile (extend_tile_avx512bf16.h) spends ~3/4 of a prefill's attention in the two products;
// here they cost little, and the softmax is laid out so that it needs no horizontal sums.
//
// Transposed: a group of 16 query rows is the tile unit's 16 columns. Per block of KB keys, S^T = K Q^T
// ([key][row] float32, so one vector holds one key's score in each of the 16 rows), then the softmax runs
// down the keys with the rows in lanes (max, exp2, sums: vertical), and O^T += V^T P^T accumulates
// [head dim][row] in tile registers (head dims up to 64; larger ones in memory). Rescaling is lazy: a row's
// running max moves only when a block's max exceeds it by more than kLazyLog2 (probabilities stay <= 2^8),
// so o^T leaves the tile registers about once per row group instead of in almost every block (with 16 rows
// per group, some row's max moves in most blocks). Blocks are packed per unit (sequence, KV head): K as
// [KB][D] bf16, V transposed as [D][KB].
// A row's arithmetic never involves another row (a tile's column sums only its own products), so a row's
// bits do not depend on the chunk or batch it runs in; softmax blocks are counted from key 0.
#pragma once

#include "amx_tiles.h"

#if defined(KVSTRATA_AMX) && defined(__AVX512BF16__)
#define KVSTRATA_EXTEND_AMX 1
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "extend_plan.h"
#include "fp8.h"
#include "vec_math.h"

namespace kvstrata_cpu {

// o^T's tile J is tmm(4 + J). GCC's tile intrinsics paste the register number into the assembly, so each
// gets its own literal.
template <int J>
struct OTile;
#define KVSTRATA_O_TILE(N)                                                    \
  template <>                                                                 \
  struct OTile<N - 4> {                                                       \
    static void zero() { _tile_zero(N); }                                     \
    static void load(const float* p) { _tile_loadd(N, p, 16 * sizeof(float)); } \
    static void store(float* p) { _tile_stored(N, p, 16 * sizeof(float)); }   \
    static void add_pv() { _tile_dpbf16ps(N, 1, 0); }   /* += V^T (tmm1) P^T (tmm0) */ \
  };
KVSTRATA_O_TILE(4)
KVSTRATA_O_TILE(5)
KVSTRATA_O_TILE(6)
KVSTRATA_O_TILE(7)
#undef KVSTRATA_O_TILE

struct ExtendTileAmx {
  using Scalar = uint16_t;     // q, K, V and the output: bf16 bits
  using PackWord = uint32_t;   // two bf16
  static constexpr int64_t KB = 32;   // keys per block
  static constexpr int64_t QB = 16;   // query positions per task
  static constexpr int TR = 16;       // rows per group: the tile unit's columns
  static constexpr float kLazyLog2 = 8.0f;   // a row's max moves only by more than this (log2 units)
  static int64_t block_words(int64_t dim) { return dim * KB / 2; }   // of K, and of V

  // K block: [KB][D] bf16 (rows of the pool, copied); V block: [D][KB] bf16 (transposed). Keys past the
  // sequence's end are zero (and masked).
  // KV: uint16_t (bf16 bits) or FP8, widened to bf16 here (exact).
  template <typename KV>
  static void pack_block(const KV* k_buf, const KV* v_buf, const int64_t* slots, int64_t first,
                         int64_t count, int64_t kvh, const ExtendDims& d, uint32_t* kp, uint32_t* vp) {
    const int64_t D = d.dim, row = d.kv_heads * D;
    auto* k = reinterpret_cast<uint16_t*>(kp);
    auto* v = reinterpret_cast<uint16_t*>(vp);
    std::memset(k + count * D, 0, sizeof(uint16_t) * (KB - count) * D);
    if (count < KB) std::memset(v, 0, sizeof(uint16_t) * D * KB);
    for (int64_t j = 0; j < count; ++j) {
      const int64_t at = slots[first + j] * row + kvh * D;
      if constexpr (std::is_same_v<KV, uint16_t>) std::memcpy(k + j * D, k_buf + at, sizeof(uint16_t) * D);
      else widen_to_bf16(k_buf + at, k + j * D, D);
      for (int64_t c = 0; c < D; ++c) v[c * KB + j] = as_bf16_bits(v_buf[at + c]);
    }
  }

  // Tiles: 0, 1 scores of keys 0-15 / 16-31 (then 0 holds P^T); 1 a V^T operand; 2 K rows of a head-dim
  // chunk; 3 the Q^T pairs of that chunk; 4-7 o^T's 16-dim tiles.
  static void configure(int64_t chunk) {
    const uint8_t c = static_cast<uint8_t>(chunk);
    load_tile_config({TR, TR, TR, static_cast<uint8_t>(c / 2), TR, TR, TR, TR},
                     {64, 64, static_cast<uint16_t>(c * 2), 64, 64, 64, 64, 64});
  }

  template <int64_t D>
  static void attend_task(const uint16_t* q, const ExtendSeq& s, int64_t kvh, int64_t i0, int64_t i1, const ExtendDims& d,
                          const uint32_t* kpack, const uint32_t* vpack, double scale, uint16_t* out) {
    constexpr int64_t CH = D < 32 ? D : 32;      // head dims per K Q^T product
    constexpr int64_t OT = D / 16;               // o^T tiles
    constexpr bool kOInTiles = OT <= 4;          // else o^T stays in memory, a tile at a time
    const __m512 scale_log2 = _mm512_set1_ps(static_cast<float>(scale * 1.4426950408889634));
    const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    const int64_t G = d.group, R = (i1 - i0) * G, H = d.heads;
    const int64_t block_words = D * KB / 2;
    alignas(64) float scores[KB * TR];           // [key][row]
    alignas(64) uint32_t probs[(KB / 2) * TR];   // [key pair][row]
    alignas(64) uint32_t qt[(D / 2) * TR];       // [head-dim pair][row]
    alignas(64) float ot[D * TR];                // [head dim][row]
    alignas(64) int32_t limit[TR];               // last key a row sees (-1: a padding row)
    __mmask16 seen[KB];
    configure(CH);
    for (int64_t g0 = 0; g0 < R; g0 += TR) {
      int32_t last = 0;
      for (int n = 0; n < TR; ++n) {
        const int64_t r = g0 + n;
        const uint32_t* qrow = nullptr;
        limit[n] = -1;
        if (r < R) {
          const int64_t i = i0 + r / G;
          limit[n] = static_cast<int32_t>(s.prefix + i);
          last = std::max(last, limit[n]);
          qrow = reinterpret_cast<const uint32_t*>(q + ((s.q_start + i) * H + kvh * G + r % G) * D);
        }
        for (int64_t p = 0; p < D / 2; ++p) qt[p * TR + n] = qrow ? qrow[p] : 0;
      }
      const __m512i lim = _mm512_load_si512(limit);
      __m512 m = neg_inf, l = _mm512_setzero_ps();
      if constexpr (kOInTiles) {
        unroll<OT>([&](auto j) { OTile<decltype(j)::value>::zero(); });
      } else {
        std::fill(ot, ot + D * TR, 0.0f);
      }
      for (int64_t b = 0; b <= last / KB; ++b) {
        const auto* kp = reinterpret_cast<const uint16_t*>(kpack + b * block_words);
        const auto* vp = reinterpret_cast<const uint16_t*>(vpack + b * block_words);
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t c = 0; c < D; c += CH) {
          _tile_loadd(3, qt + (c / 2) * TR, TR * sizeof(uint32_t));
          _tile_loadd(2, kp + c, D * sizeof(uint16_t));
          _tile_dpbf16ps(0, 2, 3);
          _tile_loadd(2, kp + 16 * D + c, D * sizeof(uint16_t));
          _tile_dpbf16ps(1, 2, 3);
        }
        _tile_stored(0, scores, TR * sizeof(float));
        _tile_stored(1, scores + 16 * TR, TR * sizeof(float));
        // Softmax down the keys, a row per lane: the block's max, o and l rescaled where it moved. Scores
        // stay raw; the log2 scale is applied inside each probability's exponent (one FMA).
        const int32_t k0 = static_cast<int32_t>(b * KB);
        __m512 block_max = neg_inf;
        for (int j = 0; j < KB; ++j) {
          seen[j] = _mm512_cmp_epi32_mask(lim, _mm512_set1_epi32(k0 + j), _MM_CMPINT_NLT);
          block_max = _mm512_mask_max_ps(block_max, seen[j], block_max, _mm512_load_ps(scores + j * TR));
        }
        block_max = _mm512_mul_ps(block_max, scale_log2);
        // Per row (lane) only, so a row's bits never depend on the other rows of its group.
        const __mmask16 moved = _mm512_cmp_ps_mask(block_max, _mm512_add_ps(m, _mm512_set1_ps(kLazyLog2)), _CMP_GT_OQ);
        if (moved) {   // a row's first keys: its o and l are 0, any factor leaves them so
          const __m512 m_new = _mm512_mask_blend_ps(moved, m, block_max);
          const __m512 alpha = _mm512_mask_blend_ps(moved, _mm512_set1_ps(1.0f), exp2_nonpositive(_mm512_sub_ps(m, m_new)));
          l = _mm512_mul_ps(l, alpha);
          if constexpr (kOInTiles) unroll<OT>([&](auto j) { OTile<decltype(j)::value>::store(ot + decltype(j)::value * 16 * TR); });
          for (int64_t c = 0; c < D; ++c) _mm512_store_ps(ot + c * TR, _mm512_mul_ps(_mm512_load_ps(ot + c * TR), alpha));
          if constexpr (kOInTiles) unroll<OT>([&](auto j) { OTile<decltype(j)::value>::load(ot + decltype(j)::value * 16 * TR); });
          m = m_new;
        }
        alignas(64) static constexpr uint16_t kPairOrder[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                                8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
        const __m512i pair_order = _mm512_load_si512(kPairOrder);   // lane 2n: key j's row n, 2n + 1: key j + 1's
        for (int j = 0; j < KB; j += 2) {
          // scaled score - max <= kLazyLog2 here. exp2_coarse's 7.5e-5 is far below the bf16 rounding p gets
          // for the product. Hidden keys (-inf) get exactly 0: the exp2 clamp alone would leave 2^-126.
          const __m512 p0 = _mm512_maskz_mov_ps(seen[j], exp2_coarse(_mm512_fmsub_ps(_mm512_load_ps(scores + j * TR), scale_log2, m)));
          const __m512 p1 = _mm512_maskz_mov_ps(seen[j + 1], exp2_coarse(_mm512_fmsub_ps(_mm512_load_ps(scores + (j + 1) * TR), scale_log2, m)));
          l = _mm512_add_ps(_mm512_add_ps(l, p0), p1);
          const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p1, p0));   // p0's 16, then p1's
          _mm512_store_si512(probs + (j / 2) * TR, _mm512_permutexvar_epi16(pair_order, both));
        }
        // o^T += V^T P^T, 16 head dims at a time.
        _tile_loadd(0, probs, TR * sizeof(uint32_t));
        if constexpr (kOInTiles) {
          unroll<OT>([&](auto j) {
            _tile_loadd(1, vp + decltype(j)::value * 16 * KB, KB * sizeof(uint16_t));
            OTile<decltype(j)::value>::add_pv();
          });
        } else {
          for (int64_t j = 0; j < OT; ++j) {
            _tile_loadd(4, ot + j * 16 * TR, TR * sizeof(float));
            _tile_loadd(1, vp + j * 16 * KB, KB * sizeof(uint16_t));
            _tile_dpbf16ps(4, 1, 0);
            _tile_stored(4, ot + j * 16 * TR, TR * sizeof(float));
          }
        }
      }
      if constexpr (kOInTiles) unroll<OT>([&](auto j) { OTile<decltype(j)::value>::store(ot + decltype(j)::value * 16 * TR); });
      alignas(64) float lsum[TR];
      _mm512_store_ps(lsum, l);
      for (int n = 0; n < TR && g0 + n < R; ++n) {
        const int64_t r = g0 + n, i = i0 + r / G;
        uint16_t* dst = out + ((s.q_start + i) * H + kvh * G + r % G) * D;
        const float inv = 1.0f / lsum[n];
        for (int64_t c = 0; c < D; ++c) dst[c] = c10::BFloat16(ot[c * TR + n] * inv).x;
      }
    }
    _tile_release();
  }
};

}  // namespace kvstrata_cpu

#endif  // AMX
