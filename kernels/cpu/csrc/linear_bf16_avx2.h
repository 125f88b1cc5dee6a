// bf16 linear without AVX512-BF16 (the avx2 and avx512 levels), on the same panels of bf16 pairs as the
// dot-product kernel. A pair unit widens to two fp32 weights by a shift (W[n][2i] = unit << 16) and a
// mask (W[n][2i+1] = unit & 0xFFFF0000), and x is widened to fp32 once per call; the products are fp32
// FMAs. Every output is bias, then one FMA per input feature in order k = 0, 1, ..., K-1 into a single
// fp32 sum, in all three forms below: a row's result does not depend on how many rows share the call.
//
// - One row (single-stream decode): bound by the weight stream from DRAM. One row x one panel (48
//   columns, 6 accumulators) widens each unit in registers as it streams, the next panel prefetched
//   as in the dot-product kernel.
// - Up to kSubTileRows rows (a small decode batch): still one pass over the weights. A tile of all
//   the rows x one 16-column sub-panel widens each pair's two weight vectors in registers once for
//   every row (4 shifts / masks per 4 x rows FMAs); the three sub-panels of a panel read their own
//   cache line of each pair row, and each prefetches its lines of the next panel.
// - More rows: a 6-row x 16-column micro-tile (12 accumulators, 2 weight registers, a broadcast
//   input) runs over blocks of kBlockPairs pairs (2 x 128 input features) of one 16-column
//   sub-panel: 12 FMAs per 2 weight vectors and 6 broadcasts. Up to kRawRows rows (decode batches)
//   the tile widens the block's pair rows itself as it reads them. For more rows, widening in every
//   pass would cost more than once per block for all the rows of a group (up to kGroupRows, a whole
//   default prefill chunk; the group's x, at most 512 x K fp32, is read once per item and stays in
//   L3): the block becomes an fp32 scratch [256][16] per thread (16 KB: it stays in L1 while every
//   pass of the group's rows reads it; all three sub-panels' at once, 48 KB, did not). Sums cross
//   the K blocks through an fp32 buffer of the item's rows. x is widened to fp32 once per call by
//   all the threads together, block by block with each pass's rows side by side ([feature][row],
//   pack_pass): a pass's broadcasts read one run of consecutive addresses, and the passes over a
//   block follow each other, one stream for the prefetchers. Threads claim (row group, sub-panel)
//   items one at a time (parallel_claim): a decode batch's small linears have few panels, and a
//   thread left holding the last of them kept its partner waiting at the join; sub-panels are a
//   third as long. Where panels are many (from kWholePanels on: the tied head's 1,024), a thread
//   claims a panel's three sub-panels together, so one core reads each 192-byte pair row whole
//   rather than one line of it beside the other core reading the next. The sub-panel of the item a
//   thread runs next is prefetched into L2 during the current one's FMAs, so a batch of a few rows
//   streams the weights from DRAM while it computes instead of in turns.
#pragma once

#include "linear_panels.h"

namespace llmserve {
namespace bf16_avx2 {

constexpr int64_t kGroupRows = 512, kBlockPairs = 128, kSub = 16, kSubs = kPanel / kSub;
constexpr int kTileRows = 6;
constexpr int64_t kWholePanels = 32;
// Groups of at most kRawRows rows widen the weights in the tile: widening a block first costs 4
// stores a pair, shared only by the group's rows (at 32 rows ~6% of the FMAs' time); in the tile it
// is 2 shifts and 2 masks a pair in every pass, which the FMAs of 64-128 rows begin to feel
// (loadtests/RESULTS.md).
constexpr int64_t kRawRows = 64;

// Where the sums of the 16 columns from c0 (`cols` of them exist) start: the bias, or 0.
LLMSERVE_INLINE void bias_start(__m256 (&start)[2], const c10::BFloat16* bias, int64_t c0, int64_t cols) {
  for (int h = 0; h < 2; ++h)
    start[h] = bias == nullptr || 8 * h >= cols ? _mm256_setzero_ps() : load8(bias + c0 + 8 * h, cols - 8 * h);
}

// rows x k bf16 (row-major, k apart) -> fp32 at dst (k apart).
inline void widen_rows(float* dst, const c10::BFloat16* x, int64_t rows, int64_t k) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < k; j += 8) store8(dst + r * k + j, load8(x + r * k + j, k - j), k - j);
}

