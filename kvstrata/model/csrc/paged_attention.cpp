// Paged attention for CPU that reads K/V rows of the pool in place (no gather copy).
//
// Query row t (one token, H heads) attends keys 0..lens[t]-1 of its sequence; key j of sequence s lives in
// pool row slots[s][j]. Keys are taken in fixed tiles of TILE positions; each (row, tile) is an
// independent task giving a partial (max, sum, weighted values), and a row's partials are merged in tile
// order. A row's result therefore depends only on its query, its keys and TILE: never on the batch it
// runs in, on chunking, or on the thread count (what --enable-deterministic-inference needs).
// Arithmetic is float32 throughout; bf16 inputs are widened exactly. Head dims 64 and 128 take an AVX-512
// tile where the CPU has it, 32, 64 and 128 an AVX2 one (attend_tile_avx2.h) on CPUs with only AVX2.
//
// decode_attention (CPUs with AVX-512 BF16, bf16 q/K/V; the engine's default mode) runs the same tiles and
// merge with bf16 dot products (`vdpbf16ps`, float32 accumulation): each key's score is a dot product over
// the head dim whose 16 partial lanes are summed with those of 15 other keys in one shuffle tree, and the
// probabilities, rounded to bf16, weight V two keys at a time. In cache a key costs ~2/3 of the float32
// tile's cycles; streaming many decode rows' contexts from DRAM it is 1.2-1.5x faster (docs/benchmarks.md).
//
// Both read an FP8 pool (--kv-cache-dtype) in place too: every K/V element is widened in registers (fp8.h:
// exact in float32 and in bf16), so a key costs half the bytes of a bf16 pool's. The caller folds the
// per-layer scales into `scale` and the output (model/attention.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "attend_tile_avx2.h"
#include "fp8.h"
#include "slot_check.h"
#include "vec_math.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t TILE = 256;
constexpr int LANES = 16;

using kvstrata_cpu::widen;   // FP8 (fp8.h)
inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T>
inline void widen_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = widen(src[i]);
}

