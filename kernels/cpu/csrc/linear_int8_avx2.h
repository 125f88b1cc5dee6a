// int8 linear (W8A8) without AVX512-VNNI (the avx2 and avx512 levels), on the same panels of int8 quads
// as the VNNI kernel, with the same integer sums (exact) and the same fp32 epilogue: the results are
// equal bit for bit.
//
// vpmaddubsw (u8 x s8) would saturate: with inputs offset to [1, 255] a pair of products reaches
// 2 * 255 * 127 > 32,767. So both sides are int16 and the products go through vpmaddwd, whose pair sums
// (|.| <= 2 * 127 * 127) are exact in int32. The input rows are quantized as signed int16 (no offset,
// no column-sum correction). A weight quad q[n][4i..4i+3] sign-extends (vpmovsxbw) to two int16 pairs
// in adjacent 32-bit lanes, and the input quad is broadcast as the 64 bits (x[4i], x[4i+1]),
// (x[4i+2], x[4i+3]): vpmaddwd leaves column n's two half sums side by side, and the epilogue adds
// them (vphaddd). A register holds 4 columns, so 8 columns take 2 accumulators a row: a tile is MR rows
// x G groups of 8 columns with 2 * MR * G <= 12 accumulators (1 row x 48 columns for decode, up to
// 6 rows x 8 columns), 12 vpmaddwd + 12 vpaddd per 2 weight loads and at most 6 broadcasts. A
// weight register serves every row of the tile, so its widening is paid once per MR rows.
#pragma once

#include "linear_panels.h"

namespace llmserve {
namespace int8_avx2 {

constexpr int kTileRows = 6;

// Row r of x (times smooth[k] per input feature, if given) -> q[r] (k int16: round(v * 127 / max|v|),
// half to even) and scale[r] = max|v| / 127; a zero row gives q = 0, scale 0. The rounding of the VNNI
// kernel's quantize_rows_u8 and of shared/engine/models/int8_linear.quantize_rows.
template <typename T>
void quantize_rows_i16(int16_t* q, float* scale, const T* x, const float* smooth, int64_t m, int64_t k) {
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * k;
      auto value = [&](int64_t j) {
        const __m256 v = load8(xr + j, k - j);
        return smooth == nullptr ? v : _mm256_mul_ps(v, load8(smooth + j, k - j));
      };
      __m256 amax = _mm256_setzero_ps();
      const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
      for (int64_t j = 0; j < k; j += 8) amax = _mm256_max_ps(amax, _mm256_and_ps(value(j), abs_mask));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      const float a = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
      scale[r] = a / 127.f;
      const __m256 inv = _mm256_set1_ps(a > 0.f ? 127.f / a : 0.f);
      for (int64_t j = 0; j < k; j += 8) {
        const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(value(j), inv));  // round half to even
        const __m128i h = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        if (k - j >= 8) _mm_storeu_si128(reinterpret_cast<__m128i*>(q + r * k + j), h);
        else _mm_storel_epi64(reinterpret_cast<__m128i*>(q + r * k + j), h);  // k is a multiple of 4
      }
    }
  });
}

// MR quantized rows (xq: k int16 apart) x G groups of 8 columns from c0 (panel: the panel's first unit
// of those columns) -> y rows (n apart), the columns < n.
template <int MR, int G, typename T>
LLMSERVE_INLINE void tile(T* y, int64_t n, int64_t c0, const int16_t* xq, int64_t k, const float* xscale, const uint32_t* panel,
                          PanelPrefetch prefetch, const float* wscale, const T* bias) {
  __m256i acc[MR][G][2];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 6
    for (int g = 0; g < G; ++g) acc[i][g][0] = acc[i][g][1] = _mm256_setzero_si256();
  const int64_t quads = k / 4;
  for (int64_t kk = 0; kk < quads; ++kk) {
    prefetch.at(kk);
#pragma GCC unroll 6
    for (int g = 0; g < G; ++g) {
      const uint32_t* wq = panel + kk * kPanel + 8 * g;
      const __m256i w0 = _mm256_cvtepi8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(wq)));
      const __m256i w1 = _mm256_cvtepi8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(wq + 4)));
#pragma GCC unroll 6
      for (int i = 0; i < MR; ++i) {
        int64_t pairs;
        std::memcpy(&pairs, xq + i * k + 4 * kk, sizeof(pairs));
        const __m256i xb = _mm256_set1_epi64x(pairs);
        acc[i][g][0] = _mm256_add_epi32(acc[i][g][0], _mm256_madd_epi16(w0, xb));
        acc[i][g][1] = _mm256_add_epi32(acc[i][g][1], _mm256_madd_epi16(w1, xb));
      }
    }
  }
#pragma GCC unroll 6
  for (int g = 0; g < G; ++g) {
    const int64_t c = c0 + 8 * g;
    if (c >= n) break;
    const __m256 sw = load8(wscale + c, n - c);
    const __m256 b = bias == nullptr ? _mm256_setzero_ps() : load8(bias + c, n - c);
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      // Lanes (2j, 2j+1) of acc[.][0] hold column j's two half sums (columns 0-3), of acc[.][1] columns 4-7.
      const __m256i sums = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[i][g][0], acc[i][g][1]), 0xD8);
      const __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(sw, _mm256_set1_ps(xscale[i])), b);
      store8(y + i * n + c, v, n - c);
    }
  }
}

template <typename T>
void linear(T* y, const T* x, const uint32_t* w, const float* wscale, const float* smooth, const T* bias, int64_t m, int64_t n,
            int64_t k) {
  std::vector<int16_t> xq(m * k);
  std::vector<float> xs(m);
  quantize_rows_i16(xq.data(), xs.data(), x, smooth, m, k);
  for_each_linear_tile<kTileRows>(m, n, k / 4, w, [&](auto mr, int64_t r0, int64_t n0, const uint32_t* panel, const PanelPrefetch& pf) {
    constexpr int MR = decltype(mr)::value, G = MR >= 6 ? 1 : 6 / MR;  // 2 * MR * G <= 12 accumulators
    const PanelPrefetch none{};
    for (int g0 = 0; g0 < kPanel / 8 && n0 + 8 * g0 < n; g0 += G)
      tile<MR, G>(y + r0 * n, n, n0 + 8 * g0, xq.data() + r0 * k, k, xs.data() + r0,
                                                       panel + 8 * g0, g0 == 0 ? pf : none, wscale, bias);
  });
}

}  // namespace int8_avx2
}  // namespace llmserve
