// Decode attention over the paged KV cache (one query token per sequence).
#include "common.h"
#include "ops.h"

namespace llmserve {
namespace {

// ---- Decode attention over the paged cache ----------------------------------------------------------
// One query token per sequence. Each KV head's group of query heads scores every cached key of the
// sequence, read block by block in place (fp32 sums), softmax, then the weighted sum of values. The
// cache is read once per KV head, not once per query head. The block walk, softmax, fp32 and bf16
// value sums and the merge of a sequence's parts are written once against the 16-lane vec API. The
// key scores have an AVX-512 form (16 x 16 register transposes) and an AVX2 one (8 x 8, keys in two
// groups: 16 registers), the int8 value sums an AVX-512 and an AVX2 form (their integer shuffles
// differ), and bf16 caches take AVX512-BF16 dot products where the build has them.

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

// Runs body(rows, ahead, n, t0) over blocks b_lo..b_hi-1 of a sequence (block table `table`, `len` keys) in
// `cache`: each block's rows, those of the block kAheadBlocks on (nullptr past b_hi: the body prefetches
// them as it goes), its key count and its first key's index counted from block b_lo. The first
// kAheadBlocks blocks are prefetched before the first call.
template <typename C, typename Body>
inline void for_each_block(const C* cache, const int64_t* table, int64_t b_lo, int64_t b_hi, int64_t len, int64_t block_size,
                           int64_t kv_row, const Body& body) {
  auto rows = [&](int64_t b) { return cache + table[b] * block_size * kv_row; };
  for (int64_t b = b_lo; b < std::min(b_lo + kAheadBlocks, b_hi); ++b) prefetch_rows(rows(b), block_size, kv_row, kv_row);
  for (int64_t b = b_lo; b < b_hi; ++b)
    body(rows(b), b + kAheadBlocks < b_hi ? rows(b + kAheadBlocks) : nullptr, std::min(block_size, len - b * block_size),
         (b - b_lo) * block_size);
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

// Scores of G query heads (head_dim = NV * 16 apart at q) against nt <= 16 key rows (stride apart at
// k): dot[j] lane u = q_j . k_u, 0 for u >= nt. The rows' 32-bit units (a dim, a bf16 pair or four
// int8) are moved into lanes by register transposes, so each key's products accumulate in its own
// lane: no horizontal sums (with four keys per horizontal reduction instead, those cost as much as
// the products). The AVX-512 forms sum a key's products in dim order; AVX2 sums its even and odd dims
// apart (int8: exact int32 sums at every level).
//
// bf16 keys without AVX512-BF16 take the queries widened to fp32 once per item; the rows' bf16 pairs
// are transposed as they are (half the transposes of widening first), then each pair widens by a
// shift (the low, even dim) or a mask (the high, odd dim).
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

template <int G, int NV>
inline void key_scores(vf (&dot)[G], const float* q, const c10::BFloat16* k, int64_t stride, int64_t nt) {
  const int64_t sb = stride * static_cast<int64_t>(sizeof(*k));
  key_groups8<G, __m256>(dot, reinterpret_cast<const char*>(k), sb, nt, [&](__m256 (&acc)[G], const char* rows, int64_t n) {
    const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
    __m256 odd_acc[G] = {};
    for (int c = 0; c < NV; ++c) {  // 8 pairs = 16 dims at a time
      __m256 r[8];
      load_units_transposed8(r, rows + c * 32, sb, n);  // r[i] lane u = (k_u[16c + 2i], k_u[16c + 2i + 1])
      for (int i = 0; i < 8; ++i) {
        const __m256i x = _mm256_castps_si256(r[i]);
        const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)), odd = _mm256_castsi256_ps(_mm256_and_si256(x, high));
        for (int j = 0; j < G; ++j) {
          const float* qj = q + j * NV * 16 + c * 16 + 2 * i;
          acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(qj[0]), even, acc[j]);
          odd_acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(qj[1]), odd, odd_acc[j]);
        }
      }
    }
    for (int j = 0; j < G; ++j) acc[j] = _mm256_add_ps(acc[j], odd_acc[j]);
  });
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
#endif

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

