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
// runs through the whole panel's compute instead of its first pass alone (bf16, 30 layers' linears
// at 32 rows: 18.1-18.6 -> 17.2-17.8 ms in four alternating runs; int8, less bound by DRAM, unchanged).
struct PanelPrefetch {
  const uint32_t* panel = nullptr;
  int64_t next = std::numeric_limits<int64_t>::max(), step = 1;

  inline void at(int64_t kk) {
    if (kk != next) return;
    for (int j = 0; j < kNR; ++j) _mm_prefetch(reinterpret_cast<const char*>(panel + kk * kPanel + j * 16), _MM_HINT_T1);
    next += step;
  }
};

// Runs tile(std::integral_constant<int, MR>, r0, n0, panel, prefetch) over y[m, n] = x[m, :] W^T for a
// weight packed in panels of `units` 32-bit units: threads take (panel, chunk of kMChunk rows) items; a
// chunk goes in passes of at most kMR rows, as even as possible (20 rows: 7 7 6, not 8 8 4).
template <typename Tile>
void for_each_linear_tile(int64_t m, int64_t n, int64_t units, const uint32_t* w, const Tile& tile) {
  const int64_t panels = (n + kPanel - 1) / kPanel, chunks = (m + kMChunk - 1) / kMChunk;
  at::parallel_for(0, panels * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t p = item / chunks, n0 = p * kPanel, m_begin = item % chunks * kMChunk;
      const int64_t rows = std::min(kMChunk, m - m_begin);
      const uint32_t* panel = w + p * units * kPanel;
      // Decode-sized calls (one chunk per panel) walk this thread's panels in order: fetch the next.
      const uint32_t* next = chunks == 1 && item + 1 < end ? panel + units * kPanel : nullptr;
      const int64_t passes = (rows + kMR - 1) / kMR;
      for (int64_t pass = 0, r0 = m_begin; pass < passes; ++pass) {
        const int64_t mr = rows / passes + (pass < rows % passes ? 1 : 0);
        const PanelPrefetch pf = next == nullptr ? PanelPrefetch{} : PanelPrefetch{next, pass, passes};
        switch (mr) {
          case 1: tile(std::integral_constant<int, 1>{}, r0, n0, panel, pf); break;
          case 2: tile(std::integral_constant<int, 2>{}, r0, n0, panel, pf); break;
          case 3: tile(std::integral_constant<int, 3>{}, r0, n0, panel, pf); break;
          case 4: tile(std::integral_constant<int, 4>{}, r0, n0, panel, pf); break;
          case 5: tile(std::integral_constant<int, 5>{}, r0, n0, panel, pf); break;
          case 6: tile(std::integral_constant<int, 6>{}, r0, n0, panel, pf); break;
          case 7: tile(std::integral_constant<int, 7>{}, r0, n0, panel, pf); break;
          default: tile(std::integral_constant<int, 8>{}, r0, n0, panel, pf); break;
        }
        r0 += mr;
      }
    }
  });
}

}  // namespace llmserve
