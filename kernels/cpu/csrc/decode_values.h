// Decode attention (decode_attention.cpp): the softmax-weighted sums of the value rows, in each cache
// dtype and each level's form.
#pragma once

#include "decode_blocks.h"

namespace llmserve {
namespace decode {

// How weighted_values below goes through the value rows. AVX-512 (32 registers): four rows at a
// time, every head's G * NV accumulator vectors in registers for them. AVX2 (16 registers, two a
// vector): a block's 16 rows at a time (fewer round trips of the accumulators through memory), and
// per head as many vectors of dims as leave room for the value and its weight (kValuesPerPass) go
// through those rows before the next ones.
#if LLMSERVE_VEC_AVX512
constexpr int64_t kValueRows = 4;
template <int G, int NV>
constexpr int kValuesPerPass = NV;
#else
constexpr int64_t kValueRows = 16;
template <int G, int NV>
constexpr int kValuesPerPass = G <= 1 ? 4 : G <= 3 ? 2 : 1;
#endif

// bf16 values on AVX2, one pass of weighted_values: the G heads' sums of VP 16-dim vectors from `sums`
// (head_dim apart) += their weights (sk, span apart) times rows [0, nt) from `rows` (kv_row apart).
// Each 16 values widen as [8 even dims | 8 odd dims] (a shift and a mask of one load, no cross-lane
// widening; interleave_even_odd puts the sums back in order at the end), each half straight from
// memory into one register; a row's G weights are broadcast once for all its products where the
// registers allow (G x 2VP sums, G weights and a value: up to G = 5 at kValuesPerPass), else at each
// product. (A broadcast for every two products, both halves widened in registers beside the sums: the
// same pass took 1.5x as long in a microbenchmark.) Plain AVX2 code, which every level compiles; the
// AVX-512 levels take their own form.
template <int G, int VP>
LLMSERVE_INLINE void bf16_value_rows(float* sums, int64_t head_dim, const float* sk, int64_t span, const c10::BFloat16* rows,
                                     int64_t kv_row, int64_t nt) {
  constexpr bool kHoist = G * (2 * VP + 1) + 1 <= 16;
  __m256 acc[G][2 * VP];
#pragma GCC unroll 8
  for (int j = 0; j < G; ++j)
#pragma GCC unroll 8
    for (int h = 0; h < 2 * VP; ++h) acc[j][h] = _mm256_loadu_ps(sums + j * head_dim + 8 * h);
  for (int64_t u = 0; u < nt; ++u) {
    const c10::BFloat16* vr = rows + u * kv_row;
    __m256 w[G];
    if constexpr (kHoist)
#pragma GCC unroll 8
      for (int j = 0; j < G; ++j) w[j] = _mm256_broadcast_ss(sk + j * span + u);
    auto weight = [&](int j) {
      if constexpr (kHoist) return w[j];
      else return _mm256_broadcast_ss(sk + j * span + u);
    };
#pragma GCC unroll 4
    for (int v = 0; v < VP; ++v) {
      const __m256 even = vec::bf16_even_at(vr + v * 16);
#pragma GCC unroll 8
      for (int j = 0; j < G; ++j) acc[j][2 * v] = _mm256_fmadd_ps(weight(j), even, acc[j][2 * v]);
      const __m256 odd = vec::bf16_odd_at(vr + v * 16);
#pragma GCC unroll 8
      for (int j = 0; j < G; ++j) acc[j][2 * v + 1] = _mm256_fmadd_ps(weight(j), odd, acc[j][2 * v + 1]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < G; ++j)
#pragma GCC unroll 8
    for (int h = 0; h < 2 * VP; ++h) _mm256_storeu_ps(sums + j * head_dim + 8 * h, acc[j][h]);
}

// 16 values of a row as fp32, in the order weighted_values accumulates them: fp32 as they are; bf16
// widened (on AVX2, bf16_value_rows above).
LLMSERVE_INLINE vf load_values(const float* p) { return loadu(p); }
LLMSERVE_INLINE vf load_values(const Fp8* p) { return load16_fp8_shifted(p); }  // times 2^-8
#if LLMSERVE_VEC_AVX512
LLMSERVE_INLINE vf load_values(const c10::BFloat16* p) { return load16(p); }
#else
// `count` sums (a multiple of 16) from [8 even dims | 8 odd dims] back to dim order, in place.
inline void interleave_even_odd(float* sums, int64_t count) {
  for (float* a = sums; a < sums + count; a += 16) {
    const __m256 even = _mm256_loadu_ps(a), odd = _mm256_loadu_ps(a + 8);
    const __m256 lo = _mm256_unpacklo_ps(even, odd), hi = _mm256_unpackhi_ps(even, odd);  // dims 0-3, 8-11 | 4-7, 12-15
    _mm256_storeu_ps(a, _mm256_permute2f128_ps(lo, hi, 0x20));
    _mm256_storeu_ps(a + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
  }
}
#endif

// One pass of weighted_values for fp32, fp8 and (with AVX-512) bf16 values: the G heads' sums of VP
// 16-dim vectors from `sums` (head_dim apart) += their weights (sk, span apart) times dims
// [16 v0, 16 (v0 + VP)) of rows [0, nt) from `head` (each row's values of one KV head, kv_row
// apart; fp8 rows carry their scale after head_dim values).
template <int G, int VP, typename C>
LLMSERVE_INLINE void value_rows(float* sums, int64_t head_dim, const float* sk, int64_t span, const C* head, int v0,
                                int64_t kv_row, int64_t nt) {
  vf acc[G][VP];
  for (int j = 0; j < G; ++j)
    for (int v = 0; v < VP; ++v) acc[j][v] = loadu(sums + j * head_dim + v * 16);
  for (int64_t u = 0; u < nt; ++u) {
    const C* vr = head + u * kv_row;
    float row_scale_unshifted = 1.f;
    if constexpr (std::is_same_v<C, Fp8>) row_scale_unshifted = row_scale(vr, head_dim) * kFp8Unshift;
    for (int v = 0; v < VP; ++v) {
      const vf val = load_values(vr + (v0 + v) * 16);
      for (int j = 0; j < G; ++j) {
        float w = sk[j * span + u];
        if constexpr (std::is_same_v<C, Fp8>) w *= row_scale_unshifted;
        acc[j][v] = fmadd(set1(w), val, acc[j][v]);
      }
    }
  }
  for (int j = 0; j < G; ++j)
    for (int v = 0; v < VP; ++v) storeu(sums + j * head_dim + v * 16, acc[j][v]);
}

// accs [kv_heads * G heads][head_dim] += the part's softmax weights (sc: [head][span], the part's
// keys from block b_lo on) times its value rows, in fp32 products, kValueRows rows at a time and
// every head for them before the next ones; a head's accumulators stay in registers for those rows,
// in the buffer between them. fp32 values, bf16 ones without AVX512-BF16, and fp8 ones (each weight
// times its row's scale); the overloads below take bf16 (with AVX512-BF16) and int8 values. Each dim's
// sum takes the rows in order.
template <int G, int NV, typename C>
void weighted_values(float* accs, const float* sc, int64_t span, const C* v_cache, const int64_t* table,
                     int64_t b_lo, int64_t b_hi, int64_t len, int64_t block_size, int64_t kv_heads, const FirstBlocks<C>& next) {
  constexpr int64_t head_dim = NV * 16, head_row = cache_row_len<C>(head_dim);
  constexpr int VP = kValuesPerPass<G, NV>;
  constexpr bool kBf16Rows = !LLMSERVE_VEC_AVX512 && std::is_same_v<C, c10::BFloat16>;  // bf16_value_rows
  static_assert(NV % VP == 0, "whole passes");
  const int64_t kv_row = kv_heads * head_row;
  for_each_block(v_cache, table, b_lo, b_hi, len, block_size, kv_row, next,
                 [&](const C* vb, const C* ahead, int64_t n, int64_t t0) {
    for (int64_t t = 0; t < n; t += kValueRows) {
      const int64_t nt = std::min<int64_t>(kValueRows, n - t), ahead_rows = std::min<int64_t>(kValueRows, block_size - t);
#if LLMSERVE_VEC_AVX512
      if (ahead != nullptr) prefetch_rows(ahead + t * kv_row, ahead_rows, kv_row, kv_row);
#endif
      for (int64_t kh = 0; kh < kv_heads; ++kh) {
#if !LLMSERVE_VEC_AVX512
        prefetch_share(ahead, t, ahead_rows, kh, kv_heads, kv_row);  // 16 rows: spread over the heads
#endif
        const float* sk = sc + kh * G * span + t0 + t;
        float* ak = accs + kh * G * head_dim;
        const C* head = vb + t * kv_row + kh * head_row;  // row t's values of KV head kh
        for (int v0 = 0; v0 < NV; v0 += VP) {
          if constexpr (kBf16Rows)
            bf16_value_rows<G, VP>(ak + v0 * 16, head_dim, sk, span, head + v0 * 16, kv_row, nt);
          else
            value_rows<G, VP>(ak + v0 * 16, head_dim, sk, span, head, v0, kv_row, nt);
        }
      }
    }
  });
#if !LLMSERVE_VEC_AVX512
  if constexpr (std::is_same_v<C, c10::BFloat16>) interleave_even_odd(accs, G * kv_heads * head_dim);
#endif
}

// The partner of a key without one (the odd last key of a block): a value row of zeros, as long as
// the longest row (head_dim 128 in bf16).
alignas(64) constexpr uint8_t kZeroRow[256] = {};

// The weights of nt <= 16 keys (from `sc`, each head's `span` apart) times their value rows' scales
// `vs`, as int16 with one scale per head (round half to even; error 2^-16 of the largest, far below
// the bf16 rounding of the bf16 path): w16[j] holds head j's, then zeros.
template <int G>
LLMSERVE_INLINE void weights_int16(int16_t (&w16)[G][32], float (&w_scale)[G], const float* sc, int64_t span, int64_t nt, vf vs) {
  for (int j = 0; j < G; ++j) {
    const vf w = mul(load_lanes(sc + j * span, nt), vs);
    const float w_max = reduce_max(w);  // weights are >= 0
    w_scale[j] = w_max / 32767.f;
    if (w_max > 0.f) _mm256_store_si256(reinterpret_cast<__m256i*>(w16[j]), to_int16(mul(w, set1(32767.f / w_max))));
  }
}

#if LLMSERVE_VEC_AVX512
// Two keys' value rows a, b interleaved by unpacklo/hi_epi16 into (a[d], b[d]) pairs give, for each
// 32 dims, sums in the order 0-3, 8-11, 16-19, 24-27 (the unpacklo vector) | 4-7, 12-15, 20-23, 28-31
// (the unpackhi one). Puts `count` such sums (a multiple of 32) back in order.
inline void unpermute_pair_sums(float* sums, int64_t count) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (float* a = sums; a < sums + count; a += 32) {
    const __m512 lo = _mm512_loadu_ps(a), hi = _mm512_loadu_ps(a + 16);
    _mm512_storeu_ps(a, _mm512_permutex2var_ps(lo, first, hi));
    _mm512_storeu_ps(a + 16, _mm512_permutex2var_ps(lo, second, hi));
  }
}

// int8 values: a block's keys go 16 at a time. Their weights, times each value row's scale, are held as
// int16 with one scale per head and 16 keys (round half to even; error 2^-16 of the largest, far
// below the bf16 rounding of the bf16 path), and two keys go per instruction: their rows sign-extended
// to int16 and interleaved into (V[u][d], V[u+1][d]) pairs against the broadcast pair of weights, 32
// exact products into int32 sums (at most 16 x 127 x 32767 per lane: no overflow), converted and
// scaled into the fp32 sums after each 16 keys. ~15 instructions a key instead of ~30.
template <int G, int NV>
void weighted_values(float* accs, const float* sc, int64_t span, const int8_t* v_cache, const int64_t* table,
                     int64_t b_lo, int64_t b_hi, int64_t len, int64_t block_size, int64_t kv_heads, const FirstBlocks<int8_t>& next) {
  constexpr int64_t head_dim = NV * 16, head_row = cache_row_len<int8_t>(head_dim);
  const int64_t kv_row = kv_heads * head_row;
  for_each_block(v_cache, table, b_lo, b_hi, len, block_size, kv_row, next,
                 [&](const int8_t* vb, const int8_t* ahead, int64_t n, int64_t t0) {
    for (int64_t t = 0; t < n; t += 16) {
      const int64_t nt = std::min<int64_t>(16, n - t), ahead_rows = std::min<int64_t>(16, block_size - t);
      for (int64_t kh = 0; kh < kv_heads; ++kh) {
        prefetch_share(ahead, t, ahead_rows, kh, kv_heads, kv_row);
        const int8_t* v0 = vb + t * kv_row + kh * head_row;
        const __m512 vs = row_scales16(v0, kv_row, nt, head_dim);
        alignas(64) int16_t w16[G][32] = {};  // the 16 keys' weights, then zeros (a key without a partner)
        float w_scale[G];
        weights_int16<G>(w16, w_scale, sc + kh * G * span + t0 + t, span, nt, vs);
        __m512i acc[G][NV];
        for (int j = 0; j < G; ++j)
          for (int v = 0; v < NV; ++v) acc[j][v] = _mm512_setzero_si512();
        for (int64_t u = 0; u < nt; u += 2) {
          const int8_t* a_row = v0 + u * kv_row;
          const int8_t* b_row = u + 1 < nt ? a_row + kv_row : reinterpret_cast<const int8_t*>(kZeroRow);
          __m512i w[G];
          for (int j = 0; j < G; ++j) {
            int32_t bits;
            std::memcpy(&bits, w16[j] + u, sizeof(bits));  // (w[u], w[u + 1])
            w[j] = _mm512_set1_epi32(bits);
          }
          for (int c = 0; c < NV / 2; ++c) {
            const __m512i a = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a_row + 32 * c)));
            const __m512i z = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b_row + 32 * c)));
            const __m512i lo = _mm512_unpacklo_epi16(a, z), hi = _mm512_unpackhi_epi16(a, z);
            for (int j = 0; j < G; ++j) {
              acc[j][2 * c] = add_dot_i16(acc[j][2 * c], lo, w[j]);
              acc[j][2 * c + 1] = add_dot_i16(acc[j][2 * c + 1], hi, w[j]);
            }
          }
        }
        float* ak = accs + kh * G * head_dim;
        for (int j = 0; j < G; ++j)
          for (int v = 0; v < NV; ++v) {
            float* a = ak + j * head_dim + v * 16;
            _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[j][v]), _mm512_set1_ps(w_scale[j]), _mm512_loadu_ps(a)));
          }
      }
    }
  });
  unpermute_pair_sums(accs, G * kv_heads * head_dim);
}
#else
// int8 values with AVX2: the weights as on AVX-512 (int16, one scale per head and 16 keys), two keys
// per vpmaddwd. Their rows' bytes are interleaved first (punpck{l,h}bw: (a[d], b[d]) for d = 0-7 and
// 8-15) and sign-extended to int16 pairs, which keeps the dims in order: nothing to undo afterwards.
// With 16 registers a head's 16 dims (two int32 vectors) go through all the keys before the next 16.
// The int32 sums are exact, so the result is the AVX-512 path's, bit for bit.
template <int G, int NV>
void weighted_values(float* accs, const float* sc, int64_t span, const int8_t* v_cache, const int64_t* table,
                     int64_t b_lo, int64_t b_hi, int64_t len, int64_t block_size, int64_t kv_heads, const FirstBlocks<int8_t>& next) {
  constexpr int64_t head_dim = NV * 16, head_row = cache_row_len<int8_t>(head_dim);
  const int64_t kv_row = kv_heads * head_row;
  for_each_block(v_cache, table, b_lo, b_hi, len, block_size, kv_row, next,
                 [&](const int8_t* vb, const int8_t* ahead, int64_t n, int64_t t0) {
    for (int64_t t = 0; t < n; t += 16) {
      const int64_t nt = std::min<int64_t>(16, n - t), ahead_rows = std::min<int64_t>(16, block_size - t);
      for (int64_t kh = 0; kh < kv_heads; ++kh) {
        prefetch_share(ahead, t, ahead_rows, kh, kv_heads, kv_row);
        const int8_t* v0 = vb + t * kv_row + kh * head_row;
        const vf vs = row_scales16(v0, kv_row, nt, head_dim);
        alignas(64) int16_t w16[G][32] = {};  // the 16 keys' weights, then zeros (a key without a partner)
        float w_scale[G];
        weights_int16<G>(w16, w_scale, sc + kh * G * span + t0 + t, span, nt, vs);
        float* ak = accs + kh * G * head_dim;
        for (int c = 0; c < NV; ++c) {  // 16 dims at a time
          __m256i acc[G][2];
          for (int j = 0; j < G; ++j) acc[j][0] = acc[j][1] = _mm256_setzero_si256();
          for (int64_t u = 0; u < nt; u += 2) {
            const int8_t* a_row = v0 + u * kv_row;
            const int8_t* b_row = u + 1 < nt ? a_row + kv_row : reinterpret_cast<const int8_t*>(kZeroRow);
            const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a_row + 16 * c));
            const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b_row + 16 * c));
            const __m256i lo = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a, b));  // (a[d], b[d]), d = 16c + 0..7
            const __m256i hi = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(a, b));  // d = 16c + 8..15
            for (int j = 0; j < G; ++j) {
              int32_t bits;
              std::memcpy(&bits, w16[j] + u, sizeof(bits));  // (w[u], w[u + 1])
              const __m256i w = _mm256_set1_epi32(bits);
              acc[j][0] = _mm256_add_epi32(acc[j][0], _mm256_madd_epi16(lo, w));
              acc[j][1] = _mm256_add_epi32(acc[j][1], _mm256_madd_epi16(hi, w));
            }
          }
          for (int j = 0; j < G; ++j) {
            float* a = ak + j * head_dim + c * 16;
            const vf sums = {_mm256_cvtepi32_ps(acc[j][0]), _mm256_cvtepi32_ps(acc[j][1])};
            storeu(a, fmadd(sums, set1(w_scale[j]), loadu(a)));
          }
        }
      }
    }
  });
}
#endif

