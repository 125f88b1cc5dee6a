// GGUF block-quantized linear (Q4_0, Q4_1, Q8_0): the op, and its AVX512-VNNI tile. The layout, the
// activation quantization and the AVX2 tile are in linear_gguf.h.
#include "linear_gguf.h"

#include "common.h"
#include "ops.h"

namespace llmserve {
namespace {

using gguf::Format;
using gguf::Inputs;
using gguf::kBlock;
using gguf::kQuadsPerBlock;
using gguf::kRows;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kVnni = true;

// MR input rows x one panel (16 output rows from n0) -> y (rows n apart). vpdpbusd multiplies the
// unsigned weight bytes (nibbles, or Q8's u = q + 128) by the signed input bytes: exact int32 sums.
template <int MR, Format F, typename T>
LLMSERVE_INLINE void tile_vnni(T* y, int64_t n, int64_t n0, const uint8_t* qs, const uint16_t* scales,
                               const uint16_t* mins, const Inputs& in, const T* bias) {
  constexpr int64_t units = F == Format::q8_0 ? 8 : 4;
  const __m512i nibble = _mm512_set1_epi8(0x0F), zp = _mm512_set1_epi32(gguf::zero_point(F));
  __m512 acc[MR];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < in.blocks; ++b) {
    const uint8_t* unit = qs + b * units * 64;
    __m512i s[MR];
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) s[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int64_t u = 0; u < units; ++u) {
      const __m512i v = _mm512_loadu_si512(unit + u * 64);
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) {
        const int32_t* xq = in.quads + i * in.row_quads + b * kQuadsPerBlock;
        if constexpr (F == Format::q8_0) {
          s[i] = _mm512_dpbusd_epi32(s[i], v, _mm512_set1_epi32(xq[u]));
        } else {  // unit u holds quads 2u (low nibbles) and 2u + 1 (high nibbles)
          s[i] = _mm512_dpbusd_epi32(s[i], _mm512_and_si512(v, nibble), _mm512_set1_epi32(xq[2 * u]));
          s[i] = _mm512_dpbusd_epi32(s[i], _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble),
                                     _mm512_set1_epi32(xq[2 * u + 1]));
        }
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + b * kRows)));
    __m512 mn = _mm512_setzero_ps();
    if constexpr (F == Format::q4_1)
      mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mins + b * kRows)));
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const int64_t rb = i * in.blocks + b;
      const __m512i si = _mm512_sub_epi32(s[i], _mm512_mullo_epi32(zp, _mm512_set1_epi32(in.sx[rb])));
      acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(in.dx[rb])), _mm512_cvtepi32_ps(si), acc[i]);
      if constexpr (F == Format::q4_1)
        acc[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(in.dx[rb] * static_cast<float>(in.sx[rb])), acc[i]);
    }
  }
  const vm mk = column_mask(n0, n);
  const vf bv = bias == nullptr ? zero() : load16(bias + n0, mk);
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) store16(y + i * n + n0, add(acc[i], bv), mk);
}
#else
constexpr bool kVnni = false;
#endif

// Threads claim panels (16 output rows each, in order; one row: a run per thread, panel_grain); a
// panel goes over the input rows in passes of at most kTileRows, so its blocks are read from cache
// after the first pass.
template <Format F, typename T>
void linear_gguf_impl(T* y, const T* x, const uint8_t* qs, const uint16_t* scales, const uint16_t* mins,
                      const T* bias, int64_t m, int64_t n, int64_t k) {
  const int64_t blocks = k / kBlock, panels = (n + kRows - 1) / kRows;
  const int64_t panel_bytes = blocks * gguf::units_per_block(F) * 64;
  at::Tensor xq = at::empty({m, k}, at::kChar), dx = at::empty({m, blocks}, at::kFloat),
             sx = at::empty({m, blocks}, at::kInt);
  gguf::quantize_blocks(xq.data_ptr<int8_t>(), dx.data_ptr<float>(), sx.data_ptr<int32_t>(), x, m, k);
  const int32_t* quads = reinterpret_cast<const int32_t*>(xq.data_ptr<int8_t>());
  parallel_claim(panels, [&](ItemCounter& items) {
    for (int64_t p = items.claim(); p < panels; p = items.after(p)) {
      const uint8_t* panel = qs + p * panel_bytes;
      const uint16_t* ps = scales + p * blocks * kRows;
      const uint16_t* pm = mins == nullptr ? nullptr : mins + p * blocks * kRows;
      for (int64_t r0 = 0; r0 < m; r0 += gguf::kTileRows) {
        const Inputs in{quads + r0 * (k / 4), dx.data_ptr<float>() + r0 * blocks, sx.data_ptr<int32_t>() + r0 * blocks,
                        k / 4, blocks};
        with_rows<gguf::kTileRows>(std::min(gguf::kTileRows, m - r0), [&](auto rows) {
          constexpr int MR = decltype(rows)::value;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
          tile_vnni<MR, F>(y + r0 * n, n, p * kRows, panel, ps, pm, in, bias);
#else
          for (int h = 0; h < 2; ++h) gguf::avx2::tile<MR, F>(y + r0 * n, n, p * kRows, h, panel, ps, pm, in, bias);
#endif
        });
      }
    }
  }, panel_grain(panels, m));
}