// ---- one row ------------------------------------------------------------------------------------------
// One row (x: fp32, 2 * pairs) x one panel -> y, columns n0..n0+47 (those < n).
inline void row_tile(c10::BFloat16* y, int64_t n, int64_t n0, const float* x, int64_t pairs, const uint32_t* panel,
                     PanelPrefetch prefetch, const c10::BFloat16* bias) {
  constexpr int G = kPanel / 8;
  __m256 acc[G];
#pragma GCC unroll 6
  for (int g = 0; g < G; ++g)
    acc[g] = bias == nullptr || n0 + 8 * g >= n ? _mm256_setzero_ps() : load8(bias + n0 + 8 * g, n - n0 - 8 * g);
  for (int64_t kk = 0; kk < pairs; ++kk) {
    prefetch.at(kk);
    const __m256 xe = _mm256_broadcast_ss(x + 2 * kk), xo = _mm256_broadcast_ss(x + 2 * kk + 1);
#pragma GCC unroll 6
    for (int g = 0; g < G; ++g) {
      const __m256i u = _mm256_load_si256(reinterpret_cast<const __m256i*>(panel + kk * kPanel + 8 * g));
      acc[g] = _mm256_fmadd_ps(vec::bf16_even(u), xe, acc[g]);
      acc[g] = _mm256_fmadd_ps(vec::bf16_odd(u), xo, acc[g]);
    }
  }
#pragma GCC unroll 6
  for (int g = 0; g < G; ++g)
    if (n0 + 8 * g < n) store8(y + n0 + 8 * g, acc[g], n - n0 - 8 * g);
}

inline void linear_rows(c10::BFloat16* y, const c10::BFloat16* x, const uint32_t* w, const c10::BFloat16* bias, int64_t m,
                        int64_t n, int64_t pairs) {
  std::vector<float> xf(m * 2 * pairs);
  widen_rows(xf.data(), x, m, 2 * pairs);
  for_each_linear_tile(m, n, pairs, w, [&](auto mr, int64_t r0, int64_t n0, const uint32_t* panel, const PanelPrefetch& pf) {
    for (int i = 0; i < decltype(mr)::value; ++i)
      row_tile(y + (r0 + i) * n, n, n0, xf.data() + (r0 + i) * 2 * pairs, pairs, panel, i == 0 ? pf : PanelPrefetch{}, bias);
  });
}

// ---- a few rows: register tiles ----------------------------------------------------------------------
constexpr int kSubTileRows = 4;

// MR rows (x: fp32, k apart) x one 16-column sub-panel (`sub`: pair rows kPanel units apart) -> y,
// columns c0..c0+cols-1. Each pair's two weight vectors are widened in registers and serve all MR rows
// (4 widening ops for 4 * MR FMAs), with no scratch; with `prefetch`, one line a pair from there on.
template <int MR>
LLMSERVE_INLINE void sub_tile(c10::BFloat16* y, int64_t n, int64_t cols, const float* x, int64_t k, const uint32_t* sub,
                              int64_t pairs, const __m256 (&start)[2], const uint32_t* prefetch) {
  __m256 acc[MR][2];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) acc[i][0] = start[0], acc[i][1] = start[1];
  for (int64_t kk = 0; kk < pairs; ++kk) {
    if (prefetch != nullptr) _mm_prefetch(reinterpret_cast<const char*>(prefetch + kk * kPanel), _MM_HINT_T1);
    const __m256i u0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(sub + kk * kPanel));
    const __m256i u1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(sub + kk * kPanel + 8));
    const __m256 e0 = vec::bf16_even(u0), e1 = vec::bf16_even(u1), o0 = vec::bf16_odd(u0), o1 = vec::bf16_odd(u1);
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const __m256 xe = _mm256_broadcast_ss(x + i * k + 2 * kk), xo = _mm256_broadcast_ss(x + i * k + 2 * kk + 1);
      acc[i][0] = _mm256_fmadd_ps(e0, xe, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(e1, xe, acc[i][1]);
      acc[i][0] = _mm256_fmadd_ps(o0, xo, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(o1, xo, acc[i][1]);
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i)
    for (int h = 0; h < 2; ++h)
      if (8 * h < cols) store8(y + i * n + 8 * h, acc[i][h], cols - 8 * h);
}

