// bf16 linear.
#include "common.h"
#include "linear_panels.h"
#if !(defined(__AVX512BF16__) && defined(__AVX512BW__))
#include "linear_bf16_avx2.h"
#endif
#include "ops.h"

namespace llmserve {
namespace {

// ---- bf16 linear on a pair-interleaved weight: y = x W^T (+ b) -----------------------------------------
// W [N, K] is packed once (pack_linear_bf16) into panels of 48 output columns, [N/48][K/2][48] 32-bit
// pairs (W[n][2i], W[n][2i+1]), the layout AVX512-BF16 dot products want: one input pair x[m][2i..2i+1]
// broadcast against a panel row adds 32 exact products into 16 columns' fp32 sums per instruction, so
// the accumulators hold whole output columns (no horizontal sums) and a tile of up to kMR = 8 rows x
// 48 columns stays in 24 registers (8 rows: a decode batch of 8 reads each panel once). Threads claim
// (panel, chunk of kMChunk rows) items (for_each_linear_tile); the first rows stream a panel from DRAM
// (54 KB at K = 576, the next one prefetched into L2 meanwhile) and the rest re-read it from L2.
//
// One layout serves every batch size and every level, so a bf16 model holds one copy of each weight
// (oneDNN would want its own pre-packed copy). Without AVX512-BF16 the same panels are widened to fp32
// and multiplied by FMAs (linear_bf16_avx2.h).

// A build with AVX512-BF16 runs only where the CPU has it; the others need AVX2 + FMA, which every level has.
void check_linear_bf16_ops() {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  TORCH_CHECK(__builtin_cpu_supports("avx512bf16"), "this build of the bf16 linear kernels needs a CPU with AVX512-BF16");
#endif
}

}  // namespace

at::Tensor pack_linear_bf16(const at::Tensor& w) {
  check_linear_bf16_ops();
  check_cpu_contiguous(w, "weight");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.size(1) % 2 == 0,
              "pack_linear_bf16: weight must be bf16 [out_features, in_features] with even in_features");
  return pack_panels(w, w.size(1) / 2);
}

namespace {


#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// MR rows (x: MR x pairs, row-major) x one panel -> y rows (n apart), columns n0..n0+47 (those < n).
template <int MR>
inline void linear_tile(c10::BFloat16* y, int64_t n, int64_t n0, const uint32_t* x, int64_t pairs, const uint32_t* panel,
                        PanelPrefetch prefetch, const __m512 (&bias)[kNR]) {
  __m512 acc[MR][kNR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kNR; ++j) acc[i][j] = bias[j];
  for (int64_t kk = 0; kk < pairs; ++kk) {
    prefetch.at(kk);
    __m512bh wv[kNR];
    for (int j = 0; j < kNR; ++j) wv[j] = (__m512bh)_mm512_load_si512(panel + kk * kPanel + j * 16);
    for (int i = 0; i < MR; ++i) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[i * pairs + kk]));
      for (int j = 0; j < kNR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[j], xb);
    }
  }
  for (int j = 0; j < kNR; ++j) {
    const __mmask16 m = column_mask(n0 + j * 16, n);
    if (m == 0) break;
    for (int i = 0; i < MR; ++i) _mm256_mask_storeu_epi16(y + i * n + n0 + j * 16, m, (__m256i)_mm512_cvtneps_pbh(acc[i][j]));
  }
}

void linear_bf16_impl(c10::BFloat16* y, const c10::BFloat16* x, const uint32_t* w, const c10::BFloat16* bias, int64_t m,
                      int64_t n, int64_t pairs) {
  const uint32_t* xs = reinterpret_cast<const uint32_t*>(x);
  for_each_linear_tile(m, n, pairs, w, [&](auto mr, int64_t r0, int64_t n0, const uint32_t* panel, const PanelPrefetch& pf) {
    __m512 bv[kNR];
    for (int j = 0; j < kNR; ++j) {
      const __mmask16 mk = bias == nullptr ? 0 : column_mask(n0 + j * 16, n);
      bv[j] = mk ? load16(bias + n0 + j * 16, mk) : _mm512_setzero_ps();
    }
    linear_tile<decltype(mr)::value>(y + r0 * n, n, n0, xs + r0 * pairs, pairs, panel, pf, bv);
  });
}
#endif

}  // namespace

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t out_features, const c10::optional<at::Tensor>& bias) {
  check_linear_bf16_ops();
  check_cpu_contiguous(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2, "linear_bf16: x must be bf16 [rows, in_features]");
  check_panels(packed, out_features, x, 2, "linear_bf16");
  const c10::BFloat16* b = nullptr;
  if (bias.has_value()) {
    check_cpu_contiguous(*bias, "bias");
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == out_features, "bias must be bf16 [out_features]");
    b = bias->data_ptr<c10::BFloat16>();
  }
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  linear_bf16_impl(y.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(),
                   reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>()), b, x.size(0), out_features, packed.size(1));
#else
  bf16_avx2::linear(y.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(),
                    reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>()), b, x.size(0), out_features, packed.size(1));
#endif
  return y;
}

std::string linear_bf16_path() {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  return "linear_bf16: AVX512-BF16 dot products on bf16 pairs (vdpbf16ps)";
#else
  return "linear_bf16: bf16 widened to fp32 by shifts, FMA (AVX2); 2-4 rows in register tiles, from 5 rows on "
         "blocks widened once into fp32 scratch for 6x16 micro-tiles";
#endif
}

}  // namespace llmserve
