// 16 fp32 / int32 lanes as one AVX-512 register (built with -mavx512f -mavx512bw -mavx512vl -mavx512dq).
// The same API as vec_avx2.h: kernels written against it compile at either level.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "vec_m256.h"

namespace vec {

using vf = __m512;     // 16 fp32
using vi = __m512i;    // 16 int32 (or 32 int16 for the *_i16 ops)
using vm = __mmask16;  // one bit per lane

constexpr const char* kVectorName = "AVX-512, 16 fp32 lanes a register";

LLMSERVE_INLINE vm tail_mask(int64_t remaining) {
  return remaining >= 16 ? static_cast<vm>(0xFFFF) : static_cast<vm>((1u << remaining) - 1);
}
LLMSERVE_INLINE vm no_lanes() { return 0; }
LLMSERVE_INLINE bool any(vm m) { return m != 0; }
LLMSERVE_INLINE vm mask_or(vm a, vm b) { return a | b; }

LLMSERVE_INLINE vf zero() { return _mm512_setzero_ps(); }
LLMSERVE_INLINE vf set1(float x) { return _mm512_set1_ps(x); }
LLMSERVE_INLINE vf load(const float* p) { return _mm512_load_ps(p); }  // 64-byte aligned
LLMSERVE_INLINE vf loadu(const float* p) { return _mm512_loadu_ps(p); }
LLMSERVE_INLINE void store(float* p, vf v) { _mm512_store_ps(p, v); }  // 64-byte aligned
LLMSERVE_INLINE void storeu(float* p, vf v) { _mm512_storeu_ps(p, v); }
// 64 bytes, whatever they hold, as 16 lanes of 32-bit units.
LLMSERVE_INLINE vf load_bits(const void* p) { return _mm512_loadu_ps(p); }

LLMSERVE_INLINE vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
LLMSERVE_INLINE vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
LLMSERVE_INLINE vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
LLMSERVE_INLINE vf div(vf a, vf b) { return _mm512_div_ps(a, b); }
LLMSERVE_INLINE vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }    // a * b + c
LLMSERVE_INLINE vf fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
LLMSERVE_INLINE vf max(vf a, vf b) { return _mm512_max_ps(a, b); }
LLMSERVE_INLINE vf min(vf a, vf b) { return _mm512_min_ps(a, b); }
LLMSERVE_INLINE vf abs(vf a) { return _mm512_abs_ps(a); }
LLMSERVE_INLINE float reduce_add(vf a) { return _mm512_reduce_add_ps(a); }
LLMSERVE_INLINE float reduce_max(vf a) { return _mm512_reduce_max_ps(a); }

