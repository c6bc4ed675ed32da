// Causal attention for extend rows (a prompt's new tokens, after a cached prefix or none) on CPUs with
// AVX-512 BF16, reading K/V of the pool through the slot table (no gather copy, no mask tensor).
//
// Sequence s has extend[s] new tokens at batch rows q_start[s].., absolute positions prefix[s]..; the
// token at position p attends keys 0..p, key j being pool row slots[s][j]. Both products run as bf16 dot
// products with float32 accumulation (`vdpbf16ps`, twice the float32 FMA rate): scores = Q K^T, then the
// probabilities, rounded to bf16, times V. Softmax is online over fixed blocks of KB keys counted from key
// 0, so a row's result depends only on its query, its keys and KB, not on the chunk or batch it runs in.
//
// Work, per unit (sequence, KV head): its key blocks are packed once into the operand layouts the dot
// product wants (K as [D/2][KB] pairs along the head dim, V as [KB/2][D] pairs of consecutive keys); then
// each task, (unit, QB query positions x the heads sharing that KV head), walks the unit's blocks:
// MR-row score tiles in registers, softmax, and the weighted V added into float32 rows. Units run in waves
// whose packed blocks fit PACK_BUDGET, so memory stays bounded however long the contexts are.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "slot_check.h"
#include "vec_math.h"

#ifdef __AVX512BF16__
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using kvstrata_cpu::dot_pairs;
using kvstrata_cpu::exp2_nonpositive;

constexpr int64_t KB = 32;   // keys per block: two 16-lane score vectors per row
constexpr int64_t QB = 16;   // query positions per task
constexpr int MR = 8;        // score rows held in registers at a time
constexpr int64_t PACK_BUDGET = int64_t(64) << 20;   // bytes of packed K+V per wave (more: one unit per wave)

struct Dims {
  int64_t heads, kv_heads, dim, group;
};

// One sequence: its rows, its tokens, and the pool row of each of its keys.
struct SeqInfo {
  int64_t q_start, prefix, extend;
  const int64_t* slots;
  int64_t blocks() const { return (prefix + extend + KB - 1) / KB; }
};

// K block: [D/2][KB] uint32, lane j = (K[j][2p], K[j][2p+1]); V block: [KB/2][D] uint32, lane d =
// (V[2q][d], V[2q+1][d]). Keys past the sequence's end are zero (and masked).
void pack_block(const uint16_t* k_buf, const uint16_t* v_buf, const int64_t* slots, int64_t first,
                int64_t count, int64_t kvh, const Dims& d, uint32_t* kp, uint32_t* vp) {
  const int64_t D = d.dim, row = d.kv_heads * D;
  std::memset(kp, 0, sizeof(uint32_t) * (D / 2) * KB);
  std::memset(vp, 0, sizeof(uint32_t) * (KB / 2) * D);
  for (int64_t j = 0; j < count; ++j) {
    const uint32_t* k = reinterpret_cast<const uint32_t*>(k_buf + slots[first + j] * row + kvh * D);
    for (int64_t p = 0; p < D / 2; ++p) kp[p * KB + j] = k[p];
    const uint16_t* v = v_buf + slots[first + j] * row + kvh * D;
    uint16_t* dst = reinterpret_cast<uint16_t*>(vp + (j / 2) * D) + (j % 2);
    for (int64_t c = 0; c < D; ++c) dst[2 * c] = v[c];
  }
}

// One task's rows: position i (0-based in the extend) and head g, row r = (i - i0) * group + g.
// kpack / vpack: the unit's packed blocks, block b at b * D/2 * KB words.
template <int64_t D>
void attend_task(const uint16_t* q, const SeqInfo& s, int64_t kvh, int64_t i0, int64_t i1, const Dims& d,
                 const uint32_t* kpack, const uint32_t* vpack, float scale_log2, uint16_t* out) {
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

struct Task {
  int64_t seq, kvh, i0, i1, cost, pack_offset;   // pack_offset: the unit's first block in the wave's buffers
};

template <int64_t D>
void attend_wave(const std::vector<Task>& tasks, const std::vector<SeqInfo>& seqs, const uint16_t* q,
                 const Dims& d, const uint32_t* kpack, const uint32_t* vpack, float scale_log2, uint16_t* out) {
  constexpr int64_t block_words = (D / 2) * KB;
  // Dealt to threads round-robin by decreasing cost (key blocks), so causal rows balance.
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks.size()));
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w)
      for (size_t t = w; t < tasks.size(); t += workers) {
        const Task& task = tasks[t];
        attend_task<D>(q, seqs[task.seq], task.kvh, task.i0, task.i1, d, kpack + task.pack_offset * block_words,
                       vpack + task.pack_offset * block_words, scale_log2, out);
      }
  });
}