// exp(x) for x <= 0 (x = score - max), vec_math.h's exp_cephes: plain arithmetic so that the loops over a
// tile vectorize, and the same bits in every build of this file.
inline float exp_nonpositive(float x) {
  namespace c = kvstrata_cpu::exp_cephes;
  x = x < c::kMin ? c::kMin : x;
  const float fx = std::floor(x * c::kLog2e + 0.5f);
  float r = x - fx * c::kLn2Hi;
  r = r - fx * c::kLn2Lo;
  float p = c::kPoly[0];
  for (int i = 1; i <= c::kDegree; ++i) p = p * r + c::kPoly[i];
  p = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(fx) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Dot product with LANES independent partial sums (vectorizes without reassociation), then a fixed pairwise tree.
inline float dot(const float* a, const float* b, int64_t n) {
  float part[LANES] = {0};
  int64_t d = 0;
  for (; d + LANES <= n; d += LANES)
    for (int i = 0; i < LANES; ++i) part[i] += a[d + i] * b[d + i];
  for (int w = LANES / 2; w > 0; w /= 2)
    for (int i = 0; i < w; ++i) part[i] += part[i + w];
  float s = part[0];
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

// n floats of scratch kept by the calling thread from call to call (one buffer per Tag), so that a decode
// step's layers reuse memory instead of each mapping, zeroing and page-faulting its own. Above kKeptFloats
// (16 MB: a long prefill in deterministic mode) the buffer is `local`, freed with the caller's frame.
constexpr size_t kKeptFloats = size_t{1} << 22;
template <int Tag>
float* kept_scratch(size_t n, std::vector<float>& local) {
  thread_local std::vector<float> kept;
  std::vector<float>& buf = n <= kKeptFloats ? kept : local;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

struct Shape {
  int64_t heads, kv_heads, dim, group, row_stride, kv_stride, slot_stride;
};

Shape shape_of(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& slots) {
  return {q.size(1), k_buf.size(1), q.size(2), q.size(1) / k_buf.size(1), q.size(1) * q.size(2),
          k_buf.size(1) * k_buf.size(2), slots.size(1)};
}

#ifdef __AVX512F__
// attend_tile (below) with AVX-512 for head dims that are 16 * NC: q rows stay in registers, scores, max, exp and
// sums run 16 keys at a time (the tail masked), and each head's weighted values accumulate in registers.
// Every key of a tile takes the same lane and the same operations whatever the row's length.
template <typename KV>
inline __m512 load16(const KV* p);
template <>
inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline __m512 load16<c10::BFloat16>(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
template <>
inline __m512 load16<kvstrata_cpu::Fp8E4M3>(const kvstrata_cpu::Fp8E4M3* p) { return kvstrata_cpu::load16_fp8(p); }
template <>
inline __m512 load16<kvstrata_cpu::Fp8E5M2>(const kvstrata_cpu::Fp8E5M2* p) { return kvstrata_cpu::load16_fp8(p); }

inline __m512 exp16(__m512 x) {   // exp_nonpositive, 16 lanes
  namespace c = kvstrata_cpu::exp_cephes;
  x = _mm512_max_ps(x, _mm512_set1_ps(c::kMin));
  const __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(c::kLog2e), _mm512_set1_ps(0.5f)),
                                         _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(c::kLn2Hi), x);
  r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(c::kLn2Lo), r);
  __m512 p = _mm512_set1_ps(c::kPoly[0]);
  for (int i = 1; i <= c::kDegree; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c::kPoly[i]));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

template <int NC, typename KV>
void attend_tile_avx512(const float* qf, const KV* k_buf, const KV* v_buf, const int64_t* slots, int64_t first,
                        int64_t count, const Shape& s, float* scores, float* partial) {
  const int64_t G = s.group, W = s.kv_stride, H = s.heads;
  constexpr int64_t D = 16 * NC;
  for (int64_t kvh = 0; kvh < s.kv_heads; ++kvh) {
    for (int64_t j = 0; j < count; ++j) {
      const KV* krow = k_buf + slots[first + j] * W + kvh * D;
      __m512 k[NC];
      for (int c = 0; c < NC; ++c) k[c] = load16(krow + 16 * c);
      for (int64_t g = 0; g < G; ++g) {
        const float* qh = qf + (kvh * G + g) * D;
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qh), k[0]);
        for (int c = 1; c < NC; ++c) a = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * c), k[c], a);
        scores[(kvh * G + g) * TILE + j] = _mm512_reduce_add_ps(a);
      }
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    float* sc = scores + h * TILE;
    __m512 m16 = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < count; j += 16) {
      const __mmask16 live = count - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (count - j)) - 1);
      m16 = _mm512_mask_max_ps(m16, live, m16, _mm512_maskz_loadu_ps(live, sc + j));
    }
    const float m = _mm512_reduce_max_ps(m16);
    __m512 l16 = _mm512_setzero_ps();
    for (int64_t j = 0; j < count; j += 16) {
      const __mmask16 live = count - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (count - j)) - 1);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sc + j), _mm512_set1_ps(m)));
      _mm512_mask_storeu_ps(sc + j, live, e);
      l16 = _mm512_mask_add_ps(l16, live, l16, e);
    }
    partial[h] = m;
    partial[H + h] = _mm512_reduce_add_ps(l16);
  }
  float* acc_out = partial + 2 * H;
  for (int64_t kvh = 0; kvh < s.kv_heads; ++kvh) {
    for (int64_t g0 = 0; g0 < G; g0 += 4) {        // four heads' accumulators in registers at a time
      const int64_t gn = std::min<int64_t>(4, G - g0);
      __m512 acc[4][NC];
      for (int g = 0; g < 4; ++g)
        for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_setzero_ps();
      for (int64_t j = 0; j < count; ++j) {
        const KV* vrow = v_buf + slots[first + j] * W + kvh * D;
        __m512 v[NC];
        for (int c = 0; c < NC; ++c) v[c] = load16(vrow + 16 * c);
        for (int64_t g = 0; g < gn; ++g) {
          const __m512 p = _mm512_set1_ps(scores[(kvh * G + g0 + g) * TILE + j]);
          for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_fmadd_ps(p, v[c], acc[g][c]);
        }
      }
      for (int64_t g = 0; g < gn; ++g)
        for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc_out + (kvh * G + g0 + g) * D + 16 * c, acc[g][c]);
    }
  }
}
#endif