LLMSERVE_INLINE vf where(vm m, vf if_set, vf if_clear) { return _mm512_mask_mov_ps(if_clear, m, if_set); }
LLMSERVE_INLINE vf maskz(vm m, vf a) { return _mm512_maskz_mov_ps(m, a); }
LLMSERVE_INLINE vm greater(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
LLMSERVE_INLINE vm equal(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
LLMSERVE_INLINE vm is_nan(vf a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
LLMSERVE_INLINE vm mask_and(vm a, vm b) { return a & b; }

LLMSERVE_INLINE vi zero_i32() { return _mm512_setzero_si512(); }
LLMSERVE_INLINE vi set1_i32(int32_t x) { return _mm512_set1_epi32(x); }
LLMSERVE_INLINE vi iota_i32() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
LLMSERVE_INLINE vi loadu_i32(const int32_t* p) { return _mm512_loadu_si512(p); }
LLMSERVE_INLINE vi add_i32(vi a, vi b) { return _mm512_add_epi32(a, b); }
LLMSERVE_INLINE vi where_i32(vm m, vi if_set, vi if_clear) { return _mm512_mask_mov_epi32(if_clear, m, if_set); }
LLMSERVE_INLINE vm greater_equal_i32(vi a, vi b) { return _mm512_cmpge_epi32_mask(a, b); }
LLMSERVE_INLINE int32_t reduce_min_i32(vm m, vi a) { return _mm512_mask_reduce_min_epi32(m, a); }
LLMSERVE_INLINE vf to_float(vi a) { return _mm512_cvtepi32_ps(a); }
LLMSERVE_INLINE vi as_int(vf a) { return _mm512_castps_si512(a); }
LLMSERVE_INLINE vf as_float(vi a) { return _mm512_castsi512_ps(a); }

// int16 pairs in each 32-bit lane: the low and high halves of each lane's 4 int8 (see key_scores).
LLMSERVE_INLINE vi even_bytes_i16(vi a) { return _mm512_srai_epi16(_mm512_slli_epi16(a, 8), 8); }
LLMSERVE_INLINE vi odd_bytes_i16(vi a) { return _mm512_srai_epi16(a, 8); }
// sum + the pairwise sums of int16 products a * b, in int32 lanes (one instruction with AVX512-VNNI).
LLMSERVE_INLINE vi add_dot_i16(vi sum, vi a, vi b) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(sum, a, b);
#else
  return _mm512_add_epi32(sum, _mm512_madd_epi16(a, b));
#endif
}

// Loads up to 16 elements as fp32 (bf16 widens by a 16-bit shift); masked-off lanes read as 0.
LLMSERVE_INLINE vf load16(const float* p, vm m) { return _mm512_maskz_loadu_ps(m, p); }
LLMSERVE_INLINE vf load16(const float* p) { return _mm512_loadu_ps(p); }
LLMSERVE_INLINE vf widen_bf16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
LLMSERVE_INLINE vf load16(const c10::BFloat16* p, vm m) { return widen_bf16(_mm256_maskz_loadu_epi16(m, p)); }
LLMSERVE_INLINE vf load16(const c10::BFloat16* p) { return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
// 16 int8 values as fp32 (exact).
LLMSERVE_INLINE vf load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// 16 e4m3 bytes as fp32 times 2^-8, exactly: each byte sign-extended to 16 bits and shifted so that
// its sign, 4-bit exponent and 3-bit mantissa sit in an fp16's sign, low exponent bits and top mantissa
// bits (the fp16 bias is 8 more than e4m3's), then F16C widens (subnormals too).
LLMSERVE_INLINE vf load16_fp8_shifted(const void* p) {
  const __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(static_cast<int16_t>(0xBF80))));
}
// Masked-off lanes read as `fill`.
LLMSERVE_INLINE vf load16_or(const float* p, vm m, vf fill) { return _mm512_mask_loadu_ps(fill, m, p); }

// fp32 -> bf16 bits, round to nearest even (finite inputs), as c10::BFloat16's constructor rounds.
LLMSERVE_INLINE __m256i to_bf16_bits(vf v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// Rounded to int32 (half to even), then narrowed to 16 int16 in lane order (values in int16 range).
LLMSERVE_INLINE __m256i to_int16(vf v) { return _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(v)); }

LLMSERVE_INLINE void store16(float* p, vf v, vm m) { _mm512_mask_storeu_ps(p, m, v); }
LLMSERVE_INLINE void store16(float* p, vf v) { _mm512_storeu_ps(p, v); }
LLMSERVE_INLINE void store16(c10::BFloat16* p, vf v, vm m) { _mm256_mask_storeu_epi16(p, m, to_bf16_bits(v)); }
LLMSERVE_INLINE void store16(c10::BFloat16* p, vf v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16_bits(v)); }

// A 16 x 16 fp32 transpose in registers, in place: r[i] lane j <- r[j] lane i.
LLMSERVE_INLINE void transpose16(vf (&r)[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int g = 0; g < 16; g += 4) {  // rows g..g+3: u[g + c] holds columns c, c + 4, c + 8, c + 12
    const __m512d a = _mm512_castps_pd(t[g]), b = _mm512_castps_pd(t[g + 1]);
    const __m512d c = _mm512_castps_pd(t[g + 2]), d = _mm512_castps_pd(t[g + 3]);
    u[g] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    u[g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    u[g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    u[g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 e0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88), e1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
    const __m512 o0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD), o1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
    r[c] = _mm512_shuffle_f32x4(e0, e1, 0x88);
    r[c + 8] = _mm512_shuffle_f32x4(e0, e1, 0xDD);
    r[c + 4] = _mm512_shuffle_f32x4(o0, o1, 0x88);
    r[c + 12] = _mm512_shuffle_f32x4(o0, o1, 0xDD);
  }
}

LLMSERVE_INLINE vf round_to_int(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// p * 2^n for integral n (overflow gives inf, as the exact product would).
LLMSERVE_INLINE vf scale_by_pow2(vf p, vf n) { return _mm512_scalef_ps(p, n); }

}  // namespace vec
