// Decode attention (decode_attention.cpp): the scores of a KV head's query heads against 16 keys, in
// each cache dtype and each level's form, and the int16 queries of an int8 cache.
#pragma once

#include "decode_blocks.h"

namespace llmserve {
namespace decode {

// Scores of G query heads (head_dim = NV * 16 apart at q) against nt <= 16 key rows (stride apart at
// k): dot[j] lane u = q_j . k_u, 0 for u >= nt. Mostly the rows' 32-bit units (a dim, a bf16 pair or
// four int8) are moved into lanes by register transposes, so each key's products accumulate in its
// own lane: no horizontal sums. The AVX-512 forms sum a key's products in dim order; AVX2's
// transposing forms sum its even and odd dims apart (int8: exact int32 sums at every level).
//
// bf16 keys without AVX512-BF16 take the queries widened to fp32 once per item (widen_query). On
// AVX-512 the rows' bf16 pairs are transposed as they are (half the transposes of widening first),
// then each pair widens by a shift (the low, even dim) or a mask (the high, odd dim); AVX2 keeps the
// dims in lanes instead (see its form).
//
// int8 keys go against queries quantized to int16 (one scale per head, relative error 2^-16 of the
// head's largest element: far below bf16's rounding) and stored as pairs by prepare_query_int16:
// after the transpose a lane holds four int8 of one key, whose even and odd bytes sign-extend to
// int16 pairs (dims 4i, 4i+2 and 4i+1, 4i+3) for exact products summed pairwise into int32 lanes that
// cannot overflow (64 x 127 x 32767 < 2^31 per lane at head_dim 128). The caller multiplies each
// finished score by the query's and the key row's scales.
#if LLMSERVE_VEC_AVX512
// AVX-512: all 16 keys at once, 64 bytes of their rows per 16 x 16 transpose (16 of the 32 registers).

// 64 bytes of each of 16 key rows (at `first` + u * stride_bytes; zero for u >= nt), transposed: r[i]
// lane u = row u's 32-bit unit i (a bf16 pair or four int8, as fp32 bits).
LLMSERVE_INLINE void load_units_transposed(vf (&r)[16], const void* first, int64_t stride_bytes, int64_t nt) {
  const char* p = static_cast<const char*>(first);
  for (int64_t u = 0; u < 16; ++u) r[u] = u < nt ? load_bits(p + u * stride_bytes) : zero();
  transpose16(r);
}

template <int G, int NV>
inline void key_scores(vf (&dot)[G], const float* q, const float* k, int64_t stride, int64_t nt) {
  for (int j = 0; j < G; ++j) dot[j] = zero();
  for (int c = 0; c < NV; ++c) {  // 16 dims at a time
    vf r[16];
    for (int64_t u = 0; u < 16; ++u) r[u] = u < nt ? loadu(k + u * stride + c * 16) : zero();
    transpose16(r);  // r[i] lane u = k_u[16c + i]
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < G; ++j) dot[j] = fmadd(set1(q[j * NV * 16 + c * 16 + i]), r[i], dot[j]);
  }
}

// fp8 keys against fp32 queries: each row's 16 bytes widened exactly (times 2^-8, see common.h), then
// transposed as fp32 rows are.
template <int G, int NV>
inline void key_scores(vf (&dot)[G], const float* q, const Fp8* k, int64_t stride, int64_t nt) {
  for (int j = 0; j < G; ++j) dot[j] = zero();
  for (int c = 0; c < NV; ++c) {  // 16 dims at a time
    vf r[16];
    for (int64_t u = 0; u < 16; ++u) r[u] = u < nt ? load16_fp8_shifted(k + u * stride + c * 16) : zero();
    transpose16(r);  // r[i] lane u = k_u[16c + i] * 2^-8
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < G; ++j) dot[j] = fmadd(set1(q[j * NV * 16 + c * 16 + i]), r[i], dot[j]);
  }
}