// One tile of keys for all H query heads of one row: writes [H] max, [H] sum and [H, D] weighted values.
// Whole pool rows (all KV heads) are read at once, so a tile streams through memory in order.
template <typename T, typename KV>
void attend_tile(const T* q, const KV* k_buf, const KV* v_buf, const int64_t* slots, int64_t first,
                 int64_t count, float scale, const Shape& s, float* partial) {
  const int64_t H = s.heads, G = s.group, D = s.dim, W = s.kv_stride;
  std::vector<float> unused;
  float* const scratch = kept_scratch<0>(H * D + W + H * TILE, unused);
  float* const qf = scratch;
  float* const row = scratch + H * D;
  float* const scores = row + W;
  widen_row(q, qf, H * D);
  for (int64_t i = 0; i < H * D; ++i) qf[i] *= scale;
#ifdef __AVX512F__
  if (D == 64) return attend_tile_avx512<4, KV>(qf, k_buf, v_buf, slots, first, count, s, scores, partial);
  if (D == 128) return attend_tile_avx512<8, KV>(qf, k_buf, v_buf, slots, first, count, s, scores, partial);
#elif defined(__AVX2__) && defined(__FMA__)
  const auto avx2 = [&](auto nc) {
    kvstrata_cpu::attend_tile_avx2<decltype(nc)::value, KV>(qf, k_buf, v_buf, slots, first, count, H,
                                                            s.kv_heads, TILE, scores, partial);
  };
  if (D == 32) return avx2(std::integral_constant<int, 4>{});
  if (D == 64) return avx2(std::integral_constant<int, 8>{});
  if (D == 128) return avx2(std::integral_constant<int, 16>{});
#endif
  for (int64_t j = 0; j < count; ++j) {
    widen_row(k_buf + slots[first + j] * W, row, W);
    for (int64_t h = 0; h < H; ++h) scores[h * TILE + j] = dot(qf + h * D, row + (h / G) * D, D);
  }
  float* maxes = partial;
  float* sums = partial + H;
  float* acc = partial + 2 * H;
  for (int64_t h = 0; h < H; ++h) {
    float* sc = scores + h * TILE;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < count; ++j) m = sc[j] > m ? sc[j] : m;
    float l = 0.0f;
    for (int64_t j = 0; j < count; ++j) {
      sc[j] = exp_nonpositive(sc[j] - m);
      l += sc[j];
    }
    maxes[h] = m;
    sums[h] = l;
  }
  std::memset(acc, 0, sizeof(float) * H * D);
  for (int64_t j = 0; j < count; ++j) {
    widen_row(v_buf + slots[first + j] * W, row, W);
    for (int64_t h = 0; h < H; ++h) {
      const float p = scores[h * TILE + j];
      const float* v = row + (h / G) * D;
      float* a = acc + h * D;
      for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
    }
  }
}


template <typename T>
inline void store(T* dst, float x) { *dst = static_cast<T>(x); }

