// GGUF block-quantized linears (Q4_0, Q4_1, Q8_0) on their packed blocks: the layout, the activation
// quantization every level shares, and the AVX2 tile (the avx2 and avx512 levels; the avx512_bf16 level
// has AVX512-VNNI and its own tile in linear_gguf.cpp).
//
// A GGUF block is 32 consecutive weights of one output row with an fp16 scale d (and, for Q4_1, an fp16
// min m): Q4_0 w = d (q - 8), Q4_1 w = d q + m with q in [0, 15]; Q8_0 w = d q, q in [-127, 127], held
// here offset as u = q + 128. The weight is regrouped once at load (shared/engine/models/gguf_linear.py,
// in torch, the same for every level) into panels of 16 output rows:
//
//   qs      [N/16][K/32][units][64 bytes]   Q4: 4 units, Q8: 8 units per block
//           Q4 unit o, bytes 4r..4r+3 (row r):  low nibbles  q[r][32b + 8o + 0..3]
//                                               high nibbles q[r][32b + 8o + 4..7]
//           Q8 unit t, bytes 4r..4r+3 (row r):  u[r][32b + 4t + 0..3]
//   scales  [N/16][K/32][16] fp16 d;   mins (Q4_1) [N/16][K/32][16] fp16 m
//
// so a 32-bit lane of a unit is 4 consecutive weights of one row (one quad of input features), and 16
// lanes are 16 output rows: one broadcast input quad against a unit adds 4 products into each of 16
// rows' sums, with no horizontal sums. Rows past N are zero (scale 0).
//
// Each call quantizes its input per row and block like llama.cpp's Q8 activations: dx = max|x| / 127,
// xq = round(x * 127 / max|x|) (half to even) in [-127, 127], sx = sum of the block's xq. With the block's
// integer dot s = sum(q' xq) (q' = q or u, unsigned) and z the format's zero (Q4_0: 8, Q8_0: 128, else 0):
//
//   y = sum over blocks of  d dx (s - z sx)  [+ m dx sx for Q4_1]
//
// Integer sums are exact; only the fp32 epilogue (one product and one fused multiply-add per block)
// rounds. gguf_linear_reference (torch) computes the same sums.
#pragma once

#include "linear_panels.h"

namespace llmserve {
namespace gguf {

constexpr int64_t kRows = 16, kBlock = 32, kQuadsPerBlock = kBlock / 4, kTileRows = 4;

enum class Format { q4_0, q4_1, q8_0 };

inline int64_t units_per_block(Format f) { return f == Format::q8_0 ? 8 : 4; }
inline int32_t zero_point(Format f) { return f == Format::q4_0 ? 8 : f == Format::q8_0 ? 128 : 0; }

// Row r of x -> xq[r] (k int8), dx[r * blocks + b], sx[r * blocks + b]; an all-zero block gives xq 0, dx 0.
template <typename T>
void quantize_blocks(int8_t* xq, float* dx, int32_t* sx, const T* x, int64_t m, int64_t k) {
  const int64_t blocks = k / kBlock;
  at::parallel_for(0, m * blocks, 64, [&](int64_t begin, int64_t end) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int64_t rb = begin; rb < end; ++rb) {
      const T* xb = x + rb * kBlock;  // row r block b starts at r * k + b * 32 = rb * 32
      __m256 v[4];
      __m256 amax = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = load8(xb + 8 * i, 8);
        amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], abs_mask));
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      const float a = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
      dx[rb] = a / 127.f;
      const __m256 inv = _mm256_set1_ps(a > 0.f ? 127.f / a : 0.f);
      __m256i q[4];
      for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  // half to even
      const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
      sx[rb] = _mm_cvtsi128_si32(s4);
      // packs interleave 128-bit halves: (0..3, 8..11 | 4..7, 12..15) per pack; the permute restores order.
      const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      const __m256i ordered = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + rb * kBlock), ordered);
    }
  });
}