#if defined(__AVX512BF16__)
// bf16 keys and queries multiply as they are: 32 exact products per instruction, summed in fp32.
template <int G, int NV>
inline void key_scores(__m512 (&dot)[G], const c10::BFloat16* q, const c10::BFloat16* k, int64_t stride, int64_t nt) {
  for (int j = 0; j < G; ++j) dot[j] = _mm512_setzero_ps();
  for (int c = 0; c < NV / 2; ++c) {  // 16 pairs = 32 dims at a time
    __m512 r[16];
    // r[i] lane u = (k_u[32c + 2i], k_u[32c + 2i + 1])
    load_units_transposed(r, k + c * 32, stride * static_cast<int64_t>(sizeof(*k)), nt);
    const uint32_t* qp = reinterpret_cast<const uint32_t*>(q) + c * 16;
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < G; ++j)
        dot[j] = _mm512_dpbf16_ps(dot[j], (__m512bh)_mm512_castps_si512(r[i]), (__m512bh)_mm512_set1_epi32(qp[j * NV * 8 + i]));
  }
}
#else
template <int G, int NV>
inline void key_scores(vf (&dot)[G], const float* q, const c10::BFloat16* k, int64_t stride, int64_t nt) {
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int j = 0; j < G; ++j) dot[j] = zero();
  for (int c = 0; c < NV / 2; ++c) {  // 16 pairs = 32 dims at a time
    vf r[16];
    // r[i] lane u = (k_u[32c + 2i], k_u[32c + 2i + 1])
    load_units_transposed(r, k + c * 32, stride * static_cast<int64_t>(sizeof(*k)), nt);
    for (int i = 0; i < 16; ++i) {
      const __m512i x = _mm512_castps_si512(r[i]);
      const vf even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)), odd = _mm512_castsi512_ps(_mm512_and_si512(x, high));
      for (int j = 0; j < G; ++j) {
        const float* qj = q + j * NV * 16 + c * 32 + 2 * i;
        dot[j] = fmadd(set1(qj[0]), even, dot[j]);
        dot[j] = fmadd(set1(qj[1]), odd, dot[j]);
      }
    }
  }
}
#endif

template <int G, int NV>
inline void key_scores(vf (&dot)[G], const int32_t* q, const int8_t* k, int64_t stride, int64_t nt) {
  vi acc[G];
  for (int j = 0; j < G; ++j) acc[j] = zero_i32();
  for (int c = 0; c < NV / 4; ++c) {  // 64 dims at a time
    vf r[16];
    load_units_transposed(r, k + c * 64, stride, nt);  // r[i] lane u = k_u[64c + 4i .. 64c + 4i + 3]
    for (int i = 0; i < 16; ++i) {
      const vi x = as_int(r[i]);
      const vi even = even_bytes_i16(x), odd = odd_bytes_i16(x);
      const int32_t* qi = q + 2 * (c * 16 + i);
      for (int j = 0; j < G; ++j) {
        acc[j] = add_dot_i16(acc[j], even, set1_i32(qi[j * NV * 8]));
        acc[j] = add_dot_i16(acc[j], odd, set1_i32(qi[j * NV * 8 + 1]));
      }
    }
  }
  for (int j = 0; j < G; ++j) dot[j] = vec::to_float(acc[j]);
}

#else
// AVX2: 16 registers cannot hold a 16 x 16 transpose's 32 halves next to the sums (the compiler
// spills them), so the keys go as two groups of 8 (lanes 0-7 of the scores, then 8-15), 32 bytes of
// their rows per 8 x 8 transpose, each consumed before the next is loaded. A group past nt is skipped.
// One sum per head would be a chain of dependent FMAs (4 cycles each) that leaves the FMA units idle
// most of the time: the fp32 forms keep two per head, the even and the odd dims, added at the end.

// 32 bytes of each of 8 key rows (at `first` + u * stride_bytes; zero for u >= nt), transposed: r[i]
// lane u = row u's 32-bit unit i.
LLMSERVE_INLINE void load_units_transposed8(__m256 (&r)[8], const void* first, int64_t stride_bytes, int64_t nt) {
  const char* p = static_cast<const char*>(first);
  for (int64_t u = 0; u < 8; ++u)
    r[u] = u < nt ? _mm256_loadu_ps(reinterpret_cast<const float*>(p + u * stride_bytes)) : _mm256_setzero_ps();
  transpose8(r);
}

// Runs group(acc, first, n) for keys 0-7 and 8-15 (first: the group's first row, n: its rows) with G
// fresh accumulators of 8 lanes, which become the scores' low and high halves.
template <int G, typename Acc, typename Group>
LLMSERVE_INLINE void key_groups8(vf (&dot)[G], const char* k, int64_t stride_bytes, int64_t nt, const Group& group) {
  for (int h = 0; h < 2; ++h) {
    Acc acc[G] = {};
    if (nt > 8 * h) group(acc, k + 8 * h * stride_bytes, nt - 8 * h);
    for (int j = 0; j < G; ++j) {
      __m256 sums;
      if constexpr (std::is_same_v<Acc, __m256i>) sums = _mm256_cvtepi32_ps(acc[j]);
      else sums = acc[j];
      (h == 0 ? dot[j].lo : dot[j].hi) = sums;
    }
  }
}