// Tiles every row's keys, runs `tile(q_row, slots_row, first, count, partial)` on each (row, tile) task and
// merges each row's partials in tile order into out.
template <typename T, typename Tile>
void run(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& slots, const at::Tensor& row_seq,
         const at::Tensor& lens, at::Tensor& out, const Tile& tile) {
  const int64_t rows = q.size(0);
  const Shape s = shape_of(q, k_buf, slots);
  const int64_t* seq = row_seq.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  std::vector<int64_t> tile_start(rows + 1, 0);     // first task of row t, counted in (row, tile) pairs
  for (int64_t t = 0; t < rows; ++t) tile_start[t + 1] = tile_start[t] + (len[t] + TILE - 1) / TILE;
  const int64_t tiles = tile_start[rows];
  const int64_t part_size = s.heads * (s.dim + 2);
  std::vector<float> large;
  float* const partials = kept_scratch<1>(tiles * part_size, large);   // every task writes its whole partial
  std::vector<int64_t> task_row(tiles);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t i = tile_start[t]; i < tile_start[t + 1]; ++i) task_row[i] = t;
  const T* qp = q.data_ptr<T>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = task_row[i];
      const int64_t first = (i - tile_start[t]) * TILE;
      tile(qp + t * s.row_stride, sp + seq[t] * s.slot_stride, first, std::min(TILE, len[t] - first),
           partials + i * part_size);
    }
  });
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(s.dim);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < s.heads; ++h) {
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t i = tile_start[t]; i < tile_start[t + 1]; ++i) m = std::max(m, partials[i * part_size + h]);
        float l = 0.0f;
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t i = tile_start[t]; i < tile_start[t + 1]; ++i) {
          const float* part = partials + i * part_size;
          const float w = exp_nonpositive(part[h] - m);
          l += w * part[s.heads + h];
          const float* a = part + 2 * s.heads + h * s.dim;
          for (int64_t d = 0; d < s.dim; ++d) acc[d] += w * a[d];
        }
        T* dst = op + t * s.row_stride + h * s.dim;
        for (int64_t d = 0; d < s.dim; ++d) store(dst + d, acc[d] / l);
      }
    }
  });
}

