// SiLU(gate) * up, for the MLP's fused gate/up projection.
#include "common.h"
#include "ops.h"

namespace llmserve {
namespace {

template <typename T>
void silu_mul_impl(T* out, const T* gate_up, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows * inter, 4096, [&](int64_t begin, int64_t end) {
    // Flattened over rows x features so one decode row still splits across threads.
    for (int64_t idx = begin; idx < end;) {
      const int64_t r = idx / inter, i = idx % inter, n = std::min(end - idx, inter - i);
      const T* g = gate_up + r * 2 * inter + i;
      const T* u = g + inter;
      T* o = out + r * inter + i;
      // silu(g) rounded to the model dtype before the product, as the unfused ops round.
      auto silu_of = [&](vf gv) { return round_as(o, div(gv, add(set1(1.f), exp16(sub(zero(), gv))))); };
      int64_t j = 0;
      // Two vectors at a time: one waits on exp's chain of dependent FMAs, and a second, independent
      // one keeps the units busy meanwhile.
      for (; j + 32 <= n; j += 32) {
        const vf s0 = silu_of(load16(g + j)), s1 = silu_of(load16(g + j + 16));
        store16(o + j, mul(s0, load16(u + j)));
        store16(o + j + 16, mul(s1, load16(u + j + 16)));
      }
      for (; j < n; j += 16) {
        const vm m = tail_mask(n - j);
        store16(o + j, mul(silu_of(load16(g + j, m)), load16(u + j, m)), m);
      }
      idx += n;
    }
  });
}

}  // namespace

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_cpu_contiguous(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [rows, 2 * intermediate]");
  const int64_t inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({gate_up.size(0), inter}, gate_up.options());
  LLMSERVE_DISPATCH(gate_up.scalar_type(), "silu_mul", [&] {
    silu_mul_impl<scalar_t>(out.data_ptr<scalar_t>(), gate_up.data_ptr<scalar_t>(), gate_up.size(0), inter);
  });
  return out;
}

}  // namespace llmserve