// All m <= kSubTileRows rows in one pass over the weights: threads claim panels in order, and each
// sub-panel's tile prefetches its lines of the panel the thread has claimed next.
inline void linear_subs(c10::BFloat16* y, const c10::BFloat16* x, const uint32_t* w, const c10::BFloat16* bias, int64_t m,
                        int64_t n, int64_t pairs) {
  const int64_t k = 2 * pairs, panels = (n + kPanel - 1) / kPanel;
  std::vector<float> xf(m * k);
  widen_rows(xf.data(), x, m, k);
  parallel_claim(panels, [&](ItemCounter& items) {
    for (int64_t p = items.claim(), following; p < panels; p = following) {
      following = items.after(p);
      const uint32_t* panel = w + p * pairs * kPanel;
      const uint32_t* next = following < panels ? w + following * pairs * kPanel : nullptr;
      for (int64_t s = 0; s < kSubs && p * kPanel + s * kSub < n; ++s) {
        const int64_t c0 = p * kPanel + s * kSub, cols = std::min(kSub, n - c0);
        __m256 start[2];
        bias_start(start, bias, c0, cols);
        with_rows<kSubTileRows>(m, [&](auto mr) {
          sub_tile<decltype(mr)::value>(y + c0, n, cols, xf.data(), k, panel + s * kSub, pairs, start,
                                        next == nullptr ? nullptr : next + s * kSub);
        });
      }
    }
  });
}

// ---- blocked: fp32 micro-tiles over blocks of a sub-panel ------------------------------------------------
// One input feature of MR rows (a: their MR fp32 values) against 16 columns' weights (b0, b1), into acc.
template <int MR>
LLMSERVE_INLINE void micro_step(__m256 (&acc)[MR][2], const float* a, __m256 b0, __m256 b1) {
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) {
    const __m256 av = _mm256_broadcast_ss(a + i);
    acc[i][0] = _mm256_fmadd_ps(av, b0, acc[i][0]);
    acc[i][1] = _mm256_fmadd_ps(av, b1, acc[i][1]);
  }
}

// Pair kk (input features 2kk, 2kk + 1; a: [feature][MR]) of MR rows against 16 columns, into acc:
// - b: fp32 [feature][16], a block widen_block made;
// - b: the sub-panel's bf16 pair rows (kPanel units apart), widened here.
template <int MR>
LLMSERVE_INLINE void micro_pair(__m256 (&acc)[MR][2], const float* a, const float* b, int64_t kk) {
  micro_step<MR>(acc, a + 2 * kk * MR, _mm256_load_ps(b + 2 * kk * kSub), _mm256_load_ps(b + 2 * kk * kSub + 8));
  micro_step<MR>(acc, a + (2 * kk + 1) * MR, _mm256_load_ps(b + (2 * kk + 1) * kSub),
                 _mm256_load_ps(b + (2 * kk + 1) * kSub + 8));
}
template <int MR>
LLMSERVE_INLINE void micro_pair(__m256 (&acc)[MR][2], const float* a, const uint32_t* b, int64_t kk) {
  const uint32_t* u = b + kk * kPanel;
  micro_step<MR>(acc, a + 2 * kk * MR, vec::bf16_even(_mm256_load_si256(reinterpret_cast<const __m256i*>(u))),
                 vec::bf16_even(_mm256_load_si256(reinterpret_cast<const __m256i*>(u + 8))));
  micro_step<MR>(acc, a + (2 * kk + 1) * MR, vec::bf16_odd_at(u), vec::bf16_odd_at(u + 8));
}

// MR rows x 16 columns over pairs [begin, end), into acc; with kPrefetch, one line a pair of
// `prefetch` (pair kk's at prefetch + (kk - begin) * kPanel) into L2. The prefetch choice is a template
// argument, so the loop body is straight-line code (a run-time test beside it left GCC a loop of one
// feature, whose counter and branch took issue slots from the FMAs).
template <int MR, bool kPrefetch, typename B>
LLMSERVE_INLINE void micro_tile(__m256 (&acc)[MR][2], const float* a, const B* b, int64_t begin, int64_t end,
                                const uint32_t* prefetch) {
#pragma GCC unroll 2
  for (int64_t kk = begin; kk < end; ++kk) {
    if constexpr (kPrefetch)
      _mm_prefetch(reinterpret_cast<const char*>(prefetch + (kk - begin) * kPanel), _MM_HINT_T1);
    micro_pair<MR>(acc, a, b, kk);
  }
}

// Pairs [p0, p0 + bp) of sub-panel `sub` of a panel -> scratch [2 * bp][16] fp32, input features in order.
inline void widen_block(float* scratch, const uint32_t* panel, int64_t p0, int64_t bp, int64_t sub) {
  for (int64_t i = 0; i < bp; ++i) {
    const uint32_t* src = panel + (p0 + i) * kPanel + sub * kSub;
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256i u = _mm256_load_si256(reinterpret_cast<const __m256i*>(src + 8 * h));
      float* dst = scratch + 2 * i * kSub + 8 * h;
      _mm256_store_ps(dst, vec::bf16_even(u));
      _mm256_store_ps(dst + kSub, vec::bf16_odd(u));
    }
  }
}