// Every index is checked before any is followed: a bad plan must raise, never read outside the pool.
void check_plan(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf, const at::Tensor& slots,
                const at::Tensor& row_seq, const at::Tensor& lens) {
  TORCH_CHECK(q.dim() == 3 && k_buf.dim() == 3 && v_buf.dim() == 3, "q/k/v must be [T, H, D] / [N, KVH, D]");
  TORCH_CHECK(q.is_contiguous() && k_buf.is_contiguous() && v_buf.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(slots.dim() == 2 && slots.scalar_type() == at::kLong && slots.is_contiguous(), "slots: [S, L] long");
  TORCH_CHECK(row_seq.scalar_type() == at::kLong && lens.scalar_type() == at::kLong, "row_seq/lens: long");
  TORCH_CHECK(row_seq.numel() == q.size(0) && lens.numel() == q.size(0), "one row_seq and len per query row");
  TORCH_CHECK(q.size(1) % k_buf.size(1) == 0 && q.size(2) == k_buf.size(2), "head shapes do not match");
  TORCH_CHECK(k_buf.scalar_type() == v_buf.scalar_type() && k_buf.sizes() == v_buf.sizes(), "K and V differ");
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* rs = row_seq.data_ptr<int64_t>();
  for (int64_t t = 0; t < q.size(0); ++t) {
    TORCH_CHECK(lp[t] >= 1 && lp[t] <= slots.size(1), "row ", t, " attends ", lp[t], " keys of ", slots.size(1));
    TORCH_CHECK(rs[t] >= 0 && rs[t] < slots.size(0), "row ", t, " names sequence ", rs[t]);
  }
  kvstrata_cpu::check_slots(slots.data_ptr<int64_t>(), slots.numel(), k_buf.size(0));
}

template <typename T, typename KV>
void run_float32(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf, const at::Tensor& slots,
                 const at::Tensor& row_seq, const at::Tensor& lens, double scale, at::Tensor& out) {
  const Shape s = shape_of(q, k_buf, slots);
  const KV* kp = reinterpret_cast<const KV*>(k_buf.data_ptr());
  const KV* vp = reinterpret_cast<const KV*>(v_buf.data_ptr());
  run<T>(q, k_buf, slots, row_seq, lens, out,
         [&](const T* qr, const int64_t* sr, int64_t first, int64_t count, float* partial) {
           attend_tile<T, KV>(qr, kp, vp, sr, first, count, static_cast<float>(scale), s, partial);
         });
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                           const at::Tensor& slots, const at::Tensor& row_seq, const at::Tensor& lens,
                           double scale) {
  check_plan(q, k_buf, v_buf, slots, row_seq, lens);
  at::Tensor out = at::empty_like(q);
  const bool q16 = q.scalar_type() == at::kBFloat16;
  TORCH_CHECK(q16 || q.scalar_type() == at::kFloat, "q: bfloat16 or float32 only");
  const auto with_q = [&](auto kv) {
    using KV = decltype(kv);
    if (q16) run_float32<c10::BFloat16, KV>(q, k_buf, v_buf, slots, row_seq, lens, scale, out);
    else run_float32<float, KV>(q, k_buf, v_buf, slots, row_seq, lens, scale, out);
  };
  switch (k_buf.scalar_type()) {
    case at::kBFloat16: with_q(c10::BFloat16{}); break;
    case at::kFloat: with_q(float{}); break;
    case at::kFloat8_e4m3fn: with_q(kvstrata_cpu::Fp8E4M3{}); break;
    case at::kFloat8_e5m2: with_q(kvstrata_cpu::Fp8E5M2{}); break;
    default: TORCH_CHECK(false, "K/V: bfloat16, float32, float8_e4m3fn or float8_e5m2 only");
  }
  return out;
}

#ifdef __AVX512BF16__
using kvstrata_cpu::dot_pairs;
using kvstrata_cpu::exp2_nonpositive;

// Lane j of the result = the sum of v[j]'s 16 lanes, for 16 vectors at once (45 shuffles and adds instead
// of 16 separate horizontal sums). Halves, then quarters, then lane pairs are folded; the input order is
// the 4x4 transpose of the output order, so the result needs no final permute.
inline __m512 sum_lanes16(const __m512* v) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i) {   // in w[i]: quarters 0-1 hold v[2i]'s halves summed, 2-3 v[2i+1]'s
    const int a = 4 * ((2 * i) % 4) + (2 * i) / 4, b = 4 * ((2 * i + 1) % 4) + (2 * i + 1) / 4;
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[a], v[b], 0x44), _mm512_shuffle_f32x4(v[a], v[b], 0xEE));
  }
  for (int i = 0; i < 4; ++i)     // quarter k of x[i]: 4 partial lanes of input 4i + k
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    y[i] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]), _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]));
  const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(y[0]), _mm512_castps_pd(y[1]));
  const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(y[0]), _mm512_castps_pd(y[1]));
  return _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
}

alignas(64) const uint16_t kZeroRow[256] = {0};   // stands in for the keys past a tile's end

// Chunk c (32 bf16) of a row of D: a head dim under 32 is loaded masked, its missing lanes zero. An FP8 row
// (KV = Fp8E4M3 / Fp8E5M2) is widened to bf16 in registers: 32 bytes, two float32 halves, one exact pack.
template <int64_t D, typename KV>
inline __m512i load_chunk(const KV* row, int c) {
  if constexpr (kvstrata_cpu::is_fp8<KV>::value) {
    const __m512 lo = kvstrata_cpu::load16_fp8(row + 32 * c);
    const __m512 hi = D < 32 ? _mm512_setzero_ps() : kvstrata_cpu::load16_fp8(row + 32 * c + 16);
    return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
  } else if constexpr (D < 32) {
    return _mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << D) - 1), row);
  } else {
    return _mm512_loadu_si512(row + 32 * c);
  }
}

// Every cache line of n rows' D elements each (one KV head of n pool rows).
template <int64_t D, typename KV>
inline void prefetch_rows(const KV* base, const int64_t* slots, int64_t n, int64_t W) {
  constexpr int64_t per_line = 64 / sizeof(KV);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t off = 0; off < D; off += per_line)
      _mm_prefetch(reinterpret_cast<const char*>(base + slots[j] * W + off), _MM_HINT_T0);
}

