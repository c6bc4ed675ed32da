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

// One tile of keys for all H query heads of one row: writes [H] max, [H] sum and [H, D] weighted values.
// Whole pool rows (all KV heads) are read at once, so a tile streams through memory in order.
template <typename T, typename KV>
void attend_tile(const T* q, const KV* k_buf, const KV* v_buf, const int64_t* slots, int64_t first,
                 int64_t count, float scale, const Shape& s, float* partial) {
  const int64_t H = s.heads, G = s.group, D = s.dim, W = s.kv_stride;
  std::vector<float> qf(H * D), row(W), scores(H * TILE);
  widen_row(q, qf.data(), H * D);
  for (int64_t i = 0; i < H * D; ++i) qf[i] *= scale;
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
  TORCH_CHECK(k_buf.scalar_type() == v_buf.scalar_type(), "K and V dtypes differ");
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
