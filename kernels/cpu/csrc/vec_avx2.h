// 16 fp32 / int32 lanes as two AVX2 registers (built with -mavx2 -mfma -mf16c): lanes 0-7 in `lo`,
// 8-15 in `hi`. The same API as vec_avx512.h, so a kernel written against it compiles at either
// level; a mask is a vector of all-ones / all-zeros lanes, as AVX2 compares produce.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "vec_m256.h"

namespace vec {

struct vf { __m256 lo, hi; };
struct vi { __m256i lo, hi; };
struct vm { __m256 lo, hi; };

constexpr const char* kVectorName = "AVX2+FMA, 16 fp32 lanes in two registers";

LLMSERVE_INLINE vm tail_mask(int64_t remaining) {
  const int32_t n = remaining >= 16 ? 16 : static_cast<int32_t>(remaining);
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), count = _mm256_set1_epi32(n);
  return {_mm256_castsi256_ps(_mm256_cmpgt_epi32(count, iota)),
          _mm256_castsi256_ps(_mm256_cmpgt_epi32(count, _mm256_add_epi32(iota, _mm256_set1_epi32(8))))};
}
LLMSERVE_INLINE vm no_lanes() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
// Bit u set for lane u.
LLMSERVE_INLINE int bits(vm m) { return _mm256_movemask_ps(m.lo) | _mm256_movemask_ps(m.hi) << 8; }
LLMSERVE_INLINE bool any(vm m) { return bits(m) != 0; }
LLMSERVE_INLINE vm mask_or(vm a, vm b) { return {_mm256_or_ps(a.lo, b.lo), _mm256_or_ps(a.hi, b.hi)}; }
LLMSERVE_INLINE vm mask_and(vm a, vm b) { return {_mm256_and_ps(a.lo, b.lo), _mm256_and_ps(a.hi, b.hi)}; }

LLMSERVE_INLINE vf zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
LLMSERVE_INLINE vf set1(float x) { const __m256 v = _mm256_set1_ps(x); return {v, v}; }
LLMSERVE_INLINE vf load(const float* p) { return {_mm256_load_ps(p), _mm256_load_ps(p + 8)}; }  // 32-byte aligned
LLMSERVE_INLINE vf loadu(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
LLMSERVE_INLINE void store(float* p, vf v) { _mm256_store_ps(p, v.lo); _mm256_store_ps(p + 8, v.hi); }
LLMSERVE_INLINE void storeu(float* p, vf v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }
LLMSERVE_INLINE vf load_bits(const void* p) { return loadu(static_cast<const float*>(p)); }

#define LLMSERVE_VF_BINARY(name, op) \
  LLMSERVE_INLINE vf name(vf a, vf b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
LLMSERVE_VF_BINARY(add, _mm256_add_ps)
LLMSERVE_VF_BINARY(sub, _mm256_sub_ps)
LLMSERVE_VF_BINARY(mul, _mm256_mul_ps)
LLMSERVE_VF_BINARY(div, _mm256_div_ps)
LLMSERVE_VF_BINARY(max, _mm256_max_ps)
LLMSERVE_VF_BINARY(min, _mm256_min_ps)
#undef LLMSERVE_VF_BINARY
LLMSERVE_INLINE vf fmadd(vf a, vf b, vf c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
LLMSERVE_INLINE vf fnmadd(vf a, vf b, vf c) { return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)}; }
LLMSERVE_INLINE vf abs(vf a) {
  const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  return {_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m)};
}
LLMSERVE_INLINE float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
LLMSERVE_INLINE float reduce_add(vf a) { return hsum8(_mm256_add_ps(a.lo, a.hi)); }
LLMSERVE_INLINE float reduce_max(vf a) {
  __m256 v = _mm256_max_ps(a.lo, a.hi);
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

LLMSERVE_INLINE vf where(vm m, vf if_set, vf if_clear) {
  return {_mm256_blendv_ps(if_clear.lo, if_set.lo, m.lo), _mm256_blendv_ps(if_clear.hi, if_set.hi, m.hi)};
}
LLMSERVE_INLINE vf maskz(vm m, vf a) { return {_mm256_and_ps(m.lo, a.lo), _mm256_and_ps(m.hi, a.hi)}; }
LLMSERVE_INLINE vm greater(vf a, vf b) { return {_mm256_cmp_ps(a.lo, b.lo, _CMP_GT_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_GT_OQ)}; }
LLMSERVE_INLINE vm equal(vf a, vf b) { return {_mm256_cmp_ps(a.lo, b.lo, _CMP_EQ_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_EQ_OQ)}; }
LLMSERVE_INLINE vm is_nan(vf a) { return {_mm256_cmp_ps(a.lo, a.lo, _CMP_UNORD_Q), _mm256_cmp_ps(a.hi, a.hi, _CMP_UNORD_Q)}; }

LLMSERVE_INLINE vi zero_i32() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
LLMSERVE_INLINE vi set1_i32(int32_t x) { const __m256i v = _mm256_set1_epi32(x); return {v, v}; }
LLMSERVE_INLINE vi iota_i32() { return {_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)}; }
LLMSERVE_INLINE vi loadu_i32(const int32_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8))};
}
LLMSERVE_INLINE vi add_i32(vi a, vi b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
LLMSERVE_INLINE vi where_i32(vm m, vi if_set, vi if_clear) {
  return {_mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(if_clear.lo), _mm256_castsi256_ps(if_set.lo), m.lo)),
          _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(if_clear.hi), _mm256_castsi256_ps(if_set.hi), m.hi))};
}
LLMSERVE_INLINE vm greater_equal_i32(vi a, vi b) {  // a >= b as not (b > a)
  const __m256i ones = _mm256_set1_epi32(-1);
  return {_mm256_castsi256_ps(_mm256_xor_si256(_mm256_cmpgt_epi32(b.lo, a.lo), ones)),
          _mm256_castsi256_ps(_mm256_xor_si256(_mm256_cmpgt_epi32(b.hi, a.hi), ones))};
}
LLMSERVE_INLINE int32_t reduce_min_i32(vm m, vi a) {
  const __m256i big = _mm256_set1_epi32(INT32_MAX);
  const __m256i lo = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(big), _mm256_castsi256_ps(a.lo), m.lo));
  const __m256i hi = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(big), _mm256_castsi256_ps(a.hi), m.hi));
  __m256i v = _mm256_min_epi32(lo, hi);
  __m128i s = _mm_min_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_min_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_min_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}