// One pass of MR rows over a block of one sub-panel, widened (b: float, widen_block) or not (b: its
// pair rows): sums start from the bias (first block) or the item's partial sums `part` (kSub apart),
// and end in y (last block) or back in `part`. Its first `prefetch_pairs` pairs each prefetch one line
// of `prefetch` (none where it is null).
// A function of its own: the tile's 12 sums, 2 weight vectors and a broadcast take 15 of the 16 ymm
// registers, and inlined into the item loop the register allocator spilled a sum to the stack or not
// depending on the code around it (a small change to that loop once made the blocked linear far slower).
template <int MR, typename B>
__attribute__((noinline)) void block_pass(const float* a, const B* b, int64_t pairs, float* part, bool first, bool last,
                                const __m256 (&start)[2], c10::BFloat16* y, int64_t n, int64_t cols, const uint32_t* prefetch,
                                int64_t prefetch_pairs) {
  __m256 acc[MR][2];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i)
    for (int h = 0; h < 2; ++h) acc[i][h] = first ? start[h] : _mm256_load_ps(part + i * kSub + 8 * h);
  const int64_t with = prefetch == nullptr ? 0 : std::min(prefetch_pairs, pairs);
  if (with > 0) micro_tile<MR, true>(acc, a, b, 0, with, prefetch);
  micro_tile<MR, false>(acc, a, b, with, pairs, nullptr);
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i)
    for (int h = 0; h < 2; ++h) {
      if (!last) _mm256_store_ps(part + i * kSub + 8 * h, acc[i][h]);
      else if (8 * h < cols) store8(y + i * n + 8 * h, acc[i][h], cols - 8 * h);
    }
}

// MR rows of x (bf16, k apart) x f features -> fp32 [feature][MR] at dst: eight features at a time,
// the rows widened into lanes and turned by an 8 x 8 transpose, so feature j's MR values are the first
// MR lanes of one vector. A store of all 8 lanes at dst + j * MR runs 8 - MR lanes into the places of
// the features after j, which the next stores write over; where it would run past the eighth
// feature's place (into what may be another pass's, packed by another thread) only the MR lanes are
// stored.
template <int MR>
LLMSERVE_INLINE void pack_rows(float* dst, const c10::BFloat16* x, int64_t k, int64_t f) {
  int64_t j = 0;
  for (; j + 8 <= f; j += 8) {
    __m256 t[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) t[i] = i < MR ? load8(x + i * k + j, 8) : _mm256_setzero_ps();
    vec::transpose8(t);
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) {
      if (u * MR + 8 <= 8 * MR) _mm256_storeu_ps(dst + (j + u) * MR, t[u]);
      else store8(dst + (j + u) * MR, t[u], MR);
    }
  }
  for (; j < f; ++j)
    for (int i = 0; i < MR; ++i) dst[j * MR + i] = to_float(x[i * k + j]);
}

// The pass of mr rows from row r of a group of `rows` rows of x (bf16, 2 * pairs apart) -> fp32 at the
// group's xp, K block by K block: block b (pairs [p0, p0 + bp)) holds the group's features of the
// block from rows * 2 * p0 on, and in it the pass's rows are packed [feature][row] from r * 2 * bp on.
inline void pack_pass(float* xp, const c10::BFloat16* x, int64_t rows, int64_t pairs, int64_t block_pairs, int64_t r,
                      int64_t mr) {
  const int64_t k = 2 * pairs;
  for (int64_t p0 = 0; p0 < pairs; p0 += block_pairs) {
    const int64_t bp = std::min(block_pairs, pairs - p0);
    with_rows<kTileRows>(mr, [&](auto mr_c) {
      pack_rows<decltype(mr_c)::value>(xp + rows * 2 * p0 + r * 2 * bp, x + r * k + 2 * p0, k, 2 * bp);
    });
  }
}

struct Scratch {
  alignas(64) float block[2 * kBlockPairs * kSub];
  std::vector<__m256> part;  // the item's partial sums across K blocks, [row][16] (aligned for block_pass)
};

// Internal linkage: a function-local thread_local in this inline code would be one object for every
// kernel build loaded in the process (a GNU unique symbol), shared by builds whose Scratch differs.
namespace {
thread_local std::unique_ptr<Scratch> t_scratch;
}

