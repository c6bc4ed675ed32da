// silu(gate) * up for the gated MLP in one pass over the fused gate|up projection's output: reads [T, 2I],
// writes [T, I], no temporaries. Rounds like the two torch ops it replaces (silu's result to the dtype, then
// the product).
//
// silu of a bf16 depends on its 16 bits only, so torch's own silu of all 65,536 of them, computed once, is a
// table that gives torch's bits by construction: a load instead of an exp and a division per element. How
// each CPU reads it is measured (torch's bf16 silu takes ~1 ns per element on Zen 3, nearly all of it Sleef's
// exp):
//   * AVX-512 with AMX (Intel): 16 entries per vpgatherdd, 2.0-2.6x computing silu as below (2-core Xeon);
//   * AVX-512 BF16 without AMX (Zen 4): no table; silu computed with our own exp and a division, which
//     matches torch's bits for every bf16 gate value (the tests check all 65,536);
//   * otherwise (AVX2): eight scalar lookups, 1.5-2x faster than vpgatherdd on Zen 3; the one-pass lookup
//     runs 2.4-3.4x torch's two ops.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/silu.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec_math.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#if defined(__AVX512BF16__) && defined(__AMX_TILE__)
#define KVSTRATA_SILU_GATHER 1   // the table through vpgatherdd
#elif defined(__AVX512BF16__)
#define KVSTRATA_SILU_COMPUTE 1  // no table: our exp and a division
#endif

namespace {

using bf16 = c10::BFloat16;

// silu(g) for every bf16 bit pattern g, by torch's own kernel, made on first use (128 KB; the entries that
// activations use stay in L1). Two padding entries: a 32-bit gather of the last entry reads one past it.
[[maybe_unused]] const uint16_t* silu_table() {
  static const std::vector<uint16_t> table = [] {
    const at::Tensor every = at::arange(65536, at::TensorOptions().dtype(at::kInt)).to(at::kShort).view(at::kBFloat16);
    const at::Tensor silu = at::silu(every).contiguous();
    std::vector<uint16_t> out(65536 + 2, 0);
    std::memcpy(out.data(), silu.data_ptr(), 65536 * sizeof(uint16_t));
    return out;
  }();
  return table.data();
}

// bf16(float(silu) * float(up)), as torch's mul rounds it.
[[maybe_unused]] inline uint16_t product_bits(uint16_t silu, uint16_t up) {
  const bf16 p = static_cast<bf16>(static_cast<float>(bf16(silu, bf16::from_bits())) *
                                   static_cast<float>(bf16(up, bf16::from_bits())));
  return p.x;
}

#ifdef __AVX512BF16__

#ifdef KVSTRATA_SILU_COMPUTE
// e^x, 2^n * e^r with |r| <= ln2/2 (degree-6 Taylor, ~2e-7 relative); below -87 it is taken as e^-87, above
// 100 as e^100, which is inf in float32 (scalef overflows), as torch's exp gives from 89 on.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(100.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  return _mm512_scalef_ps(kvstrata_cpu::exp_reduced(r), n);
}
#endif

// silu of the 16 (live) gate values at `gate`, rounded to bf16, as float32.
inline __m512 silu16(const uint16_t* gate, __mmask16 live, [[maybe_unused]] const uint16_t* table) {
#ifdef KVSTRATA_SILU_GATHER
  const __m512i index = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, gate));
  const __m512i entries = _mm512_i32gather_epi32(index, reinterpret_cast<const int*>(table), 2);
  return _mm512_castsi512_ps(_mm512_slli_epi32(entries, 16));   // the low 16 bits are the entry
#else
  const __m512 g = kvstrata_cpu::load_bf16x16(gate, live);
  return kvstrata_cpu::round_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                                 exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
#endif
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16 && x.size(1) % 2 == 0,
              "silu_and_mul: x must be a contiguous [T, 2I] bfloat16 tensor");
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, x.options());
#ifdef KVSTRATA_SILU_GATHER
  const uint16_t* table = silu_table();   // (before the parallel region: it runs a torch op once)
#else
  const uint16_t* table = nullptr;
#endif
  const auto* src = reinterpret_cast<const uint16_t*>(x.data_ptr());
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t* gate = src + t * 2 * inter;
      const uint16_t* up = gate + inter;
      for (int64_t c = 0; c < inter; c += 16) {
        const __mmask16 live = inter - c >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (inter - c)) - 1);
        const __m256i prod = kvstrata_cpu::pack_bf16x16(_mm512_mul_ps(silu16(gate + c, live, table),
                                                                      kvstrata_cpu::load_bf16x16(up + c, live)));
        _mm256_mask_storeu_epi16(dst + t * inter + c, live, prod);
      }
    }
  });
  return out;
}

#else  // no AVX-512 BF16: eight scalar lookups at a time

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16 && x.size(1) % 2 == 0,
              "silu_and_mul: x must be a contiguous [T, 2I] bfloat16 tensor");
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, x.options());
  const uint16_t* table = silu_table();   // (before the parallel region: it runs a torch op once)
  const auto* src = reinterpret_cast<const uint16_t*>(x.data_ptr());
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  // ~16K outputs per task: a decode step's rows stay on one thread (no fork/join).
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(inter, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t* gate = src + t * 2 * inter;
      const uint16_t* up = gate + inter;
      uint16_t* o = dst + t * inter;
      int64_t c = 0;
#if defined(__AVX2__) && defined(__FMA__)
      for (; c + 8 <= inter; c += 8) {
        // Eight scalar lookups: 1.5-2x faster than vpgatherdd on Zen 3.
        alignas(16) uint16_t silu[8];
        for (int j = 0; j < 8; ++j) silu[j] = table[gate[c + j]];
        const __m256 product = _mm256_mul_ps(kvstrata_cpu::load8(silu), kvstrata_cpu::load8(up + c));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o + c), kvstrata_cpu::pack_bf16x8(product));
      }
#endif
      for (; c < inter; ++c) o[c] = product_bits(table[gate[c]], up[c]);
    }
  });
  return out;
}

#endif  // __AVX512BF16__

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvstrata, m) {
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.impl("silu_and_mul", c10::DispatchKey::CPU, TORCH_FN(silu_and_mul));
}
