// The 16-lane vector API every kernel is written against, at the ISA level this library is built for:
// one AVX-512 register (vec_avx512.h) or two AVX2 ones (vec_avx2.h). Instructions beyond the base
// of a level (AVX512-BF16 dot products, AVX512-VNNI) are used under their own feature macros in the
// kernels that have a faster form with them.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define LLMSERVE_VEC_AVX512 1  // for code whose best form depends on the register file (32 zmm or 16 ymm)
#include "vec_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__)
#define LLMSERVE_VEC_AVX512 0
#include "vec_avx2.h"
#else
#error "llmserve CPU kernels are built per ISA level: AVX2+FMA at least (kernels/cpu/isa.py chooses the flags)"
#endif

namespace vec {

// exp(x) for 16 lanes: x = n ln2 + r with |r| <= ln2/2, e^r by its Taylor series to r^7 (relative
// error ~6e-9, under one fp32 ulp), then scaled by 2^n. Inputs below -87 flush towards 0, above 88.8
// (past FLT_MAX) give inf.
LLMSERVE_INLINE vf exp16(vf x) {
  x = min(max(x, set1(-87.0f)), set1(88.8f));
  const vf n = round_to_int(mul(x, set1(1.44269504088896341f)));
  vf r = fnmadd(n, set1(0.693359375f), x);  // ln2 split in two for exactness
  r = fnmadd(n, set1(-2.12194440e-4f), r);
  vf p = set1(1.f / 5040);
  p = fmadd(p, r, set1(1.f / 720));
  p = fmadd(p, r, set1(1.f / 120));
  p = fmadd(p, r, set1(1.f / 24));
  p = fmadd(p, r, set1(1.f / 6));
  p = fmadd(p, r, set1(0.5f));
  p = fmadd(p, r, set1(1.f));
  p = fmadd(p, r, set1(1.f));
  return scale_by_pow2(p, n);
}

// The value T would hold: identity for fp32, a round trip through bf16 otherwise.
LLMSERVE_INLINE vf round_as(float*, vf v) { return v; }
LLMSERVE_INLINE vf round_as(c10::BFloat16*, vf v) { return widen_bf16(to_bf16_bits(v)); }

}  // namespace vec
