// Vector math shared by the AVX-512 kernels of this folder.
#pragma once

#ifdef __AVX512F__
#include <immintrin.h>

namespace kvstrata_cpu {

// e^r for |r| <= ln2/2: degree-6 Taylor in Horner form (relative error ~2e-7). Callers split their argument
// as x = n * ln2 + r (or 2^x as 2^n * e^(f ln2)) and scale the result by 2^n with _mm512_scalef_ps.
inline __m512 exp_reduced(__m512 r) {
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
}

}  // namespace kvstrata_cpu

#endif  // __AVX512F__