template <int G, int NV>
inline void key_scores(vf (&dot)[G], const float* q, const float* k, int64_t stride, int64_t nt) {
  const int64_t sb = stride * static_cast<int64_t>(sizeof(*k));
  key_groups8<G, __m256>(dot, reinterpret_cast<const char*>(k), sb, nt, [&](__m256 (&acc)[G], const char* rows, int64_t n) {
    __m256 odd_acc[G] = {};
    for (int c = 0; c < 2 * NV; ++c) {  // 8 dims at a time
      __m256 r[8];
      load_units_transposed8(r, rows + c * 32, sb, n);  // r[i] lane u = k_u[8c + i]
      for (int i = 0; i < 8; i += 2)
        for (int j = 0; j < G; ++j) {
          const float* qj = q + j * NV * 16 + c * 8 + i;
          acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(qj[0]), r[i], acc[j]);
          odd_acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(qj[1]), r[i + 1], odd_acc[j]);
        }
    }
    for (int j = 0; j < G; ++j) acc[j] = _mm256_add_ps(acc[j], odd_acc[j]);
  });
}

// bf16 keys, against queries split once per item as the keys' pairs widen (widen_query: for each 16
// dims, the 8 even then the 8 odd). Up to 3 heads a KV head, the dims stay in lanes: a key's 16 dims
// load as 8 pairs whose shift gives the even dims and whose mask the odd ones, each product pairs a key
// vector with a query vector read as the FMA's memory operand, and no operand is a broadcast (on Zen 3
// these issue once a cycle, half the FMA rate: the transposing form spends one on every FMA). Four keys
// x G heads of sums (12 registers at G = 3), then one horizontal reduction of each head's four: 1.29x
// the transposing form's speed at G = 3, 0.96x at G = 4 and 0.83x at G = 8 (more sums than registers),
// which therefore keep it.
LLMSERVE_INLINE __m128 sum_each4(__m256 a, __m256 b, __m256 c, __m256 d) {  // lane i: the sum of input i
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

template <int G, int NV>
inline void key_scores(vf (&dot)[G], const float* q, const c10::BFloat16* k, int64_t stride, int64_t nt) {
  if constexpr (G > 3) {
    const int64_t sb = stride * static_cast<int64_t>(sizeof(*k));
    key_groups8<G, __m256>(dot, reinterpret_cast<const char*>(k), sb, nt, [&](__m256 (&acc)[G], const char* rows, int64_t n) {
      __m256 odd_acc[G] = {};
      for (int c = 0; c < NV; ++c) {  // 8 pairs = 16 dims at a time
        __m256 r[8];
        load_units_transposed8(r, rows + c * 32, sb, n);  // r[i] lane u = (k_u[16c + 2i], k_u[16c + 2i + 1])
        for (int i = 0; i < 8; ++i) {
          const __m256i x = _mm256_castps_si256(r[i]);
          const __m256 even = vec::bf16_even(x);
          const __m256 odd = vec::bf16_odd(x);
          for (int j = 0; j < G; ++j) {
            const float* qj = q + j * NV * 16 + c * 16 + i;  // its dim 16c + 2i; 16c + 2i + 1 eight on
            acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(qj[0]), even, acc[j]);
            odd_acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(qj[8]), odd, odd_acc[j]);
          }
        }
      }
      for (int j = 0; j < G; ++j) acc[j] = _mm256_add_ps(acc[j], odd_acc[j]);
    });
    return;
  }
  alignas(32) float sums[G][16];
  for (int64_t t0 = 0; t0 < 16; t0 += 4) {
    if (t0 >= nt) {
      for (int j = 0; j < G; ++j) _mm_store_ps(sums[j] + t0, _mm_setzero_ps());
      continue;
    }
    __m256 acc[4][G];
    for (int u = 0; u < 4; ++u)
      for (int j = 0; j < G; ++j) acc[u][j] = _mm256_setzero_ps();
    for (int c = 0; c < NV; ++c) {  // 8 pairs = 16 dims at a time
      __m256i x[4];
      for (int u = 0; u < 4; ++u)
        x[u] = t0 + u < nt ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + (t0 + u) * stride + c * 16))
                           : _mm256_setzero_si256();
      for (int u = 0; u < 4; ++u) {
        const __m256 even = vec::bf16_even(x[u]);
        for (int j = 0; j < G; ++j) acc[u][j] = _mm256_fmadd_ps(even, _mm256_loadu_ps(q + j * NV * 16 + c * 16), acc[u][j]);
      }
      for (int u = 0; u < 4; ++u) {
        const __m256 odd = vec::bf16_odd(x[u]);
        for (int j = 0; j < G; ++j) acc[u][j] = _mm256_fmadd_ps(odd, _mm256_loadu_ps(q + j * NV * 16 + c * 16 + 8), acc[u][j]);
      }
    }
    for (int j = 0; j < G; ++j) _mm_store_ps(sums[j] + t0, sum_each4(acc[0][j], acc[1][j], acc[2][j], acc[3][j]));
  }
  for (int j = 0; j < G; ++j) dot[j] = {_mm256_load_ps(sums[j]), _mm256_load_ps(sums[j] + 8)};
}