LLMSERVE_INLINE vf to_float(vi a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
LLMSERVE_INLINE vi as_int(vf a) { return {_mm256_castps_si256(a.lo), _mm256_castps_si256(a.hi)}; }
LLMSERVE_INLINE vf as_float(vi a) { return {_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi)}; }

LLMSERVE_INLINE vi even_bytes_i16(vi a) {
  return {_mm256_srai_epi16(_mm256_slli_epi16(a.lo, 8), 8), _mm256_srai_epi16(_mm256_slli_epi16(a.hi, 8), 8)};
}
LLMSERVE_INLINE vi odd_bytes_i16(vi a) { return {_mm256_srai_epi16(a.lo, 8), _mm256_srai_epi16(a.hi, 8)}; }
LLMSERVE_INLINE vi add_dot_i16(vi sum, vi a, vi b) {
  return {_mm256_add_epi32(sum.lo, _mm256_madd_epi16(a.lo, b.lo)), _mm256_add_epi32(sum.hi, _mm256_madd_epi16(a.hi, b.hi))};
}

LLMSERVE_INLINE vf load16(const float* p, vm m) {
  return {_mm256_maskload_ps(p, _mm256_castps_si256(m.lo)), _mm256_maskload_ps(p + 8, _mm256_castps_si256(m.hi))};
}
LLMSERVE_INLINE vf load16(const float* p) { return loadu(p); }
LLMSERVE_INLINE __m256 widen_bf16_8(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
LLMSERVE_INLINE vf widen_bf16(__m256i h) {
  return {widen_bf16_8(_mm256_castsi256_si128(h)), widen_bf16_8(_mm256_extracti128_si256(h, 1))};
}
LLMSERVE_INLINE vf load16(const c10::BFloat16* p) { return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
// AVX2 has no 16-bit masked load: a partial mask copies its lanes through a zeroed buffer.
LLMSERVE_INLINE vf load16(const c10::BFloat16* p, vm m) {
  const int b = bits(m);
  if (b == 0xFFFF) return load16(p);
  alignas(32) uint16_t buf[16] = {};
  for (int u = 0; u < 16; ++u)
    if (b >> u & 1) std::memcpy(buf + u, p + u, 2);
  return widen_bf16(_mm256_load_si256(reinterpret_cast<const __m256i*>(buf)));
}
LLMSERVE_INLINE vf load16(const int8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
}
// e4m3 bytes as fp32 times 2^-8, exactly (see vec_avx512.h): 8 from the low 8 bytes of b, and 16.
LLMSERVE_INLINE __m256 fp8_shifted8(__m128i b) {
  const __m128i h = _mm_cvtepi8_epi16(b);
  return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(h, 7), _mm_set1_epi16(static_cast<int16_t>(0xBF80))));
}
LLMSERVE_INLINE vf load16_fp8_shifted(const void* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {fp8_shifted8(b), fp8_shifted8(_mm_srli_si128(b, 8))};
}
LLMSERVE_INLINE vf load16_or(const float* p, vm m, vf fill) { return where(m, load16(p, m), fill); }