#if defined(__AVX512BF16__)
// bf16 values: the weights are rounded to bf16 (relative error 2^-9 each, as the prefill kernel and
// flash attention do; the normalizer stays the fp32 sum) and two keys go per dot product: their value
// rows interleaved by unpacklo/hi_epi16 into (V[u][d], V[u+1][d]) pairs against the broadcast pair of
// their weights, 32 products per instruction into fp32 sums. A key's work is ~12 instructions instead
// of ~30 (value widening, G broadcasts, G * NV fused multiply-adds); the sums are put back in
// order once, at the end (unpermute_pair_sums). Rows go four at a time, every head for them before
// the next four, as the fp32 path reads them (a head's whole block at a time, with its share of the
// prefetches in one burst, was slower from DRAM).
template <int G, int NV>
void weighted_values(float* accs, const float* sc, int64_t span, const c10::BFloat16* v_cache, const int64_t* table,
                     int64_t b_lo, int64_t b_hi, int64_t len, int64_t block_size, int64_t kv_heads, const FirstBlocks<c10::BFloat16>& next) {
  constexpr int64_t head_dim = NV * 16;
  const int64_t heads = G * kv_heads, kv_row = kv_heads * head_dim;
  // [head][span + 1]: a key without a partner (odd tail of a block) reads the next weight, or this
  // zero, against a zero value row.
  const int64_t wstride = span + 1;
  thread_local std::vector<uint16_t> weights;
  weights.resize(heads * wstride);
  for (int64_t r = 0; r < heads; ++r) {
    for (int64_t t = 0; t < span; t += 16) {
      const __mmask16 m = tail_mask(span - t);
      _mm256_mask_storeu_epi16(weights.data() + r * wstride + t, m, to_bf16_bits(_mm512_maskz_loadu_ps(m, sc + r * span + t)));
    }
    weights[r * wstride + span] = 0;
  }
  for_each_block(v_cache, table, b_lo, b_hi, len, block_size, kv_row, next,
                 [&](const c10::BFloat16* vb, const c10::BFloat16* ahead, int64_t n, int64_t t0) {
    for (int64_t t = 0; t < n; t += 4) {
      if (ahead != nullptr) prefetch_rows(ahead + t * kv_row, std::min<int64_t>(4, block_size - t), kv_row, kv_row);
      for (int64_t kh = 0; kh < kv_heads; ++kh) {
        float* ak = accs + kh * G * head_dim;
        const uint16_t* wk = weights.data() + kh * G * wstride + t0;
        __m512 acc[G][NV];
        for (int j = 0; j < G; ++j)
          for (int v = 0; v < NV; ++v) acc[j][v] = _mm512_loadu_ps(ak + j * head_dim + v * 16);
        for (int64_t u = t; u < std::min<int64_t>(t + 4, n); u += 2) {
          const c10::BFloat16* v0 = vb + u * kv_row + kh * head_dim;
          const c10::BFloat16* v1 = u + 1 < n ? v0 + kv_row : reinterpret_cast<const c10::BFloat16*>(kZeroRow);
          __m512i w[G];
          for (int j = 0; j < G; ++j) {
            uint32_t bits;
            std::memcpy(&bits, wk + j * wstride + u, sizeof(bits));  // (w[u], w[u + 1])
            w[j] = _mm512_set1_epi32(static_cast<int32_t>(bits));
          }
          for (int c = 0; c < NV / 2; ++c) {
            const __m512i a = _mm512_loadu_si512(v0 + 32 * c);
            const __m512i z = _mm512_loadu_si512(v1 + 32 * c);
            const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, z), hi = (__m512bh)_mm512_unpackhi_epi16(a, z);
            for (int j = 0; j < G; ++j) {
              acc[j][2 * c] = _mm512_dpbf16_ps(acc[j][2 * c], lo, (__m512bh)w[j]);
              acc[j][2 * c + 1] = _mm512_dpbf16_ps(acc[j][2 * c + 1], hi, (__m512bh)w[j]);
            }
          }
        }
        for (int j = 0; j < G; ++j)
          for (int v = 0; v < NV; ++v) _mm512_storeu_ps(ak + j * head_dim + v * 16, acc[j][v]);
      }
    }
  });
  unpermute_pair_sums(accs, heads * head_dim);
}
#endif

}  // namespace decode
}  // namespace llmserve