// Scores of 16 keys (rows k[0..15]) against one head's query (chunks of 32 bf16), log2-scaled.
template <int64_t D, typename KV>
inline __m512 score16(const __m512i* qv, const KV* const* k, __m512 scale_log2) {
  constexpr int NQ = (D + 31) / 32;
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) {
    acc[j] = _mm512_setzero_ps();
    for (int c = 0; c < NQ; ++c) acc[j] = dot_pairs(acc[j], load_chunk<D>(k[j], c), qv[c]);
  }
  return _mm512_mul_ps(sum_lanes16(acc), scale_log2);
}

// o[r] = sum over the tile's keys of probs[r][j] * V[j] for RN heads (probability rows `stride` apart),
// two keys per dot-product step; written to dst[r * D ..] in natural dim order.
template <int64_t D, int RN, typename KV>
void weigh_values(const KV* vbase, const int64_t* slots, int64_t first, int64_t count, int64_t W,
                  const uint32_t* probs, int64_t stride, float* dst) {
  constexpr int NQ = (D + 31) / 32, NC = 2 * NQ;
  __m512 oa[RN][NC];
  for (int r = 0; r < RN; ++r)
    for (int c = 0; c < NC; ++c) oa[r][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < count; j += 2) {
    const KV* v0 = vbase + slots[first + j] * W;
    const KV* v1 = j + 1 < count ? vbase + slots[first + j + 1] * W : reinterpret_cast<const KV*>(kZeroRow);
    __m512i vv[NC];
#pragma GCC unroll 8
    for (int c = 0; c < NQ; ++c) {
      const __m512i a = load_chunk<D>(v0, c), b = load_chunk<D>(v1, c);
      vv[2 * c] = _mm512_unpacklo_epi16(a, b);
      vv[2 * c + 1] = _mm512_unpackhi_epi16(a, b);
    }
#pragma GCC unroll 8
    for (int r = 0; r < RN; ++r) {
      const __m512i pv = _mm512_set1_epi32(static_cast<int>(probs[r * stride + j / 2]));
#pragma GCC unroll 16
      for (int c = 0; c < NC; ++c) oa[r][c] = dot_pairs(oa[r][c], vv[c], pv);
    }
  }
  // Lane 4l + i of vv[2c] is dim 32c + 8l + i, of vv[2c + 1] dim 32c + 8l + 4 + i (dims past D: padding).
  alignas(64) float lanes[NC * 16];
  for (int r = 0; r < RN; ++r) {
    for (int c = 0; c < NC; ++c) _mm512_store_ps(lanes + 16 * c, oa[r][c]);
    float* o = dst + r * D;
    for (int c = 0; c < NQ; ++c)
      for (int l = 0; l < 4 && 32 * c + 8 * l < D; ++l)
        for (int i = 0; i < 4; ++i) {
          o[32 * c + 8 * l + i] = lanes[16 * (2 * c) + 4 * l + i];
          o[32 * c + 8 * l + 4 + i] = lanes[16 * (2 * c + 1) + 4 * l + i];
        }
  }
}

