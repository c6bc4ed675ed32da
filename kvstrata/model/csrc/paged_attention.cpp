// Paged attention for CPU that reads K/V rows of the pool in place (no gather copy).
//
// Query row t (one token, H heads) attends keys 0..lens[t]-1 of its sequence; key j of sequence s lives in
// pool row slots[s][j]. Keys are taken in fixed tiles of TILE positions; each (row, tile) is an
// independent task giving a partial (max, sum, weighted values), and a row's partials are merged in tile
// order. A row's result therefore depends only on its query, its keys and TILE: never on the batch it
// runs in, on chunking, or on the thread count (what --enable-deterministic-inference needs).
// Arithmetic is float32 throughout; bf16 inputs are widened exactly.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t TILE = 256;
constexpr int LANES = 16;

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

// exp(x) for x <= 0 (x = score - max), Cephes-style: 2^k * p(r), about 1 ulp; plain arithmetic so that the
// loops over a tile vectorize, and the same bits in every build of this file.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float fx = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - fx * 0.693359375f;
  r = r - fx * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
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

struct Shape {
  int64_t heads, kv_heads, dim, group, row_stride, kv_stride, slot_stride;
};

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

inline __m512 exp16(__m512 x) {   // exp_nonpositive, 16 lanes
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f),
                                                         _mm512_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
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
  std::vector<float> qf(H * D), row(W), scores(H * TILE);
  widen_row(q, qf.data(), H * D);
  for (int64_t i = 0; i < H * D; ++i) qf[i] *= scale;
#ifdef __AVX512F__
  if (D == 64) return attend_tile_avx512<4, KV>(qf.data(), k_buf, v_buf, slots, first, count, s, scores.data(), partial);
  if (D == 128) return attend_tile_avx512<8, KV>(qf.data(), k_buf, v_buf, slots, first, count, s, scores.data(), partial);
#endif
  for (int64_t j = 0; j < count; ++j) {
    widen_row(k_buf + slots[first + j] * W, row.data(), W);
    for (int64_t h = 0; h < H; ++h) scores[h * TILE + j] = dot(qf.data() + h * D, row.data() + (h / G) * D, D);
  }
  float* maxes = partial;
  float* sums = partial + H;
  float* acc = partial + 2 * H;
  for (int64_t h = 0; h < H; ++h) {
    float* sc = scores.data() + h * TILE;
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
    widen_row(v_buf + slots[first + j] * W, row.data(), W);
    for (int64_t h = 0; h < H; ++h) {
      const float p = scores[h * TILE + j];
      const float* v = row.data() + (h / G) * D;
      float* a = acc + h * D;
      for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
    }
  }
}


template <typename T>
inline void store(T* dst, float x) { *dst = static_cast<T>(x); }

template <typename T, typename KV>
void run(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf, const at::Tensor& slots,
         const at::Tensor& row_seq, const at::Tensor& lens, double scale, at::Tensor& out) {
  const int64_t rows = q.size(0);
  Shape s{q.size(1), k_buf.size(1), q.size(2), q.size(1) / k_buf.size(1), q.size(1) * q.size(2),
          k_buf.size(1) * k_buf.size(2), slots.size(1)};
  const int64_t* seq = row_seq.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  std::vector<int64_t> tile_start(rows + 1, 0);     // first task of row t, counted in (row, tile) pairs
  for (int64_t t = 0; t < rows; ++t) tile_start[t + 1] = tile_start[t] + (len[t] + TILE - 1) / TILE;
  const int64_t tiles = tile_start[rows];
  const int64_t part_size = s.heads * (s.dim + 2);
  std::vector<float> partials(tiles * part_size);
  std::vector<int64_t> task_row(tiles);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t i = tile_start[t]; i < tile_start[t + 1]; ++i) task_row[i] = t;
  const T* qp = q.data_ptr<T>();
  const KV* kp = k_buf.data_ptr<KV>();
  const KV* vp = v_buf.data_ptr<KV>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t t = task_row[tile];
      const int64_t first = (tile - tile_start[t]) * TILE;
      const int64_t count = std::min(TILE, len[t] - first);
      attend_tile<T, KV>(qp + t * s.row_stride, kp, vp, sp + seq[t] * s.slot_stride, first, count,
                         static_cast<float>(scale), s, partials.data() + tile * part_size);
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
          const float* part = partials.data() + i * part_size;
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

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                           const at::Tensor& slots, const at::Tensor& row_seq, const at::Tensor& lens,
                           double scale) {
  TORCH_CHECK(q.dim() == 3 && k_buf.dim() == 3 && v_buf.dim() == 3, "q/k/v must be [T, H, D] / [N, KVH, D]");
  TORCH_CHECK(q.is_contiguous() && k_buf.is_contiguous() && v_buf.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(slots.dim() == 2 && slots.scalar_type() == at::kLong && slots.is_contiguous(), "slots: [S, L] long");
  TORCH_CHECK(row_seq.scalar_type() == at::kLong && lens.scalar_type() == at::kLong, "row_seq/lens: long");
  TORCH_CHECK(row_seq.numel() == q.size(0) && lens.numel() == q.size(0), "one row_seq and len per query row");
  TORCH_CHECK(q.size(1) % k_buf.size(1) == 0 && q.size(2) == k_buf.size(2), "head shapes do not match");
  TORCH_CHECK(k_buf.scalar_type() == v_buf.scalar_type() && k_buf.sizes() == v_buf.sizes(), "K and V differ");
  // Every index is checked before any is followed: a bad plan must raise, never read outside the pool.
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* rs = row_seq.data_ptr<int64_t>();
  for (int64_t t = 0; t < q.size(0); ++t) {
    TORCH_CHECK(lp[t] >= 1 && lp[t] <= slots.size(1), "row ", t, " attends ", lp[t], " keys of ", slots.size(1));
    TORCH_CHECK(rs[t] >= 0 && rs[t] < slots.size(0), "row ", t, " names sequence ", rs[t]);
  }
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < slots.numel(); ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < k_buf.size(0), "slot ", sp[i], " is outside the pool");
  at::Tensor out = at::empty_like(q);
  const bool q16 = q.scalar_type() == at::kBFloat16, kv16 = k_buf.scalar_type() == at::kBFloat16;
  TORCH_CHECK((q16 || q.scalar_type() == at::kFloat) && (kv16 || k_buf.scalar_type() == at::kFloat),
              "bfloat16 or float32 only");
  if (q16 && kv16) run<c10::BFloat16, c10::BFloat16>(q, k_buf, v_buf, slots, row_seq, lens, scale, out);
  else if (q16) run<c10::BFloat16, float>(q, k_buf, v_buf, slots, row_seq, lens, scale, out);
  else if (kv16) run<float, c10::BFloat16>(q, k_buf, v_buf, slots, row_seq, lens, scale, out);
  else run<float, float>(q, k_buf, v_buf, slots, row_seq, lens, scale, out);
  return out;
}

}  // namespace

TORCH_LIBRARY(kvstrata, m) {
  m.def("paged_attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor slots, Tensor row_seq, Tensor lens, "
        "float scale) -> Tensor");
  m.impl("paged_attention", c10::DispatchKey::CPU, TORCH_FN(paged_attention));
}
