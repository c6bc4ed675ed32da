// Causal attention for extend rows (a prompt's new tokens, after a cached prefix or none), reading K/V of the
// pool through the slot table (no gather copy, no mask tensor). Sequence s has extend[s] new tokens at batch
// rows q_start[s].., absolute positions prefix[s]..; the token at position p attends keys 0..p, key j being
// pool row slots[s][j].
//
// This file is the driver; the arithmetic is a tile of this CPU's instruction set: extend_tile_amx.h (AMX,
// bf16 models; `extend_amx(False)` turns it off for the next one), extend_tile_avx512bf16.h (bf16 dot
// products, bf16 models) or extend_tile_avx2.h (float32 arithmetic, bf16 and float32 models). An FP8 pool
// (--kv-cache-dtype) is read by the same tiles: their packing widens each element (fp8.h, exact).
// Either computes softmax online over fixed blocks of Tile::KB keys counted from key 0, so a row's result
// depends only on its query, its keys and the block size, not on the chunk or batch it runs in.
//
// Work, per unit (sequence, KV head): its key blocks are packed once into the tile's operand layouts; then
// each task, (unit, Tile::QB query positions x the heads sharing that KV head), walks the unit's blocks.
// Units run in waves whose packed blocks fit PACK_BUDGET, so memory stays bounded however long the
// contexts are.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "extend_plan.h"
#include "extend_tile_amx.h"
#include "extend_tile_avx2.h"
#include "extend_tile_avx512bf16.h"
#include "fp8.h"
#include "slot_check.h"
#include "vec_math.h"

#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__))
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

namespace {

using kvstrata_cpu::ExtendDims;
using kvstrata_cpu::ExtendSeq;

constexpr int64_t PACK_BUDGET = int64_t(64) << 20;   // bytes of packed K+V per wave (more: one unit per wave)

#ifdef KVSTRATA_EXTEND_AMX
std::atomic<bool> amx_wanted{true};   // extend_amx(): off to run the dot-product tile (tests compare both)

bool use_amx() { return amx_wanted.load() && kvstrata_cpu::amx_permitted(); }
#else
bool use_amx() { return false; }
#endif

// Whether extend_attention runs its AMX tile from now on: `enable` where this build and the OS allow it.
bool extend_amx(bool enable) {
#ifdef KVSTRATA_EXTEND_AMX
  amx_wanted.store(enable);
#endif
  return enable && use_amx();
}

struct Task {
  int64_t seq, kvh, i0, i1, cost, pack_offset;   // pack_offset: the unit's first block in the wave's buffers
};

template <class Tile, int64_t D>
void attend_wave(const std::vector<Task>& tasks, const std::vector<ExtendSeq>& seqs, const typename Tile::Scalar* q,
                 const ExtendDims& d, const typename Tile::PackWord* kpack, const typename Tile::PackWord* vpack,
                 double scale, typename Tile::Scalar* out) {
  const int64_t block_words = Tile::block_words(D);
  // Dealt to threads round-robin by decreasing cost (key blocks), so causal rows balance.
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks.size()));
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w)
      for (size_t t = w; t < tasks.size(); t += workers) {
        const Task& task = tasks[t];
        Tile::template attend_task<D>(q, seqs[task.seq], task.kvh, task.i0, task.i1, d,
                                      kpack + task.pack_offset * block_words, vpack + task.pack_offset * block_words,
                                      scale, out);
      }
  });
}

// The waves of units (sequence, KV head): pack each wave's key blocks, then run its tasks.
template <class Tile, typename KV>
void run_waves(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf, const std::vector<ExtendSeq>& seqs,
               const ExtendDims& d, double scale, at::Tensor& out) {
  using Scalar = typename Tile::Scalar;
  using Word = typename Tile::PackWord;
  const int64_t D = d.dim, KB = Tile::KB, block_words = Tile::block_words(D);
  const int64_t block_bytes = 2 * block_words * static_cast<int64_t>(sizeof(Word));   // K + V
  std::vector<std::pair<int64_t, int64_t>> units;   // (sequence, KV head)
  for (size_t s = 0; s < seqs.size(); ++s)
    for (int64_t h = 0; h < d.kv_heads; ++h) units.emplace_back(s, h);
  int64_t max_blocks = 0;
  for (const ExtendSeq& s : seqs) max_blocks = std::max(max_blocks, s.blocks(KB));
  const int64_t wave_blocks = std::max(max_blocks, PACK_BUDGET / block_bytes);
  std::vector<Word> kpack, vpack;
  const auto* kb = reinterpret_cast<const KV*>(k_buf.data_ptr());
  const auto* vb = reinterpret_cast<const KV*>(v_buf.data_ptr());
  const auto* qp = reinterpret_cast<const Scalar*>(q.data_ptr());
  auto* op = reinterpret_cast<Scalar*>(out.data_ptr());
  for (size_t first = 0; first < units.size();) {
    // A wave: the next units whose blocks fit wave_blocks (at least one).
    std::vector<Task> tasks;
    std::vector<std::tuple<int64_t, int64_t, int64_t>> pack_jobs;   // (unit, block, wave block)
    int64_t used = 0;
    size_t last = first;
    for (; last < units.size(); ++last) {
      const auto [s, h] = units[last];
      const int64_t n = seqs[s].blocks(KB);
      if (used > 0 && used + n > wave_blocks) break;
      for (int64_t b = 0; b < n; ++b) pack_jobs.emplace_back(last, b, used + b);
      for (int64_t i0 = 0; i0 < seqs[s].extend; i0 += Tile::QB) {
        const int64_t i1 = std::min(seqs[s].extend, i0 + Tile::QB);
        tasks.push_back({s, h, i0, i1, (seqs[s].prefix + i1) / KB + 1, used});
      }
      used += n;
    }
    kpack.resize(std::max<size_t>(kpack.size(), used * block_words));
    vpack.resize(kpack.size());
    at::parallel_for(0, static_cast<int64_t>(pack_jobs.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t job = begin; job < end; ++job) {
        const auto [u, b, at] = pack_jobs[job];
        const ExtendSeq& s = seqs[units[u].first];
        const int64_t k0 = b * KB;
        Tile::pack_block(kb, vb, s.slots, k0, std::min(KB, s.prefix + s.extend - k0), units[u].second, d,
                         kpack.data() + at * block_words, vpack.data() + at * block_words);
      }
    });
    std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
    const Word *kpk = kpack.data(), *vpk = vpack.data();
    kvstrata_cpu::with_head_dim(D, [&](auto dim) {
      attend_wave<Tile, decltype(dim)::value>(tasks, seqs, qp, d, kpk, vpk, scale, op);
    });
    first = last;
  }
}