// One tile of keys for all H heads of one decode row (the contract of attend_tile, bf16 arithmetic).
// Scores: per head, 16 keys at a time, D/32 dot-product steps per key, then one shuffle tree. Values: the
// rows of keys 2i and 2i+1 interleaved (16-bit unpack) pair with their two bf16 probabilities, so one
// dot-product step adds both keys' weighted values.
template <int64_t D, typename KV>
void attend_tile_bf16(const uint16_t* q, const KV* k_buf, const KV* v_buf, const int64_t* slots,
                      int64_t first, int64_t count, float scale_log2, const Shape& s, float* partial) {
  constexpr int NQ = (D + 31) / 32, NC = 2 * NQ;
  constexpr int RG = NC >= 16 ? 1 : 16 / NC;   // heads whose value accumulators fit 16 registers
  constexpr int64_t STRIDE = TILE / 2 + 8;     // a row of probability pairs (an odd count's partner is 0)
  const int64_t G = s.group, W = s.kv_stride, H = s.heads;
  alignas(64) float scores[TILE];
  std::vector<uint32_t> probs(G * STRIDE, 0);
  const __m512 scale = _mm512_set1_ps(scale_log2);
  for (int64_t kvh = 0; kvh < s.kv_heads; ++kvh) {
    const KV* kbase = k_buf + kvh * D;
    const KV* vbase = v_buf + kvh * D;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t h = kvh * G + g;
      __m512i qv[NQ];
      for (int c = 0; c < NQ; ++c) qv[c] = load_chunk<D>(q + h * D, c);   // q: bf16 always
      __m512 m16 = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int64_t j0 = 0; j0 < count; j0 += 16) {
        const KV* k[16];
        for (int j = 0; j < 16; ++j)
          k[j] = j0 + j < count ? kbase + slots[first + j0 + j] * W : reinterpret_cast<const KV*>(kZeroRow);
        // First head: fetch the next block's K rows while this one computes; second head (K now in cache):
        // this block's V rows, for the value pass.
        if (g == 0 && j0 + 16 < count)
          prefetch_rows<D>(kbase, slots + first + j0 + 16, std::min<int64_t>(16, count - j0 - 16), W);
        if (g == std::min<int64_t>(1, G - 1))
          prefetch_rows<D>(vbase, slots + first + j0, std::min<int64_t>(16, count - j0), W);
        const __m512 sc = score16<D>(qv, k, scale);
        _mm512_store_ps(scores + j0, sc);
        const __mmask16 live = count - j0 >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (count - j0)) - 1);
        m16 = _mm512_mask_max_ps(m16, live, m16, sc);
      }
      const float m = _mm512_reduce_max_ps(m16);
      __m512 l16 = _mm512_setzero_ps();
      uint32_t* pg = probs.data() + g * STRIDE;
      for (int64_t j0 = 0; j0 < count; j0 += 16) {
        const __mmask16 live = count - j0 >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (count - j0)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(
            live, exp2_nonpositive(_mm512_sub_ps(_mm512_load_ps(scores + j0), _mm512_set1_ps(m))));
        l16 = _mm512_add_ps(l16, e);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pg + j0 / 2),
                            reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
      }
      partial[h] = m * 0.69314718055994531f;   // natural-log units, as the float32 tile's partials
      partial[H + h] = _mm512_reduce_add_ps(l16);
    }
    for (int64_t g0 = 0; g0 < G; g0 += RG) {
      const uint32_t* pr = probs.data() + g0 * STRIDE;
      float* dst = partial + 2 * H + (kvh * G + g0) * D;
      switch (std::min<int64_t>(RG, G - g0)) {   // the head count is a template argument: accumulators stay in registers
#define KVSTRATA_WEIGH(n) case n: if constexpr (n <= RG) weigh_values<D, n, KV>(vbase, slots, first, count, W, pr, STRIDE, dst); break;
        KVSTRATA_WEIGH(1) KVSTRATA_WEIGH(2) KVSTRATA_WEIGH(3) KVSTRATA_WEIGH(4)
        KVSTRATA_WEIGH(5) KVSTRATA_WEIGH(6) KVSTRATA_WEIGH(7) KVSTRATA_WEIGH(8)
#undef KVSTRATA_WEIGH
      }
    }
  }
}

// An FP8 tile: its K and V rows (every KV head) widened once into bf16 scratch (exact), then the bf16 tile
// runs on the scratch rows. Each FP8 byte is read from the pool and converted once, not once per query
// head of its group, and the bf16 tile's arithmetic is unchanged (the same bits as a bf16 pool holding the
// widened values).
template <typename KV>
void widen_rows_bf16(const KV* buf, const int64_t* slots, int64_t count, int64_t W, uint16_t* out) {
  for (int64_t j = 0; j < count; ++j) {
    if (j + 4 < count) _mm_prefetch(reinterpret_cast<const char*>(buf + slots[j + 4] * W), _MM_HINT_T0);
    kvstrata_cpu::widen_to_bf16(buf + slots[j] * W, out + j * W, W);   // W = kv_heads * D, a multiple of 16
  }
}