template <int G, int NV>
inline void key_scores(vf (&dot)[G], const int32_t* q, const int8_t* k, int64_t stride, int64_t nt) {
  key_groups8<G, __m256i>(dot, reinterpret_cast<const char*>(k), stride, nt, [&](__m256i (&acc)[G], const char* rows, int64_t n) {
    for (int c = 0; c < NV / 2; ++c) {  // 32 dims at a time
      __m256 r[8];
      load_units_transposed8(r, rows + c * 32, stride, n);  // r[i] lane u = k_u[32c + 4i .. 32c + 4i + 3]
      for (int i = 0; i < 8; ++i) {
        const __m256i x = _mm256_castps_si256(r[i]);
        const __m256i even = _mm256_srai_epi16(_mm256_slli_epi16(x, 8), 8), odd = _mm256_srai_epi16(x, 8);
        const int32_t* qi = q + 2 * (c * 8 + i);
        for (int j = 0; j < G; ++j) {
          acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(even, _mm256_set1_epi32(qi[j * NV * 8])));
          acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(odd, _mm256_set1_epi32(qi[j * NV * 8 + 1])));
        }
      }
    }
  });
}

// fp8 keys: 8 bytes of each of 8 rows widened exactly (times 2^-8, see common.h), then as fp32.
template <int G, int NV>
inline void key_scores(vf (&dot)[G], const float* q, const Fp8* k, int64_t stride, int64_t nt) {
  key_groups8<G, __m256>(dot, reinterpret_cast<const char*>(k), stride, nt, [&](__m256 (&acc)[G], const char* rows, int64_t n) {
    __m256 odd_acc[G] = {};
    for (int c = 0; c < 2 * NV; ++c) {  // 8 dims at a time
      __m256 r[8];
      for (int64_t u = 0; u < 8; ++u)
        r[u] = u < n ? fp8_shifted8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(rows + u * stride + c * 8))) : _mm256_setzero_ps();
      transpose8(r);  // r[i] lane u = k_u[8c + i] * 2^-8
      for (int i = 0; i < 8; i += 2)
        for (int j = 0; j < G; ++j) {
          const float* qj = q + j * NV * 16 + c * 8 + i;
          acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(qj[0]), r[i], acc[j]);
          odd_acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(qj[1]), r[i + 1], odd_acc[j]);
        }
    }
    for (int j = 0; j < G; ++j) acc[j] = _mm256_add_ps(acc[j], odd_acc[j]);
  });
}
#endif

// The item's `count` query values (a multiple of 16) as fp32 in the order key_scores reads them for
// keys of type C: in dim order, or for bf16 keys on AVX2 each 16 dims as their 8 even then 8 odd.
template <typename C, typename T>
inline void widen_query(float* dst, const T* q, int64_t count) {
#if !LLMSERVE_VEC_AVX512
  if constexpr (std::is_same_v<C, c10::BFloat16>) {
    for (int64_t i = 0; i < count; i += 16)
      for (int64_t d = 0; d < 8; ++d) dst[i + d] = to_float(q[i + 2 * d]), dst[i + 8 + d] = to_float(q[i + 2 * d + 1]);
    return;
  }
#endif
  for (int64_t i = 0; i < count; ++i) dst[i] = to_float(q[i]);
}

// Each of the num_heads * head_dim query values as int16 (round half to even) with one fp32 scale per
// head, stored as the int16 pairs key_scores multiplies: for each four dims, (q[4i], q[4i+2]) then
// (q[4i+1], q[4i+3]).
template <typename T>
void prepare_query_int16(int32_t* dst, float* scales, const T* q, int64_t num_heads, int64_t head_dim) {
  for (int64_t h = 0; h < num_heads; ++h) {
    const T* x = q + h * head_dim;
    float amax = 0.f;
    for (int64_t i = 0; i < head_dim; ++i) amax = std::max(amax, std::fabs(to_float(x[i])));
    scales[h] = amax / 32767.f;
    auto q16 = [&](int64_t i) -> uint32_t {
      return static_cast<uint16_t>(amax > 0.f ? static_cast<int16_t>(std::nearbyint(to_float(x[i]) / scales[h])) : 0);
    };
    for (int64_t i = 0; i < head_dim; i += 4) {
      dst[(h * head_dim + i) / 2] = static_cast<int32_t>(q16(i) | q16(i + 2) << 16);
      dst[(h * head_dim + i) / 2 + 1] = static_cast<int32_t>(q16(i + 1) | q16(i + 3) << 16);
    }
  }
}

}  // namespace decode
}  // namespace llmserve