// 16 values of a row as fp32, in the order weighted_values accumulates them: fp32 as they are; bf16
// widened, on AVX2 as [8 even dims | 8 odd dims] (a shift and a mask of one load, no cross-lane
// widening), put back in order by interleave_even_odd at the end.
LLMSERVE_INLINE vf load_values(const float* p) { return loadu(p); }
#if LLMSERVE_VEC_AVX512
LLMSERVE_INLINE vf load_values(const c10::BFloat16* p) { return load16(p); }
#else
LLMSERVE_INLINE vf load_values(const c10::BFloat16* p) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(x, 16)),
          _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))))};
}

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

// accs [kv_heads * G heads][head_dim] += the part's softmax weights (sc: [head][span], the part's
// keys from block b_lo on) times its value rows, in fp32 products, kValueRows rows at a time and
// every head for them before the next ones; a head's accumulators stay in registers for those rows,
// in the buffer between them. fp32 values, and bf16 ones without AVX512-BF16; the overloads below
// take bf16 (with AVX512-BF16) and int8 values. Each dim's sum takes the rows in order.
template <int G, int NV, typename C>
void weighted_values(float* accs, const float* sc, int64_t span, const C* v_cache, const int64_t* table,
                     int64_t b_lo, int64_t b_hi, int64_t len, int64_t block_size, int64_t kv_heads) {
  constexpr int64_t head_dim = NV * 16, head_row = cache_row_len<C>(head_dim);
  constexpr int VP = kValuesPerPass<G, NV>;
  static_assert(NV % VP == 0, "whole passes");
  const int64_t kv_row = kv_heads * head_row;
  for_each_block(v_cache, table, b_lo, b_hi, len, block_size, kv_row,
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
        for (int v0 = 0; v0 < NV; v0 += VP) {
          vf acc[G][VP];
          for (int j = 0; j < G; ++j)
            for (int v = 0; v < VP; ++v) acc[j][v] = loadu(ak + j * head_dim + (v0 + v) * 16);
          for (int64_t u = 0; u < nt; ++u) {
            const C* vr = vb + (t + u) * kv_row + kh * head_row;
            for (int v = 0; v < VP; ++v) {
              const vf val = load_values(vr + (v0 + v) * 16);
              for (int j = 0; j < G; ++j) acc[j][v] = fmadd(set1(sk[j * span + u]), val, acc[j][v]);
            }
          }
          for (int j = 0; j < G; ++j)
            for (int v = 0; v < VP; ++v) storeu(ak + j * head_dim + (v0 + v) * 16, acc[j][v]);
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
                     int64_t b_lo, int64_t b_hi, int64_t len, int64_t block_size, int64_t kv_heads) {
  constexpr int64_t head_dim = NV * 16, head_row = cache_row_len<int8_t>(head_dim);
  const int64_t kv_row = kv_heads * head_row;
  for_each_block(v_cache, table, b_lo, b_hi, len, block_size, kv_row,
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
                     int64_t b_lo, int64_t b_hi, int64_t len, int64_t block_size, int64_t kv_heads) {
  constexpr int64_t head_dim = NV * 16, head_row = cache_row_len<int8_t>(head_dim);
  const int64_t kv_row = kv_heads * head_row;
  for_each_block(v_cache, table, b_lo, b_hi, len, block_size, kv_row,
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
                     int64_t b_lo, int64_t b_hi, int64_t len, int64_t block_size, int64_t kv_heads) {
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
  for_each_block(v_cache, table, b_lo, b_hi, len, block_size, kv_row,
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

// G query heads share a KV head; NV = head_dim / 16 vectors per row. Both are compile-time so the
// score and accumulator vectors stay in registers. A work item is one part of a sequence's keys for
// all its heads: each block's rows are read whole and in address order (faster than one head per
// item, which reads each row in kv_heads pieces). Sequence s's keys are split into
// first_item[s + 1] - first_item[s] runs of blocks (flash-decoding, so that one long sequence keeps
// every thread busy): each part writes its unnormalized sums with its max and normalizer, and a second
// pass merges the parts in order. The split depends on the sequence's own length only, never on the
// batch or the thread count, so a sequence's output is bit-identical whatever else is decoded with it
// (seeded sampling must not depend on the batch).
// C: the cache's element type, T or int8_t (rows with scales: the item's queries are quantized to int16
// once, key scales multiply the scores, value scales the softmax weights).
template <typename T, typename C, int G, int NV>
void decode_attention_impl(T* out, const T* q, const C* k_cache, const C* v_cache, const int64_t* block_tables,
                           int64_t max_blocks, const int64_t* seq_lens, int64_t num_seqs, int64_t kv_heads,
                           const int64_t* first_item, int64_t block_size, float scale) {
  constexpr bool kInt8 = std::is_same_v<C, int8_t>;
#if defined(__AVX512BF16__)
  constexpr bool kWidenQuery = false;
#else
  constexpr bool kWidenQuery = std::is_same_v<C, c10::BFloat16>;  // bf16 keys take fp32 queries
#endif
  constexpr int64_t head_dim = NV * 16;
  constexpr int64_t head_row = cache_row_len<C>(head_dim);
  const int64_t heads = G * kv_heads, kv_row = kv_heads * head_row;
  // Per (item, head): head_dim sums, then max and normalizer (read only for split sequences).
  const int64_t partial_row = head_dim + 2, num_items = first_item[num_seqs];
  std::vector<int64_t> item_seq(num_items);
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t item = first_item[s]; item < first_item[s + 1]; ++item) item_seq[item] = s;
  std::vector<float> partials(num_items > num_seqs ? num_items * heads * partial_row : 0);
  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, accs(heads * head_dim), q_scales(kInt8 ? heads : 0), row_max(heads), row_sum(heads);
    std::vector<int32_t> q_pairs(kInt8 ? heads * head_dim / 2 : 0);
    std::vector<float> q_f32(kWidenQuery ? heads * head_dim : 0);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item_seq[item], part = item - first_item[s], parts = first_item[s + 1] - first_item[s];
      const int64_t len = seq_lens[s];
      const int64_t* table = block_tables + s * max_blocks;
      const int64_t seq_blocks = (len + block_size - 1) / block_size;
      const int64_t b_lo = seq_blocks * part / parts, b_hi = seq_blocks * (part + 1) / parts;
      const int64_t t_lo = b_lo * block_size, span = std::min(len, b_hi * block_size) - t_lo;  // keys of this part
      const T* qs = q + s * heads * head_dim;
      if constexpr (kInt8) prepare_query_int16(q_pairs.data(), q_scales.data(), qs, heads, head_dim);
      if constexpr (kWidenQuery)
        for (int64_t i = 0; i < heads * head_dim; ++i) q_f32[i] = to_float(qs[i]);
      scores.resize(heads * std::max<int64_t>(span, 1));
      std::fill(accs.begin(), accs.end(), 0.f);
      float* sc = scores.data();  // [head][span]
      // Scores, 16 tokens at a time and every head for those tokens before the next 16, so the rows
      // are read in address order; the same rows of the block kAheadBlocks on are prefetched as we go.
      for_each_block(k_cache, table, b_lo, b_hi, len, block_size, kv_row, [&](const C* kb, const C* ahead, int64_t n, int64_t t0) {
        for (int64_t t = 0; t < n; t += 16) {
          const int64_t nt = std::min<int64_t>(16, n - t);
          const int64_t ahead_rows = std::min<int64_t>(16, block_size - t);
          for (int64_t kh = 0; kh < kv_heads; ++kh) {
            prefetch_share(ahead, t, ahead_rows, kh, kv_heads, kv_row);
            const C* k16 = kb + t * kv_row + kh * head_row;
            vf dot[G];
            vf key_scales = set1(scale);  // per score: scale, times the key row's for int8
            if constexpr (kInt8) {
              key_scores<G, NV>(dot, q_pairs.data() + kh * G * head_dim / 2, k16, kv_row, nt);
              key_scales = mul(key_scales, row_scales16(k16, kv_row, nt, head_dim));
            } else if constexpr (kWidenQuery) {
              key_scores<G, NV>(dot, q_f32.data() + kh * G * head_dim, k16, kv_row, nt);
            } else {
              key_scores<G, NV>(dot, qs + kh * G * head_dim, k16, kv_row, nt);
            }
            float* sk = sc + kh * G * span + t0 + t;
            for (int j = 0; j < G; ++j) {
              vf sj = mul(dot[j], key_scales);
              if constexpr (kInt8) sj = mul(sj, set1(q_scales[kh * G + j]));
              store_lanes(sk + j * span, sj, nt);
            }
          }
        }
      });
      std::fill(row_max.begin(), row_max.end(), -INFINITY);
      std::fill(row_sum.begin(), row_sum.end(), 0.f);
      for (int64_t r = 0; r < heads && span > 0; ++r) {
        float* sr = sc + r * span;
        row_max[r] = max_of(sr, span);
        row_sum[r] = exp_shifted_sum(sr, span, row_max[r]);
      }
      weighted_values<G, NV>(accs.data(), sc, span, v_cache, table, b_lo, b_hi, len, block_size, kv_heads);
      if (parts == 1) {
        T* os = out + s * heads * head_dim;
        for (int64_t r = 0; r < heads; ++r)
          for (int v = 0; v < NV; ++v)
            store16(os + r * head_dim + v * 16,
                    mul(loadu(accs.data() + r * head_dim + v * 16), set1(1.f / row_sum[r])));
      } else {
        float* pr = partials.data() + item * heads * partial_row;
        for (int64_t r = 0; r < heads; ++r) {
          std::memcpy(pr + r * partial_row, accs.data() + r * head_dim, head_dim * sizeof(float));
          pr[r * partial_row + head_dim] = row_max[r];
          pr[r * partial_row + head_dim + 1] = row_sum[r];
        }
      }
    }
  });
  std::vector<int64_t> split;  // sequences of more than one part
  for (int64_t s = 0; s < num_seqs; ++s)
    if (first_item[s + 1] - first_item[s] > 1) split.push_back(s);
  // Merge: out = sum_p e^(m_p - M) acc_p / sum_p e^(m_p - M) l_p, M the largest part max (an empty
  // part has max -inf and weighs nothing).
  at::parallel_for(0, static_cast<int64_t>(split.size()) * heads, 16, [&](int64_t begin, int64_t end) {
    for (int64_t sr = begin; sr < end; ++sr) {
      const int64_t s = split[sr / heads], r = sr % heads, parts = first_item[s + 1] - first_item[s];
      const float* first = partials.data() + (first_item[s] * heads + r) * partial_row;
      const int64_t stride = heads * partial_row;  // next part, same head
      float m = -INFINITY, l = 0.f;
      for (int64_t p = 0; p < parts; ++p) m = std::max(m, first[p * stride + head_dim]);
      vf acc[NV];
      for (int v = 0; v < NV; ++v) acc[v] = zero();
      for (int64_t p = 0; p < parts; ++p) {
        const float* pp = first + p * stride;
        const float w = std::exp(pp[head_dim] - m);
        l += w * pp[head_dim + 1];
        for (int v = 0; v < NV; ++v) acc[v] = fmadd(set1(w), loadu(pp + v * 16), acc[v]);
      }
      T* os = out + s * heads * head_dim + r * head_dim;
      for (int v = 0; v < NV; ++v) store16(os + v * 16, mul(acc[v], set1(1.f / l)));
    }
  });
}

template <typename T, typename C, int NV>
void decode_attention_group(int64_t group, T* out, const T* q, const C* k, const C* v, const int64_t* bt, int64_t mb,
                            const int64_t* lens, int64_t ns, int64_t kvh, const int64_t* per, int64_t bs, float scale) {
  switch (group) {
    case 1: return decode_attention_impl<T, C, 1, NV>(out, q, k, v, bt, mb, lens, ns, kvh, per, bs, scale);
    case 2: return decode_attention_impl<T, C, 2, NV>(out, q, k, v, bt, mb, lens, ns, kvh, per, bs, scale);
    case 3: return decode_attention_impl<T, C, 3, NV>(out, q, k, v, bt, mb, lens, ns, kvh, per, bs, scale);
    case 4: return decode_attention_impl<T, C, 4, NV>(out, q, k, v, bt, mb, lens, ns, kvh, per, bs, scale);
    case 5: return decode_attention_impl<T, C, 5, NV>(out, q, k, v, bt, mb, lens, ns, kvh, per, bs, scale);
    case 6: return decode_attention_impl<T, C, 6, NV>(out, q, k, v, bt, mb, lens, ns, kvh, per, bs, scale);
    case 7: return decode_attention_impl<T, C, 7, NV>(out, q, k, v, bt, mb, lens, ns, kvh, per, bs, scale);
    case 8: return decode_attention_impl<T, C, 8, NV>(out, q, k, v, bt, mb, lens, ns, kvh, per, bs, scale);
  }
  TORCH_CHECK(false, "decode_attention supports 1..8 query heads per KV head, got ", group);
}

template <typename T, typename C>
void decode_attention_dispatch(int64_t head_dim, int64_t group, T* out, const T* q, const C* k, const C* v,
                               const int64_t* bt, int64_t mb, const int64_t* lens, int64_t ns, int64_t kvh, const int64_t* per,
                               int64_t bs, float scale) {
  switch (head_dim) {
    case 64: return decode_attention_group<T, C, 4>(group, out, q, k, v, bt, mb, lens, ns, kvh, per, bs, scale);
    case 128: return decode_attention_group<T, C, 8>(group, out, q, k, v, bt, mb, lens, ns, kvh, per, bs, scale);
  }
  TORCH_CHECK(false, "decode_attention supports head_dim 64 or 128, got ", head_dim);
}

}  // namespace

bool attention_supports(int64_t heads, int64_t kv_heads, int64_t head_dim) {
  return kv_heads > 0 && heads % kv_heads == 0 && heads / kv_heads <= 8 && (head_dim == 64 || head_dim == 128);
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t heads, double scale) {
  for (auto* t : {&q, &k_cache, &v_cache, &block_tables, &seq_lens}) check_cpu_contiguous(*t, "decode_attention input");
  TORCH_CHECK(k_cache.dim() == 4, "caches must be [blocks, block_size, kv_heads, head_dim (+ 4 for int8)]");
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t head_dim = k_cache.size(3) - (k_cache.scalar_type() == at::kChar ? kScaleBytes : 0);
  const int64_t num_seqs = seq_lens.numel();
  TORCH_CHECK(attention_supports(heads, kv_heads, head_dim), "decode_attention: unsupported shape: ", heads,
              " heads, ", kv_heads, " KV heads, head_dim ", head_dim);
  TORCH_CHECK(q.dim() == 2 && q.size(0) == num_seqs && q.size(1) == heads * head_dim, "q must be [num_seqs, heads * head_dim]");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "block_tables and seq_lens must be int64");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs, "block_tables must be [num_seqs, max_blocks]");
  const bool int8 = check_cache(k_cache, v_cache, q.scalar_type(), kv_heads, head_dim, "decode_attention");
  check_block_tables(block_tables, seq_lens, block_size, k_cache.size(0));
  at::Tensor out = at::empty_like(q);
  const float sc = static_cast<float>(scale);
  // A sequence's keys go in parts of at most kPartTokens (rounded to whole blocks): one long sequence
  // alone still fills both threads, and shorter parts would cost more to merge than they save.
  constexpr int64_t kPartTokens = 256;
  const int64_t part_blocks = std::max<int64_t>(1, kPartTokens / block_size);
  std::vector<int64_t> first_item(num_seqs + 1, 0);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t seq_blocks = (seq_lens.data_ptr<int64_t>()[s] + block_size - 1) / block_size;
    first_item[s + 1] = first_item[s] + std::max<int64_t>(1, (seq_blocks + part_blocks - 1) / part_blocks);
  }
  LLMSERVE_DISPATCH(q.scalar_type(), "decode_attention", [&] {
    auto run = [&](auto* k, auto* v) {
      decode_attention_dispatch(head_dim, heads / kv_heads, out.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), k, v,
                                block_tables.data_ptr<int64_t>(), block_tables.size(1), seq_lens.data_ptr<int64_t>(),
                                num_seqs, kv_heads, first_item.data(), block_size, sc);
    };
    if (int8) run(k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>());
    else run(k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>());
  });
  return out;
}

// What this build runs for each cache dtype.
std::vector<std::string> decode_attention_paths() {
  const std::string vector_name = kVectorName;
  return {
      "decode_attention fp32 cache: fp32 FMA, keys transposed into lanes (" + vector_name + ")",
#if defined(__AVX512BF16__)
      "decode_attention bf16 cache: AVX512-BF16 dot products (vdpbf16ps), scores and values",
#else
      "decode_attention bf16 cache: bf16 widened to fp32, FMA (" + vector_name + ")",
#endif
#if defined(__AVX512VNNI__)
      "decode_attention int8 cache: int16 pairs, VNNI vpdpwssd (" + vector_name + ")",
#else
      "decode_attention int8 cache: int16 pairs, vpmaddwd (" + vector_name + ")",
#endif
  };
}

}  // namespace llmserve