LLMSERVE_INLINE __m256i bf16_rounded_bits8(__m256 v) {  // rounded bits in each lane's low 16
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
}
// fp32 -> bf16 bits, round to nearest even (finite inputs): 16 uint16 in lane order.
LLMSERVE_INLINE __m256i to_bf16_bits(vf v) {
  // packus works per 128-bit half: [lo 0-3, hi 0-3, lo 4-7, hi 4-7] -> reorder the 64-bit quarters.
  const __m256i packed = _mm256_packus_epi32(bf16_rounded_bits8(v.lo), bf16_rounded_bits8(v.hi));
  return _mm256_permute4x64_epi64(packed, 0xD8);
}

// Rounded to int32 (half to even), then narrowed to 16 int16 in lane order (values in int16 range).
LLMSERVE_INLINE __m256i to_int16(vf v) {
  // packs works per 128-bit half ([lo 0-3, hi 0-3, lo 4-7, hi 4-7]): reorder the quarters.
  const __m256i packed = _mm256_packs_epi32(_mm256_cvtps_epi32(v.lo), _mm256_cvtps_epi32(v.hi));
  return _mm256_permute4x64_epi64(packed, 0xD8);
}

LLMSERVE_INLINE void store16(float* p, vf v, vm m) {
  _mm256_maskstore_ps(p, _mm256_castps_si256(m.lo), v.lo);
  _mm256_maskstore_ps(p + 8, _mm256_castps_si256(m.hi), v.hi);
}
LLMSERVE_INLINE void store16(float* p, vf v) { storeu(p, v); }
LLMSERVE_INLINE void store16(c10::BFloat16* p, vf v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16_bits(v)); }
LLMSERVE_INLINE void store16(c10::BFloat16* p, vf v, vm m) {
  const int b = bits(m);
  if (b == 0xFFFF) return store16(p, v);
  alignas(32) uint16_t buf[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(buf), to_bf16_bits(v));
  for (int u = 0; u < 16; ++u)
    if (b >> u & 1) std::memcpy(p + u, buf + u, 2);
}

// A 16 x 16 fp32 transpose in place, r[i] lane j <- r[j] lane i: four 8 x 8 transposes, the
// off-diagonal quarters swapped.
LLMSERVE_INLINE void transpose16(vf (&r)[16]) {
  __m256 a[8], b[8], c[8], d[8];  // rows 0-7 lo, rows 0-7 hi, rows 8-15 lo, rows 8-15 hi
  for (int i = 0; i < 8; ++i) {
    a[i] = r[i].lo;
    b[i] = r[i].hi;
    c[i] = r[i + 8].lo;
    d[i] = r[i + 8].hi;
  }
  transpose8(a);
  transpose8(b);
  transpose8(c);
  transpose8(d);
  for (int i = 0; i < 8; ++i) {
    r[i] = {a[i], c[i]};
    r[i + 8] = {b[i], d[i]};
  }
}

LLMSERVE_INLINE vf round_to_int(vf x) {
  return {_mm256_round_ps(x.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
          _mm256_round_ps(x.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
// p * 2^n for integral n in [-252, 254], built in two halves so each exponent stays representable
// (as AVX-512's scalef: an overflow gives inf).
LLMSERVE_INLINE __m256 pow2_8(__m256i n) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23)); }
LLMSERVE_INLINE __m256 scale_by_pow2_8(__m256 p, __m256 n) {
  const __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1);
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2_8(half)), pow2_8(_mm256_sub_epi32(ni, half)));
}
LLMSERVE_INLINE vf scale_by_pow2(vf p, vf n) { return {scale_by_pow2_8(p.lo, n.lo), scale_by_pow2_8(p.hi, n.hi)}; }

}  // namespace vec
