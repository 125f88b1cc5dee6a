// int8 linear.
#include "common.h"
#include "linear_panels.h"
#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
#include "linear_int8_avx2.h"
#endif
#include "ops.h"

namespace llmserve {
namespace {

// ---- int8 linear (W8A8): y = sx[m] * sw[n] * (q_x q_W^T) (+ b) ---------------------------------------
// The weight is quantized once per output feature (sw = max|w| / 127, q in [-127, 127]; see
// shared/engine/models/int8_linear.py) and packed like the bf16 one, in quads: [N/48][K/4][48] 32-bit units
// of (q[n][4i..4i+3]). Each call quantizes its input rows the same way (sx = max|x| / 127, round half to
// even) and stores them offset by 128 as unsigned bytes, because AVX512-VNNI multiplies unsigned by
// signed bytes: one broadcast quad against a panel row adds 64 exact products into 16 columns' int32
// sums. The offset is taken back by starting each column's sum at -128 * sum_k q[n][k] (`colsum`).
// Sums are exact: int32 arithmetic wraps, and the final |sum| <= 127 * 127 * K fits for K < 133,000. Only
// the epilogue rounds (fp32, then the output dtype). Without VNNI the same panels go through int16
// multiply-adds (linear_int8_avx2.h), to the same sums and results.

// A build with AVX512-VNNI runs only where the CPU has it; the others need AVX2, which every level has.
void check_linear_int8_ops() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  TORCH_CHECK(__builtin_cpu_supports("avx512vnni"), "this build of the int8 linear kernels needs a CPU with AVX512-VNNI");
#endif
}

}  // namespace

at::Tensor pack_linear_int8(const at::Tensor& q) {
  check_linear_int8_ops();
  check_cpu_contiguous(q, "weight");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.size(1) % 4 == 0,
              "pack_linear_int8: weight must be int8 [out_features, in_features] with in_features a multiple of 4");
  return pack_panels(q, q.size(1) / 4);
}

namespace {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Row r of x (times smooth[k] per input feature, if given) -> q[r] (k bytes: round(v * 127 / max|v|) + 128,
// half to even) and scale[r] = max|v| / 127; a zero row gives q = 128, scale 0.
template <typename T>
void quantize_rows_u8(uint8_t* q, float* scale, const T* x, const float* smooth, int64_t m, int64_t k) {
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * k;
      auto value = [&](int64_t j, __mmask16 mk) {
        const __m512 v = load16(xr + j, mk);
        return smooth == nullptr ? v : _mm512_mul_ps(v, load16(smooth + j, mk));
      };
      __m512 amax = _mm512_setzero_ps();
      for (int64_t j = 0; j < k; j += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(value(j, tail_mask(k - j))));
      const float a = _mm512_reduce_max_ps(amax);
      scale[r] = a / 127.f;
      const __m512 inv = _mm512_set1_ps(a > 0.f ? 127.f / a : 0.f);
      const __m512i offset = _mm512_set1_epi32(128);
      for (int64_t j = 0; j < k; j += 16) {
        const __mmask16 mk = tail_mask(k - j);
        const __m512i v = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(value(j, mk), inv)), offset);
        _mm_mask_storeu_epi8(q + r * k + j, mk, _mm512_cvtusepi32_epi8(v));
      }
    }
  });
}

// MR quantized rows (xq: MR x quads) x one panel -> y rows (n apart), columns n0..n0+47 (those < n).
// Every loop over i and j must unroll fully: otherwise GCC keeps the integer accumulators on the
// stack, and the kernel runs at a fraction of its speed.
template <int MR, typename T>
inline void linear_int8_tile(T* y, int64_t n, int64_t n0, const uint32_t* xq, const float* xscale, int64_t quads,
                             const uint32_t* panel, PanelPrefetch prefetch, const float* wscale,
                             const int32_t* colsum, const T* bias) {
  __m512i acc[MR][kNR];
#pragma GCC unroll 4
  for (int j = 0; j < kNR; ++j) {
    const __mmask16 mk = column_mask(n0 + j * 16, n);
    const __m512i start = _mm512_mullo_epi32(_mm512_maskz_loadu_epi32(mk, colsum + n0 + j * 16), _mm512_set1_epi32(-128));
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) acc[i][j] = start;
  }
  for (int64_t kk = 0; kk < quads; ++kk) {
    prefetch.at(kk);
    __m512i wv[kNR];
#pragma GCC unroll 4
    for (int j = 0; j < kNR; ++j) wv[j] = _mm512_load_si512(panel + kk * kPanel + j * 16);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512i xb = _mm512_set1_epi32(static_cast<int>(xq[i * quads + kk]));
#pragma GCC unroll 4
      for (int j = 0; j < kNR; ++j) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], xb, wv[j]);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < kNR; ++j) {
    const __mmask16 mk = column_mask(n0 + j * 16, n);
    if (mk == 0) break;
    const __m512 sw = _mm512_maskz_loadu_ps(mk, wscale + n0 + j * 16);
    const __m512 b = bias == nullptr ? _mm512_setzero_ps() : load16(bias + n0 + j * 16, mk);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][j]), _mm512_mul_ps(sw, _mm512_set1_ps(xscale[i])), b);
      store16(y + i * n + n0 + j * 16, v, mk);
    }
  }
}