// The quantized inputs of one call, as the tiles read them.
struct Inputs {
  const int32_t* quads;  // xq as quads: row r, block b, quad t at r * k / 4 + 8b + t
  const float* dx;
  const int32_t* sx;
  int64_t row_quads, blocks;
};

namespace avx2 {

LLMSERVE_INLINE __m256i bcast(const int32_t* p) { return _mm256_set1_epi32(*p); }

// MR input rows x the 8 rows [8h, 8h + 8) of one panel -> y (rows n apart), output rows n0 + 8h.. (< n).
// Products go through vpmaddubsw (unsigned weight nibble x signed input byte): a pair sum is at most
// 2 * 15 * 127 = 3,810, and a block adds 8 of them per int16 lane (30,480 < 32,767), so the int16 sums
// never saturate; vpmaddwd then widens each lane's pair to the row's int32 sum. A Q8 weight byte is split
// into its nibbles the same way: u = 16 hi + lo.
template <int MR, Format F, typename T>
LLMSERVE_INLINE void tile(T* y, int64_t n, int64_t n0, int h, const uint8_t* qs, const uint16_t* scales,
                          const uint16_t* mins, const Inputs& in, const T* bias) {
  constexpr int64_t units = F == Format::q8_0 ? 8 : 4;
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), sixteen = _mm256_set1_epi16(16);
  const __m256i zp = _mm256_set1_epi32(zero_point(F));
  __m256 acc[MR];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < in.blocks; ++b) {
    const uint8_t* unit = qs + b * units * 64 + 32 * h;
    __m256i lo16[MR], hi16[MR];
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) lo16[i] = hi16[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int64_t u = 0; u < units; ++u) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + u * 64));
      const __m256i lo = _mm256_and_si256(v, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) {
        const int32_t* xq = in.quads + i * in.row_quads + b * kQuadsPerBlock;
        if constexpr (F == Format::q8_0) {
          const __m256i xb = bcast(xq + u);
          lo16[i] = _mm256_add_epi16(lo16[i], _mm256_maddubs_epi16(lo, xb));
          hi16[i] = _mm256_add_epi16(hi16[i], _mm256_maddubs_epi16(hi, xb));
        } else {  // unit u holds quads 2u (low nibbles) and 2u + 1 (high nibbles)
          lo16[i] = _mm256_add_epi16(lo16[i], _mm256_maddubs_epi16(lo, bcast(xq + 2 * u)));
          lo16[i] = _mm256_add_epi16(lo16[i], _mm256_maddubs_epi16(hi, bcast(xq + 2 * u + 1)));
        }
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + b * kRows + 8 * h)));
    __m256 mn = _mm256_setzero_ps();
    if constexpr (F == Format::q4_1)
      mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + b * kRows + 8 * h)));
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const int64_t rb = i * in.blocks + b;
      __m256i s = _mm256_madd_epi16(lo16[i], ones);
      if constexpr (F == Format::q8_0) s = _mm256_add_epi32(s, _mm256_madd_epi16(hi16[i], sixteen));
      s = _mm256_sub_epi32(s, _mm256_mullo_epi32(zp, _mm256_set1_epi32(in.sx[rb])));
      acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(in.dx[rb])), _mm256_cvtepi32_ps(s), acc[i]);
      if constexpr (F == Format::q4_1)
        acc[i] = _mm256_fmadd_ps(mn, _mm256_set1_ps(in.dx[rb] * static_cast<float>(in.sx[rb])), acc[i]);
    }
  }
  const int64_t c = n0 + 8 * h;
  if (c >= n) return;
  const __m256 bv = bias == nullptr ? _mm256_setzero_ps() : load8(bias + c, n - c);
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) store8(y + i * n + c, _mm256_add_ps(acc[i], bv), n - c);
}

}  // namespace avx2
}  // namespace gguf
}  // namespace llmserve