Format parse_format(const std::string& name) {
  if (name == "q4_0") return Format::q4_0;
  if (name == "q4_1") return Format::q4_1;
  if (name == "q8_0") return Format::q8_0;
  TORCH_CHECK(false, "linear_gguf: unknown format '", name, "' (q4_0, q4_1 or q8_0)");
  return Format::q4_0;  // not reached
}

}  // namespace

at::Tensor linear_gguf(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& mins, c10::string_view format, int64_t out_features,
                       const c10::optional<at::Tensor>& bias) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  TORCH_CHECK(__builtin_cpu_supports("avx512vnni"), "this build of the GGUF linear kernels needs a CPU with AVX512-VNNI");
#endif
  const Format f = parse_format(std::string(format));
  check_cpu_contiguous(x, "x");
  check_cpu_contiguous(qs, "qs");
  check_cpu_contiguous(scales, "scales");
  TORCH_CHECK((x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) && x.dim() == 2,
              "linear_gguf: x must be bf16 or fp32 [rows, in_features]");
  const int64_t k = x.size(1), blocks = k / kBlock, n = out_features, panels = (n + kRows - 1) / kRows;
  TORCH_CHECK(k % kBlock == 0 && k > 0, "linear_gguf: in_features must be a positive multiple of 32, got ", k);
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.dim() == 4 && qs.size(0) == panels && qs.size(1) == blocks &&
                  qs.size(2) == gguf::units_per_block(f) && qs.size(3) == 64,
              "linear_gguf: qs must be uint8 [", panels, ", ", blocks, ", ", gguf::units_per_block(f),
              ", 64] for ", format, " with ", n, " out_features and ", k, " in_features (pack_gguf_blocks)");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.numel() == panels * blocks * kRows,
              "linear_gguf: scales must be fp16 [", panels, ", ", blocks, ", 16]");
  TORCH_CHECK(mins.has_value() == (f == Format::q4_1), "linear_gguf: mins are given for q4_1 and only for it");
  if (mins.has_value()) {
    check_cpu_contiguous(*mins, "mins");
    TORCH_CHECK(mins->scalar_type() == at::kHalf && mins->numel() == scales.numel(),
                "linear_gguf: mins must be fp16 like scales");
  }
  if (bias.has_value()) {
    check_cpu_contiguous(*bias, "bias");
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->numel() == n, "bias must be [out_features] in x's dtype");
  }
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return y;
  const uint8_t* q = qs.data_ptr<uint8_t>();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const uint16_t* mn = mins.has_value() ? reinterpret_cast<const uint16_t*>(mins->data_ptr<at::Half>()) : nullptr;
  LLMSERVE_DISPATCH(x.scalar_type(), "linear_gguf", [&] {
    const scalar_t* b = bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr;
    scalar_t* out = y.data_ptr<scalar_t>();
    const scalar_t* in = x.data_ptr<scalar_t>();
    switch (f) {
      case Format::q4_0: linear_gguf_impl<Format::q4_0>(out, in, q, s, mn, b, x.size(0), n, k); break;
      case Format::q4_1: linear_gguf_impl<Format::q4_1>(out, in, q, s, mn, b, x.size(0), n, k); break;
      case Format::q8_0: linear_gguf_impl<Format::q8_0>(out, in, q, s, mn, b, x.size(0), n, k); break;
    }
  });
  return y;
}

std::string linear_gguf_path() {
  return kVnni ? "linear_gguf: Q4_0/Q4_1/Q8_0 blocks x Q8 inputs, AVX512-VNNI vpdpbusd"
               : "linear_gguf: Q4_0/Q4_1/Q8_0 blocks x Q8 inputs, AVX2 vpmaddubsw + vpmaddwd";
}

}  // namespace llmserve