template <typename T>
void linear_int8_impl(T* y, const T* x, const uint32_t* w, const float* wscale, const int32_t* colsum, const float* smooth,
                      const T* bias, int64_t m, int64_t n, int64_t k) {
  const int64_t quads = k / 4;
  at::Tensor xq = at::empty({m, quads}, at::kInt), xscale = at::empty({m}, at::kFloat);
  uint32_t* xqs = reinterpret_cast<uint32_t*>(xq.data_ptr<int32_t>());
  float* xs = xscale.data_ptr<float>();
  quantize_rows_u8(reinterpret_cast<uint8_t*>(xqs), xs, x, smooth, m, k);
  for_each_linear_tile(m, n, quads, w, [&](auto mr, int64_t r0, int64_t n0, const uint32_t* panel, const PanelPrefetch& pf) {
    linear_int8_tile<decltype(mr)::value>(y + r0 * n, n, n0, xqs + r0 * quads, xs + r0, quads, panel, pf, wscale, colsum,
                                          bias);
  });
}
#endif

}  // namespace

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& colsum,
                       const c10::optional<at::Tensor>& smooth, const c10::optional<at::Tensor>& bias) {
  check_linear_int8_ops();
  check_cpu_contiguous(x, "x");
  check_cpu_contiguous(scale, "weight scale");
  check_cpu_contiguous(colsum, "weight column sums");
  const int64_t n = scale.numel();
  TORCH_CHECK((x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) && x.dim() == 2,
              "linear_int8: x must be bf16 or fp32 [rows, in_features]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && colsum.scalar_type() == at::kInt &&
                  colsum.numel() == n, "linear_int8: scale must be fp32 [out_features] and colsum int32 [out_features]");
  check_panels(packed, n, x, 4, "linear_int8");
  if (smooth.has_value()) {
    check_cpu_contiguous(*smooth, "smooth");
    TORCH_CHECK(smooth->scalar_type() == at::kFloat && smooth->numel() == x.size(1), "smooth must be fp32 [in_features]");
  }
  if (bias.has_value()) {
    check_cpu_contiguous(*bias, "bias");
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->numel() == n, "bias must be [out_features] in x's dtype");
  }
  at::Tensor y = at::empty({x.size(0), n}, x.options());
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const uint32_t* w = reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>());
  LLMSERVE_DISPATCH(x.scalar_type(), "linear_int8", [&] {
    linear_int8_impl<scalar_t>(y.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), w, scale.data_ptr<float>(),
                               colsum.data_ptr<int32_t>(), smooth.has_value() ? smooth->data_ptr<float>() : nullptr,
                               bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr, x.size(0), n, x.size(1));
  });
#else
  const uint32_t* w = reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>());
  LLMSERVE_DISPATCH(x.scalar_type(), "linear_int8", [&] {
    int8_avx2::linear<scalar_t>(y.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), w, scale.data_ptr<float>(),
                                smooth.has_value() ? smooth->data_ptr<float>() : nullptr,
                                bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr, x.size(0), n, x.size(1));
  });
#endif
  return y;
}


std::string linear_int8_path() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return "linear_int8: AVX512-VNNI vpdpbusd on u8 inputs (+128) x s8 weights";
#else
  return "linear_int8: int8 widened to int16 (vpmovsxbw), exact vpmaddwd pair sums (AVX2)";
#endif
}

}  // namespace llmserve
