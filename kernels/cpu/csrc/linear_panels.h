// The panel layout both linears read, and the loop over its tiles. A weight W [N, K] is packed once into
// panels of kPanel output columns, [N/kPanel][K/per_unit][kPanel] 32-bit units: bf16 pairs (W[n][2i],
// W[n][2i+1]) or int8 quads (W[n][4i..4i+3]). One input unit broadcast against a panel row feeds kPanel
// columns' sums, so the accumulators hold whole output columns (no horizontal sums).
#pragma once

#include "common.h"

namespace llmserve {

constexpr int64_t kPanel = 48, kNR = kPanel / 16, kMR = 8, kMChunk = 48;

// Rows of `units` 32-bit units (bf16 pairs or int8 quads) -> panels [ceil(n/48)][units][48]; columns past
// n stay 0.
inline at::Tensor pack_panels(const at::Tensor& w, int64_t units) {
  const int64_t n = w.size(0), panels = (n + kPanel - 1) / kPanel;
  at::Tensor out = at::zeros({panels, units, kPanel}, w.options().dtype(at::kInt));
  const uint32_t* src = static_cast<const uint32_t*>(w.data_ptr());
  uint32_t* dst = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t c = 0; c < std::min(kPanel, n - p * kPanel); ++c)
        for (int64_t i = 0; i < units; ++i) dst[(p * units + i) * kPanel + c] = src[(p * kPanel + c) * units + i];
  });
  return out;
}

// `packed` must be what pack_<kind> made for `out_features`, with `per_unit` input features per 32-bit
// unit (bf16: 2, int8: 4) matching x's features.
inline void check_panels(const at::Tensor& packed, int64_t out_features, const at::Tensor& x, int64_t per_unit,
                  const char* kind) {
  check_cpu_contiguous(packed, "packed weight");
  TORCH_CHECK(packed.scalar_type() == at::kInt && packed.dim() == 3 && packed.size(2) == kPanel &&
                  packed.size(0) == (out_features + kPanel - 1) / kPanel,
              kind, ": the weight must come from pack_", kind, " for ", out_features, " out_features");
  TORCH_CHECK(x.size(1) == per_unit * packed.size(1), kind, ": x has ", x.size(1), " features, the weight ",
              per_unit * packed.size(1));
}

// Lanes of the 16 columns starting at c that exist (c < n).
inline vm column_mask(int64_t c, int64_t n) {
  return c >= n ? no_lanes() : tail_mask(n - c);
}

// The rows of the next panel a tile prefetches into L2 (a line per 16 columns), each at the step of
// the same index: rows next, next + step, ...; none by default. A decode-sized call's passes over a
// panel share its successor's rows (pass p of P takes rows p, p + P, ...), so the stream from DRAM
// runs through the whole panel's compute instead of its first pass alone.
struct PanelPrefetch {
  const uint32_t* panel = nullptr;
  int64_t next = std::numeric_limits<int64_t>::max(), step = 1;

  inline void at(int64_t kk) {
    if (kk != next) return;
    for (int j = 0; j < kNR; ++j) _mm_prefetch(reinterpret_cast<const char*>(panel + kk * kPanel + j * 16), _MM_HINT_T1);
    next += step;
  }
};

// f(std::integral_constant<int, R>{}) for R = min(mr, MaxMR): a row count the tile kernels take as
// a template argument, so their loops over rows unroll.
template <int MaxMR, int R = 1, typename F>
LLMSERVE_INLINE void with_rows(int64_t mr, const F& f) {
  if constexpr (R == MaxMR) {
    f(std::integral_constant<int, R>{});
  } else {
    if (mr == R) f(std::integral_constant<int, R>{});
    else with_rows<MaxMR, R + 1>(mr, f);
  }
}

// The row count of pass `pass` when `rows` rows go in `passes` passes, as even as possible (20 rows
// in 3 passes: 7 7 6, not 8 8 4).
LLMSERVE_INLINE int64_t pass_rows(int64_t rows, int64_t passes, int64_t pass) {
  return rows / passes + (pass < rows % passes ? 1 : 0);
}

