// Decode attention (decode_attention.cpp): the walk over a sequence's cache blocks with their
// prefetches, loads and stores of the first n of 16 lanes, and the softmax's max and exp-sum.
#pragma once

#include "common.h"

namespace llmserve {
namespace decode {

// Blocks of a sequence sit anywhere in the pool, so the hardware prefetcher cannot see the next one
// coming: ask for its rows into L2 (not L1: a burst of L1 prefetches stalls on the fill buffers)
// while the current block is computed, kAheadBlocks ahead.
constexpr int64_t kAheadBlocks = 2;
template <typename T>
inline void prefetch_rows(const T* first, int64_t rows, int64_t row_stride, int64_t row_len) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t off = 0; off < row_len * static_cast<int64_t>(sizeof(T)); off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(first + r * row_stride) + off, _MM_HINT_T1);
}

// Head kh's share of the rows [t, t + rows) of the block ahead (nothing if none): spread over the
// heads' turns, as a burst of 16 rows stalls on the fill buffers. Forced inline: GCC called it out of
// line from the key pass's lambda, which made decode attention from DRAM much slower.
template <typename C>
__attribute__((always_inline)) inline void prefetch_share(const C* ahead, int64_t t, int64_t rows, int64_t kh, int64_t kv_heads, int64_t kv_row) {
  if (ahead == nullptr) return;
  const int64_t r0 = rows * kh / kv_heads, r1 = rows * (kh + 1) / kv_heads;
  prefetch_rows(ahead + (t + r0) * kv_row, r1 - r0, kv_row, kv_row);
}

// The rows of a walk's first kAheadBlocks blocks (nullptr past b_hi): what the walk before it
// prefetches as its own last blocks go, so that no walk starts on a stall.
template <typename C>
struct FirstBlocks {
  const C* rows[kAheadBlocks] = {};
  FirstBlocks() = default;
  FirstBlocks(const C* cache, const int64_t* table, int64_t b_lo, int64_t b_hi, int64_t block_size, int64_t kv_row) {
    for (int64_t i = 0; i < kAheadBlocks && b_lo + i < b_hi; ++i) rows[i] = cache + table[b_lo + i] * block_size * kv_row;
  }
};

// Runs body(rows, ahead, n, t0) over blocks b_lo..b_hi-1 of a sequence (block table `table`, `len` keys) in
// `cache`: each block's rows, those of the block kAheadBlocks on (past b_hi, the first blocks of the
// walk that follows, `next`; the body prefetches them as it goes), its key count and its first key's
// index counted from block b_lo. The first kAheadBlocks blocks are prefetched before the first call.
template <typename C, typename Body>
inline void for_each_block(const C* cache, const int64_t* table, int64_t b_lo, int64_t b_hi, int64_t len, int64_t block_size,
                           int64_t kv_row, const FirstBlocks<C>& next, const Body& body) {
  auto rows = [&](int64_t b) { return cache + table[b] * block_size * kv_row; };
  for (const C* first : FirstBlocks<C>(cache, table, b_lo, b_hi, block_size, kv_row).rows)
    if (first != nullptr) prefetch_rows(first, block_size, kv_row, kv_row);
  for (int64_t b = b_lo; b < b_hi; ++b)
    body(rows(b), b + kAheadBlocks < b_hi ? rows(b + kAheadBlocks) : next.rows[b + kAheadBlocks - b_hi],
         std::min(block_size, len - b * block_size), (b - b_lo) * block_size);
}

// Lanes [0, n) of 16 at p (the rest read as 0 or fill), and stores of them. AVX2's masked loads
// and stores are slow next to plain ones, so there a whole vector (n >= 16) goes unmasked.
LLMSERVE_INLINE vf load_lanes(const float* p, int64_t n) {
#if LLMSERVE_VEC_AVX512
  return load16(p, tail_mask(n));
#else
  return n >= 16 ? loadu(p) : load16(p, tail_mask(n));
#endif
}
LLMSERVE_INLINE vf load_lanes_or(const float* p, int64_t n, vf fill) {  // the rest read as fill
#if LLMSERVE_VEC_AVX512
  return load16_or(p, tail_mask(n), fill);
#else
  return n >= 16 ? loadu(p) : load16_or(p, tail_mask(n), fill);
#endif
}
LLMSERVE_INLINE void store_lanes(float* p, vf v, int64_t n) {
#if LLMSERVE_VEC_AVX512
  store16(p, v, tail_mask(n));
#else
  if (n >= 16) storeu(p, v);
  else store16(p, v, tail_mask(n));
#endif
}

// The largest of x[0..len), len >= 1: 16 lanes at a time (exact in any order; a scalar loop that
// stored its running max every key was a visible share of the time with the blocks in L2).
inline float max_of(const float* x, int64_t len) {
  const vf lowest = set1(-INFINITY);
  vf m = lowest;
  for (int64_t i = 0; i < len; i += 16) m = max(m, load_lanes_or(x + i, len - i, lowest));
  return reduce_max(m);
}

// In place: x[i] = exp(x[i] - shift); returns the sum.
inline float exp_shifted_sum(float* x, int64_t len, float shift) {
  const vf vs = set1(shift);
  vf sum = zero();
  for (int64_t t = 0; t < len; t += 16) {
    const vf e = exp16(sub(load_lanes(x + t, len - t), vs));
    store_lanes(x + t, e, len - t);
    sum = where(tail_mask(len - t), add(sum, e), sum);
  }
  return reduce_add(sum);
}

}  // namespace decode
}  // namespace llmserve
