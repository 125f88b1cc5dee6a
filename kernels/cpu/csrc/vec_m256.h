// The 8-lane (__m256) helpers both vector backends offer: plain AVX2 code, which every level compiles
// (the AVX2 backend builds its 16-lane transpose from them; the AVX2-form linears, which the AVX-512
// levels without BF16 run too, pack their inputs with them).
#pragma once

#include <immintrin.h>

#include <cstdint>

#define LLMSERVE_INLINE __attribute__((always_inline)) inline

namespace vec {

// An 8 x 8 transpose of r[0..7] (one 256-bit half each) in place.
LLMSERVE_INLINE void transpose8(__m256 (&r)[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int g = 0; g < 8; g += 4) {
    u[g] = _mm256_shuffle_ps(t[g], t[g + 2], 0x44);
    u[g + 1] = _mm256_shuffle_ps(t[g], t[g + 2], 0xEE);
    u[g + 2] = _mm256_shuffle_ps(t[g + 1], t[g + 3], 0x44);
    u[g + 3] = _mm256_shuffle_ps(t[g + 1], t[g + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(u[c], u[c + 4], 0x20);
    r[c + 4] = _mm256_permute2f128_ps(u[c], u[c + 4], 0x31);
  }
}

// Eight bf16 pairs (32-bit units, the even element in the low half) at p, widened to fp32 straight
// from memory into one register: the even elements by a shift, the odd ones by a mask. Each is one asm
// statement, so that the compiler can neither merge the two halves' loads (which would keep the units
// live beside the widened half) nor hold the mask in a register: kernels whose sums fill 12-15 of the
// 16 ymm registers would otherwise spill one (a 1.33x slower tile in the bf16 linear).
alignas(32) inline constexpr uint32_t kOddMask[8] = {0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u,
                                                    0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u};
LLMSERVE_INLINE __m256 bf16_even_at(const void* p) {
  __m256 r;
  asm("vmovdqu %1, %0\n\tvpslld $16, %0, %0" : "=&x"(r) : "m"(*static_cast<const __m256i*>(p)));
  return r;
}
LLMSERVE_INLINE __m256 bf16_odd_at(const void* p) {
  __m256 r;
  asm("vmovdqu %1, %0\n\tvpand %2, %0, %0"
      : "=&x"(r)
      : "m"(*static_cast<const __m256i*>(p)), "m"(*reinterpret_cast<const __m256i*>(kOddMask)));
  return r;
}
// The same two widenings (even by a shift, odd by a mask) of units already in a register.
LLMSERVE_INLINE __m256 bf16_even(__m256i u) { return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16)); }
LLMSERVE_INLINE __m256 bf16_odd(__m256i u) {
  return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_load_si256(reinterpret_cast<const __m256i*>(kOddMask))));
}

}  // namespace vec