inline void linear_blocked(c10::BFloat16* y, const c10::BFloat16* x, const uint32_t* w, const c10::BFloat16* bias, int64_t m,
                           int64_t n, int64_t pairs) {
  const int64_t k = 2 * pairs, panels = (n + kPanel - 1) / kPanel, subs = panels * kSubs;
  const int64_t groups = (m + kGroupRows - 1) / kGroupRows, group_rows = (m + groups - 1) / groups;
  const int64_t blocks = (pairs + kBlockPairs - 1) / kBlockPairs, block_pairs = (pairs + blocks - 1) / blocks;
  // Group g: rows [g * group_rows, + rows_of(g)), packed from g * group_rows * k on, in passes_of(g) passes.
  auto rows_of = [&](int64_t g) { return std::min(group_rows, m - g * group_rows); };
  auto passes_of = [&](int64_t g) { return (rows_of(g) + kTileRows - 1) / kTileRows; };
  std::unique_ptr<float[]> xp(new float[m * k]);  // every element is written below
  const int64_t group_passes = (group_rows + kTileRows - 1) / kTileRows;
  const bool widen = group_rows > kRawRows;
  at::parallel_for(0, groups * group_passes, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t g = i / group_passes, pass = i % group_passes, rows = rows_of(g), passes = passes_of(g);
      if (pass >= passes) continue;  // the last group can be shorter
      const int64_t g0 = g * group_rows;
      pack_pass(xp.get() + g0 * k, x + g0 * k, rows, pairs, block_pairs, pass_start(rows, passes, pass),
                pass_rows(rows, passes, pass));
    }
  });
  parallel_claim(groups * subs, [&](ItemCounter& items) {
    if (!t_scratch) t_scratch = std::make_unique<Scratch>();
    Scratch& s = *t_scratch;
    if (static_cast<int64_t>(s.part.size()) < 2 * group_rows) s.part.resize(2 * group_rows);
    float* part = reinterpret_cast<float*>(s.part.data());
    for (int64_t item = items.claim(), following; item < items.total(); item = following) {
      following = items.after(item);
      const int64_t g = item / subs, p = item % subs / kSubs, sub = item % kSubs;
      const int64_t c0 = p * kPanel + sub * kSub;
      if (c0 >= n) continue;  // the last panel's sub-panels past n
      const int64_t cols = std::min(kSub, n - c0), g0 = g * group_rows, rows = rows_of(g), passes = passes_of(g);
      const float* xg = xp.get() + g0 * k;
      const uint32_t* panel = w + p * pairs * kPanel;
      // The sub-panel this thread runs next streams into L2 meanwhile: each pass over a block fetches
      // its share of the block's pair rows (one line each), so the requests spread over all the passes;
      // all of them in the first pass left the FMAs of a few-row batch waiting on DRAM more often.
      const int64_t next_sub = following % subs;
      const uint32_t* next = following < items.total() && next_sub != item % subs
                                 ? w + next_sub / kSubs * pairs * kPanel + next_sub % kSubs * kSub
                                 : nullptr;
      __m256 start[2];
      bias_start(start, bias, c0, cols);
      for (int64_t p0 = 0; p0 < pairs; p0 += block_pairs) {
        const int64_t bp = std::min(block_pairs, pairs - p0);
        const bool first = p0 == 0, last = p0 + bp == pairs;
        if (widen) widen_block(s.block, panel, p0, bp, sub);
        const float* a = xg + rows * 2 * p0;
        for (int64_t pass = 0; pass < passes; ++pass) {
          const int64_t r = pass_start(rows, passes, pass), mr = pass_rows(rows, passes, pass);
          const int64_t lo = bp * pass / passes, hi = bp * (pass + 1) / passes;
          const uint32_t* pf = next != nullptr ? next + (p0 + lo) * kPanel : nullptr;
          with_rows<kTileRows>(mr, [&](auto mr_c) {
            auto run = [&](const auto* b) {
              block_pass<decltype(mr_c)::value>(a + r * 2 * bp, b, bp, part + r * kSub, first, last, start,
                                                y + (g0 + r) * n + c0, n, cols, pf, hi - lo);
            };
            if (widen) run(s.block);
            else run(panel + p0 * kPanel + sub * kSub);  // the block's pair rows, widened in the tile
          });
        }
      }
    }
  }, panels >= kWholePanels ? kSubs : 1);
}

inline void linear(c10::BFloat16* y, const c10::BFloat16* x, const uint32_t* w, const c10::BFloat16* bias, int64_t m, int64_t n,
                   int64_t pairs) {
  if (m == 1) linear_rows(y, x, w, bias, m, n, pairs);
  else if (m <= kSubTileRows) linear_subs(y, x, w, bias, m, n, pairs);
  else linear_blocked(y, x, w, bias, m, n, pairs);
}

}  // namespace bf16_avx2
}  // namespace llmserve
