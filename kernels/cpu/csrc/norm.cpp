// RMSNorm, optionally fused with the residual add: out = x / sqrt(mean(x^2) + eps) * weight,
// accumulated in fp32. With a residual: residual += x first (in place, rounded to the model dtype as the
// unfused add would be) and the sum is normalized. Plain loops: the compiler vectorizes them for the
// level's flags.
#include "common.h"
#include "ops.h"

namespace llmserve {
namespace {

template <typename T>
void rms_norm_rows(T* out, T* x, T* residual, const T* weight, int64_t rows, int64_t hidden, double eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(hidden);
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * hidden;
      float sum_sq = 0.f;
      if (residual != nullptr) {
        T* rr = residual + r * hidden;
        for (int64_t i = 0; i < hidden; ++i) {
          T s = from_float<T>(to_float(xr[i]) + to_float(rr[i]));
          rr[i] = s;
          buf[i] = to_float(s);
        }
      } else {
        for (int64_t i = 0; i < hidden; ++i) buf[i] = to_float(xr[i]);
      }
#pragma omp simd reduction(+ : sum_sq)
      for (int64_t i = 0; i < hidden; ++i) sum_sq += buf[i] * buf[i];
      const float inv = 1.f / std::sqrt(sum_sq / static_cast<float>(hidden) + static_cast<float>(eps));
      T* orow = out + r * hidden;
      for (int64_t i = 0; i < hidden; ++i) orow[i] = from_float<T>(buf[i] * inv * to_float(weight[i]));
    }
  });
}

}  // namespace

at::Tensor rms_norm(at::Tensor x, const at::Tensor& weight, double eps, const c10::optional<at::Tensor>& residual) {
  check_cpu_contiguous(x, "x");
  check_cpu_contiguous(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && x.size(1) == weight.size(0), "rms_norm: x [rows, hidden], weight [hidden]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: weight dtype must equal x dtype");
  at::Tensor out = at::empty_like(x);
  LLMSERVE_DISPATCH(x.scalar_type(), "rms_norm", [&] {
    scalar_t* res = nullptr;
    if (residual.has_value()) { check_cpu_contiguous(*residual, "residual"); res = residual->data_ptr<scalar_t>(); }
    rms_norm_rows<scalar_t>(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), res, weight.data_ptr<scalar_t>(), x.size(0), x.size(1), eps);
  });
  return out;
}
}  // namespace llmserve
