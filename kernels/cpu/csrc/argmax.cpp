// The argmax of each row: torch.argmax's answer (the first index of the row's maximum, or of its first
// NaN: NaN counts as the maximum), for greedy sampling. torch's bf16 argmax is a scalar loop; this
// pass keeps 16 lanes.
#include "common.h"
#include "ops.h"

namespace llmserve {
namespace {

template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  // Lane u keeps the largest value among indices = u (mod 16) and its first index: strictly greater
  // replaces, so ties keep the earlier one; the first index among the lanes holding the maximum wins.
  vf best = set1(-std::numeric_limits<float>::infinity());
  vi best_at = zero_i32(), at = iota_i32();
  vm nan = no_lanes();
  for (int64_t j = 0; j < n; j += 16) {
    const vm m = tail_mask(n - j);
    const vf v = load16(x + j, m);  // masked-off lanes read 0: never greater, never NaN, once masked
    const vm greater_here = mask_and(m, greater(v, best));
    nan = mask_or(nan, mask_and(m, is_nan(v)));
    best = where(greater_here, v, best);
    best_at = where_i32(greater_here, at, best_at);
    at = add_i32(at, set1_i32(16));
  }
  if (any(nan)) {
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(to_float(x[j]))) return j;
  }
  // A row of -inf never replaces a lane: every lane holds index 0, its first.
  return reduce_min_i32(equal(best, set1(reduce_max(best))), best_at);
}

}  // namespace

at::Tensor argmax_rows(const at::Tensor& x) {
  check_cpu_contiguous(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) >= 1 && x.size(1) < (int64_t{1} << 31), "x must be [rows, 1 <= n < 2^31]");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  const int64_t n = x.size(1);
  int64_t* idx = out.data_ptr<int64_t>();
  LLMSERVE_DISPATCH(x.scalar_type(), "argmax_rows", [&] {
    const scalar_t* rows = x.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) idx[r] = argmax_row(rows + r * n, n);
    });
  });
  return out;
}

}  // namespace llmserve
