// RoPE on the fused QKV rows + K/V written to their cache slots. qkv: [tokens, (heads + 2 kv_heads) *
// head_dim]. Q and K heads are rotated in place (half-split layout: element i pairs with i + head_dim/2);
// K and V rows are then copied to slot_mapping[t] of the caches ([blocks, block_size, kv_heads, head_dim]
// viewed as [slots, kv_heads * head_dim]), or quantized into them when the caches are int8 or fp8
// ([blocks, block_size, kv_heads, head_dim + 4]).
#include "common.h"
#include "ops.h"

namespace llmserve {
namespace {

template <typename T, typename C>
void rope_and_cache_impl(T* qkv, const int64_t* positions, const float* cos, const float* sin, C* k_cache,
                         C* v_cache, const int64_t* slots, int64_t tokens, int64_t heads, int64_t kv_heads,
                         int64_t head_dim) {
  const int64_t half = head_dim / 2, row = (heads + 2 * kv_heads) * head_dim, kv_row = kv_heads * head_dim;
  const int64_t cache_row = kv_heads * cache_row_len<C>(head_dim);
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* r = qkv + t * row;
      const float* c = cos + positions[t] * half;
      const float* s = sin + positions[t] * half;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        T* x = r + h * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
          x[i] = from_float<T>(x1 * c[i] - x2 * s[i]);
          x[i + half] = from_float<T>(x2 * c[i] + x1 * s[i]);
        }
      }
      const T* k = r + heads * head_dim;
      const T* v = k + kv_row;
      if constexpr (kScaledRows<C>) {
        for (int64_t h = 0; h < kv_heads; ++h) {
          const int64_t row_at = slots[t] * cache_row + h * cache_row_len<C>(head_dim);
          quantize_row(k_cache + row_at, k + h * head_dim, head_dim);
          quantize_row(v_cache + row_at, v + h * head_dim, head_dim);
        }
      } else {
        std::memcpy(k_cache + slots[t] * cache_row, k, kv_row * sizeof(T));
        std::memcpy(v_cache + slots[t] * cache_row, v, kv_row * sizeof(T));
      }
    }
  });
}

}  // namespace

void rope_and_cache(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                    at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping, int64_t heads,
                    int64_t kv_heads, int64_t head_dim) {
  for (auto* t : {&qkv, &k_cache, &v_cache}) check_cpu_contiguous(*t, "qkv/k_cache/v_cache");
  check_cpu_contiguous(positions, "positions");
  check_cpu_contiguous(slot_mapping, "slot_mapping");
  check_cpu_contiguous(cos, "cos");
  check_cpu_contiguous(sin, "sin");
  TORCH_CHECK(head_dim % 2 == 0, "head_dim must be even");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (heads + 2 * kv_heads) * head_dim, "qkv must be [tokens, (heads + 2 kv_heads) * head_dim]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong, "positions and slot_mapping must be int64");
  TORCH_CHECK(positions.numel() == qkv.size(0) && slot_mapping.numel() == qkv.size(0), "one position and one slot per token");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.size(1) == head_dim / 2, "cos/sin: fp32 [positions, head_dim/2]");
  const CacheKind kind = check_cache(k_cache, v_cache, qkv.scalar_type(), kv_heads, head_dim, "rope_and_cache");
  // Bounds are checked on the raw values (a torch reduction per layer would cost more than the op).
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < qkv.size(0); ++t) {
    const int64_t pos = positions.data_ptr<int64_t>()[t], slot = slot_mapping.data_ptr<int64_t>()[t];
    TORCH_CHECK(pos >= 0 && pos < cos.size(0), "position ", pos, " outside the RoPE table");
    TORCH_CHECK(slot >= 0 && slot < num_slots, "slot ", slot, " outside the cache");
  }
  LLMSERVE_DISPATCH(qkv.scalar_type(), "rope_and_cache", [&] {
    auto run = [&](auto* k, auto* v) {
      rope_and_cache_impl(qkv.data_ptr<scalar_t>(), positions.data_ptr<int64_t>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                          k, v, slot_mapping.data_ptr<int64_t>(), qkv.size(0), heads, kv_heads, head_dim);
    };
    if (kind == CacheKind::kInt8) run(k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>());
    else if (kind == CacheKind::kFp8)
      run(reinterpret_cast<Fp8*>(k_cache.data_ptr<uint8_t>()), reinterpret_cast<Fp8*>(v_cache.data_ptr<uint8_t>()));
    else run(k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>());
  });
}

}  // namespace llmserve