// The first row of pass `pass` in the same split.
LLMSERVE_INLINE int64_t pass_start(int64_t rows, int64_t passes, int64_t pass) {
  return pass * (rows / passes) + std::min(pass, rows % passes);
}

// Runs tile(std::integral_constant<int, MR>, r0, n0, panel, prefetch) over y[m, n] = x[m, :] W^T for a
// weight packed in panels of `units` 32-bit units: threads claim (panel, chunk of kMChunk rows) items
// (parallel_claim; a one-row call's panels in one run per thread, panel_grain), each knowing the one it
// runs next; a chunk goes in passes of at most MaxMR rows, as even as possible (pass_rows).
template <int MaxMR = kMR, typename Tile>
void for_each_linear_tile(int64_t m, int64_t n, int64_t units, const uint32_t* w, const Tile& tile) {
  const int64_t panels = (n + kPanel - 1) / kPanel, chunks = (m + kMChunk - 1) / kMChunk;
  parallel_claim(panels * chunks, [&](ItemCounter& items) {
    for (int64_t item = items.claim(), following; item < items.total(); item = following) {
      following = items.after(item);
      const int64_t p = item / chunks, n0 = p * kPanel, m_begin = item % chunks * kMChunk;
      const int64_t rows = std::min(kMChunk, m - m_begin);
      const uint32_t* panel = w + p * units * kPanel;
      // Decode-sized calls (one chunk per panel): the panel this thread runs next streams in meanwhile.
      const uint32_t* next = chunks == 1 && following < items.total() ? w + following * units * kPanel : nullptr;
      const int64_t passes = (rows + MaxMR - 1) / MaxMR;
      for (int64_t pass = 0, r0 = m_begin; pass < passes; ++pass) {
        const int64_t mr = pass_rows(rows, passes, pass);
        const PanelPrefetch pf = next == nullptr ? PanelPrefetch{} : PanelPrefetch{next, pass, passes};
        with_rows<MaxMR>(mr, [&](auto rows_c) { tile(rows_c, r0, n0, panel, pf); });
        r0 += mr;
      }
    }
  }, panel_grain(panels * chunks, m));
}

// ---- 8-lane helpers for the AVX2 forms of the linears ------------------------------------------------
// Plain __m256 code: it compiles at every level, so the AVX-512 levels without BF16 / VNNI run the
// same kernels as the AVX2 one.

// `count` (<= 8) elements as fp32 lanes; lanes past count read as 0.
LLMSERVE_INLINE __m256 load8(const float* p, int64_t count) {
  if (count >= 8) return _mm256_loadu_ps(p);
  alignas(32) float buf[8] = {};
  std::memcpy(buf, p, 4 * count);
  return _mm256_load_ps(buf);
}
LLMSERVE_INLINE __m256 load8(const c10::BFloat16* p, int64_t count) {
  __m128i h;
  if (count >= 8) {
    h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  } else {
    alignas(16) uint16_t buf[8] = {};
    std::memcpy(buf, p, 2 * count);
    h = _mm_load_si128(reinterpret_cast<const __m128i*>(buf));
  }
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// The first `count` (<= 8) lanes stored at p; bf16 rounds to nearest even, as c10::BFloat16 does.
LLMSERVE_INLINE void store8(float* p, __m256 v, int64_t count) {
  if (count >= 8) return _mm256_storeu_ps(p, v);
  alignas(32) float buf[8];
  _mm256_store_ps(buf, v);
  std::memcpy(p, buf, 4 * count);
}
LLMSERVE_INLINE void store8(c10::BFloat16* p, __m256 v, int64_t count) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  if (count >= 8) return _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  alignas(16) uint16_t buf[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(buf), h);
  std::memcpy(p, buf, 2 * count);
}

}  // namespace llmserve