at::Tensor extend_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                            const at::Tensor& slots, const at::Tensor& q_start, const at::Tensor& prefix,
                            const at::Tensor& extend, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_buf.dim() == 3 && v_buf.dim() == 3, "q/k/v must be [T, H, D] / [N, KVH, D]");
  TORCH_CHECK(q.is_contiguous() && k_buf.is_contiguous() && v_buf.is_contiguous(), "inputs must be contiguous");
  const auto kv = k_buf.scalar_type();
  const bool fp8 = kv == at::kFloat8_e4m3fn || kv == at::kFloat8_e5m2;
  TORCH_CHECK(v_buf.scalar_type() == kv, "K and V differ");
#ifdef __AVX512BF16__
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && (kv == at::kBFloat16 || fp8),
              "q: bfloat16; K/V: bfloat16, float8_e4m3fn or float8_e5m2");
#else
  TORCH_CHECK((q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat) && (kv == q.scalar_type() || fp8),
              "q, k_buf and v_buf must all be bfloat16 or all float32 (or K/V float8_e4m3fn / float8_e5m2)");
#endif
  TORCH_CHECK(k_buf.sizes() == v_buf.sizes(), "K and V differ");
  // The tiles take a block's max of raw scores as the max of scaled ones (the AMX tile applies the scale late).
  TORCH_CHECK(scale > 0, "scale must be positive, got ", scale);
  TORCH_CHECK(q.size(1) % k_buf.size(1) == 0 && q.size(2) == k_buf.size(2), "head shapes do not match");
  kvstrata_cpu::with_head_dim(q.size(2), [](auto) {});   // an unserved head dim raises before any work
  TORCH_CHECK(slots.dim() == 2 && slots.scalar_type() == at::kLong && slots.is_contiguous(), "slots: [S, L] long");
  for (const at::Tensor* t : {&q_start, &prefix, &extend})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == slots.size(0),
                "q_start/prefix/extend: one long per sequence");
  const ExtendDims d{q.size(1), k_buf.size(1), q.size(2), q.size(1) / k_buf.size(1)};
  const int64_t S = slots.size(0);
  const int64_t* qs = q_start.data_ptr<int64_t>();
  const int64_t* pre = prefix.data_ptr<int64_t>();
  const int64_t* ext = extend.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  // Every index is checked before any is followed: a bad plan must raise, never read outside a buffer.
  std::vector<ExtendSeq> seqs(S);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t total = pre[s] + ext[s];
    TORCH_CHECK(pre[s] >= 0 && ext[s] >= 1 && total <= slots.size(1), "sequence ", s, " has ", total,
                " keys for a slot row of ", slots.size(1));
    TORCH_CHECK(qs[s] >= 0 && qs[s] + ext[s] <= q.size(0), "sequence ", s, " rows are outside q");
    const int64_t* row = sp + s * slots.size(1);
    kvstrata_cpu::check_slots(row, total, k_buf.size(0));
    seqs[s] = {qs[s], pre[s], ext[s], row};
  }
  at::Tensor out = at::zeros_like(q);
  // The tile for this CPU and q, run over the pool's element type.
  const auto with_kv = [&](auto tile, auto native) {
    using Tile = decltype(tile);
    if (kv == at::kFloat8_e4m3fn) run_waves<Tile, kvstrata_cpu::Fp8E4M3>(q, k_buf, v_buf, seqs, d, scale, out);
    else if (kv == at::kFloat8_e5m2) run_waves<Tile, kvstrata_cpu::Fp8E5M2>(q, k_buf, v_buf, seqs, d, scale, out);
    else run_waves<Tile, decltype(native)>(q, k_buf, v_buf, seqs, d, scale, out);
  };
#ifdef __AVX512BF16__
#ifdef KVSTRATA_EXTEND_AMX
  if (use_amx()) {
    with_kv(kvstrata_cpu::ExtendTileAmx{}, uint16_t{});
    return out;
  }
#endif
  with_kv(kvstrata_cpu::ExtendTileBf16Dot{}, uint16_t{});
#else
  if (q.scalar_type() == at::kFloat)
    with_kv(kvstrata_cpu::ExtendTileAvx2<float>{}, float{});
  else
    with_kv(kvstrata_cpu::ExtendTileAvx2<c10::BFloat16>{}, c10::BFloat16{});
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvstrata, m) {
  m.def("extend_attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor slots, Tensor q_start, Tensor prefix, "
        "Tensor extend, float scale) -> Tensor");
  m.impl("extend_attention", c10::DispatchKey::CPU, TORCH_FN(extend_attention));
  m.def("extend_amx(bool enable) -> bool", &extend_amx);
}

#endif  // AVX-512 BF16, or AVX2 + FMA