template <int64_t D, typename KV>
void attend_tile_fp8(const uint16_t* q, const KV* k_buf, const KV* v_buf, const int64_t* slots, int64_t first,
                     int64_t count, float scale_log2, const Shape& s, float* partial) {
  const int64_t W = s.kv_stride;
  thread_local std::vector<uint16_t> keys, values;
  thread_local std::vector<int64_t> rows;
  if (static_cast<int64_t>(rows.size()) < count) {
    rows.resize(count);
    for (int64_t j = 0; j < count; ++j) rows[j] = j;
  }
  keys.resize(std::max<size_t>(keys.size(), count * W));
  values.resize(keys.size());
  widen_rows_bf16(k_buf, slots + first, count, W, keys.data());
  widen_rows_bf16(v_buf, slots + first, count, W, values.data());
  attend_tile_bf16<D, uint16_t>(q, keys.data(), values.data(), rows.data(), 0, count, scale_log2, s, partial);
}

template <int64_t D, typename KV>
void run_bf16(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf, const at::Tensor& slots,
              const at::Tensor& row_seq, const at::Tensor& lens, double scale, at::Tensor& out) {
  const Shape s = shape_of(q, k_buf, slots);
  const auto* kp = reinterpret_cast<const KV*>(k_buf.data_ptr());
  const auto* vp = reinterpret_cast<const KV*>(v_buf.data_ptr());
  const float scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  run<c10::BFloat16>(q, k_buf, slots, row_seq, lens, out,
                     [&](const c10::BFloat16* qr, const int64_t* sr, int64_t first, int64_t count, float* partial) {
                       const auto* qb = reinterpret_cast<const uint16_t*>(qr);
                       if constexpr (kvstrata_cpu::is_fp8<KV>::value)
                         attend_tile_fp8<D, KV>(qb, kp, vp, sr, first, count, scale_log2, s, partial);
                       else
                         attend_tile_bf16<D, KV>(qb, kp, vp, sr, first, count, scale_log2, s, partial);
                     });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                            const at::Tensor& slots, const at::Tensor& row_seq, const at::Tensor& lens,
                            double scale) {
  check_plan(q, k_buf, v_buf, slots, row_seq, lens);
  const auto kv = k_buf.scalar_type();
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 &&
              (kv == at::kBFloat16 || kv == at::kFloat8_e4m3fn || kv == at::kFloat8_e5m2),
              "q: bfloat16; K/V: bfloat16, float8_e4m3fn or float8_e5m2");
  at::Tensor out = at::empty_like(q);
  kvstrata_cpu::with_head_dim(q.size(2), [&](auto dim) {
    constexpr int64_t D = decltype(dim)::value;
    if (kv == at::kBFloat16) run_bf16<D, uint16_t>(q, k_buf, v_buf, slots, row_seq, lens, scale, out);
    else if (kv == at::kFloat8_e4m3fn) run_bf16<D, kvstrata_cpu::Fp8E4M3>(q, k_buf, v_buf, slots, row_seq, lens, scale, out);
    else run_bf16<D, kvstrata_cpu::Fp8E5M2>(q, k_buf, v_buf, slots, row_seq, lens, scale, out);
  });
  return out;
}
#endif  // __AVX512BF16__

}  // namespace

TORCH_LIBRARY(kvstrata, m) {
  m.def("paged_attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor slots, Tensor row_seq, Tensor lens, "
        "float scale) -> Tensor");
  m.impl("paged_attention", c10::DispatchKey::CPU, TORCH_FN(paged_attention));
#ifdef __AVX512BF16__
  m.def("decode_attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor slots, Tensor row_seq, Tensor lens, "
        "float scale) -> Tensor");
  m.impl("decode_attention", c10::DispatchKey::CPU, TORCH_FN(decode_attention));
#endif
}