at::Tensor extend_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                            const at::Tensor& slots, const at::Tensor& q_start, const at::Tensor& prefix,
                            const at::Tensor& extend, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_buf.dim() == 3 && v_buf.dim() == 3, "q/k/v must be [T, H, D] / [N, KVH, D]");
  TORCH_CHECK(q.is_contiguous() && k_buf.is_contiguous() && v_buf.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_buf.scalar_type() == at::kBFloat16 &&
              v_buf.scalar_type() == at::kBFloat16, "bfloat16 only");
  TORCH_CHECK(k_buf.sizes() == v_buf.sizes(), "K and V differ");
  TORCH_CHECK(q.size(1) % k_buf.size(1) == 0 && q.size(2) == k_buf.size(2), "head shapes do not match");
  const int64_t D = q.size(2);
  kvstrata_cpu::with_head_dim(D, [](auto) {});   // an unserved head dim raises before any work
  TORCH_CHECK(slots.dim() == 2 && slots.scalar_type() == at::kLong && slots.is_contiguous(), "slots: [S, L] long");
  for (const at::Tensor* t : {&q_start, &prefix, &extend})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == slots.size(0),
                "q_start/prefix/extend: one long per sequence");
  const Dims d{q.size(1), k_buf.size(1), q.size(2), q.size(1) / k_buf.size(1)};
  const int64_t S = slots.size(0);
  const int64_t* qs = q_start.data_ptr<int64_t>();
  const int64_t* pre = prefix.data_ptr<int64_t>();
  const int64_t* ext = extend.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  // Every index is checked before any is followed: a bad plan must raise, never read outside a buffer.
  std::vector<SeqInfo> seqs(S);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t total = pre[s] + ext[s];
    TORCH_CHECK(pre[s] >= 0 && ext[s] >= 1 && total <= slots.size(1), "sequence ", s, " has ", total,
                " keys for a slot row of ", slots.size(1));
    TORCH_CHECK(qs[s] >= 0 && qs[s] + ext[s] <= q.size(0), "sequence ", s, " rows are outside q");
    const int64_t* row = sp + s * slots.size(1);
    kvstrata_cpu::check_slots(row, total, k_buf.size(0));
    seqs[s] = {qs[s], pre[s], ext[s], row};
  }
  const int64_t block_words = (D / 2) * KB, block_bytes = 2 * block_words * 4;   // K + V
  std::vector<std::pair<int64_t, int64_t>> units;   // (sequence, KV head)
  for (int64_t s = 0; s < S; ++s)
    for (int64_t h = 0; h < d.kv_heads; ++h) units.emplace_back(s, h);
  int64_t max_blocks = 0;
  for (const SeqInfo& s : seqs) max_blocks = std::max(max_blocks, s.blocks());
  const int64_t wave_blocks = std::max(max_blocks, PACK_BUDGET / block_bytes);
  std::vector<uint32_t> kpack, vpack;
  const auto* kb = reinterpret_cast<const uint16_t*>(k_buf.data_ptr());
  const auto* vb = reinterpret_cast<const uint16_t*>(v_buf.data_ptr());
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  at::Tensor out = at::zeros_like(q);
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const float scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  for (size_t first = 0; first < units.size();) {
    // A wave: the next units whose blocks fit wave_blocks (at least one).
    std::vector<Task> tasks;
    std::vector<std::tuple<int64_t, int64_t, int64_t>> pack_jobs;   // (unit, block, wave block)
    int64_t used = 0;
    size_t last = first;
    for (; last < units.size(); ++last) {
      const auto [s, h] = units[last];
      const int64_t n = seqs[s].blocks();
      if (used > 0 && used + n > wave_blocks) break;
      for (int64_t b = 0; b < n; ++b) pack_jobs.emplace_back(last, b, used + b);
      for (int64_t i0 = 0; i0 < seqs[s].extend; i0 += QB) {
        const int64_t i1 = std::min(seqs[s].extend, i0 + QB);
        tasks.push_back({s, h, i0, i1, (seqs[s].prefix + i1) / KB + 1, used});
      }
      used += n;
    }
    kpack.resize(std::max<size_t>(kpack.size(), used * block_words));
    vpack.resize(kpack.size());
    at::parallel_for(0, static_cast<int64_t>(pack_jobs.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t job = begin; job < end; ++job) {
        const auto [u, b, at] = pack_jobs[job];
        const SeqInfo& s = seqs[units[u].first];
        const int64_t k0 = b * KB;
        pack_block(kb, vb, s.slots, k0, std::min(KB, s.prefix + s.extend - k0), units[u].second, d,
                   kpack.data() + at * block_words, vpack.data() + at * block_words);
      }
    });
    std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
    const uint32_t *kpk = kpack.data(), *vpk = vpack.data();
    kvstrata_cpu::with_head_dim(D, [&](auto dim) {
      attend_wave<decltype(dim)::value>(tasks, seqs, qp, d, kpk, vpk, scale_log2, op);
    });
    first = last;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvstrata, m) {
  m.def("extend_attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor slots, Tensor q_start, Tensor prefix, "
        "Tensor extend, float scale) -> Tensor");
  m.impl("extend_attention", c10::DispatchKey::CPU, TORCH_FN(extend_attention));
}

#endif  // __AVX512BF16__
