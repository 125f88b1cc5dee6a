// What every kernel file shares: scalar conversions, argument checks, the dtype dispatch and the int8
// KV-cache row format. Each file is compiled once per ISA level (kernels/cpu/isa.py), into its own
// library; everything here is inline, so nothing is shared between levels at link time.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace llmserve {

using namespace vec;

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
template <typename T> inline T from_float(float x) { return static_cast<T>(x); }  // BFloat16: round to nearest even

// ---- work shared out item by item -------------------------------------------------------------
// Items [0, total) claimed from a shared counter by each of torch's threads, a run of `grain`
// consecutive items at a time, rather than split into a fixed range per thread: the threads end
// together even when items cost different amounts or a core is taken for a while by another process
// (the rest of the stack on a small machine, or the host), which a fixed split leaves every other
// thread waiting on. An item's arithmetic does not depend on the thread that runs it, so results are
// the same bit for bit.
class ItemCounter {
 public:
  ItemCounter(int64_t total, int64_t grain) : total_(total), grain_(grain) {}
  int64_t total() const { return total_; }
  // The first item of the next unclaimed run, or total() once every item is claimed.
  int64_t claim() { return std::min(next_.fetch_add(grain_, std::memory_order_relaxed), total_); }
  // The item a thread runs after `item`: the next of its run, or the first of a newly claimed one.
  int64_t after(int64_t item) { return (item + 1) % grain_ != 0 && item + 1 < total_ ? item + 1 : claim(); }

 private:
  std::atomic<int64_t> next_{0};
  const int64_t total_, grain_;
};

// per_thread(items) on up to at::get_num_threads() threads; each claims runs of `grain` items
// until none is left.
template <typename F>
void parallel_claim(int64_t total, const F& per_thread, int64_t grain = 1) {
  ItemCounter items(total, grain);
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (total + grain - 1) / grain);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { per_thread(items); });
}

// The claim grain for a linear over `panels` weight panels and `rows` input rows: one row is a pure
// stream of the weights from DRAM, read fastest as one contiguous run per thread (the threads' streams
// interleaved panel by panel read slower); more rows compute enough per panel to take them one at a
// time.
inline int64_t panel_grain(int64_t panels, int64_t rows) {
  const int64_t threads = std::max(1, at::get_num_threads());
  return rows == 1 ? std::max<int64_t>(1, (panels + threads - 1) / threads) : 1;
}

inline void check_cpu_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// Both dtypes the engine runs on CPU; the body sees scalar_t.
#define LLMSERVE_DISPATCH(TYPE, NAME, ...) \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

// Every block a sequence reads must exist: checked on the raw values (a torch reduction per layer
// would cost more than some of the ops).
inline void check_block_tables(const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t block_size, int64_t num_blocks) {
  for (int64_t s = 0; s < seq_lens.numel(); ++s) {
    const int64_t len = seq_lens.data_ptr<int64_t>()[s];
    TORCH_CHECK(len >= 1 && len <= block_tables.size(1) * block_size, "sequence ", s, " length ", len, " does not fit its block table");
    const int64_t* table = block_tables.data_ptr<int64_t>() + s * block_tables.size(1);
    for (int64_t b = 0; b < (len + block_size - 1) / block_size; ++b)
      TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, "block id ", table[b], " outside the cache");
  }
}

// ---- int8 and fp8 KV-cache rows ---------------------------------------------------------------------
// An int8 cache (kv_cache_dtype="int8") holds each (token, KV head) row as head_dim int8 values followed
// by their fp32 scale (4 bytes, unaligned): x ~= scale * q, scale = max|x| / 127 (0 for an all-zero row),
// q = x * (127 / max|x|) rounded half to even (the int8 linear's rounding of its inputs). One scale per
// row makes a dot product with the row scale * (sum of integer products), so decode attention scales
// whole scores and softmax weights, not elements. Half the bytes of bf16 (plus 4 per row). The same
// rounding as shared/engine/kv_cache.quantize_kv, bit for bit.
constexpr int64_t kScaleBytes = 4;

// An fp8 cache (kv_cache_dtype="fp8") has the same rows with e4m3 bytes for values: x ~= scale * e4m3,
// scale = max|x| / 448. Kernels read an e4m3 byte through F16C (load16_fp8_shifted: the byte's
// exponent and mantissa moved into an fp16 whose value is the e4m3 one times 2^-8, subnormals
// included), so a row's scale is taken times kFp8Unshift.
struct Fp8 {
  uint8_t bits;
};
constexpr float kFp8Unshift = 256.f;

template <typename C>
constexpr bool kScaledRows = std::is_same_v<C, int8_t> || std::is_same_v<C, Fp8>;

template <typename B>
inline float row_scale(const B* row, int64_t head_dim) {
  static_assert(sizeof(B) == 1, "scaled rows are bytes");
  float s;
  std::memcpy(&s, row + head_dim, sizeof(s));
  return s;
}

// The scales of nt <= 16 rows (stride apart from `first`) in lanes; 0 past nt.
template <typename B>
LLMSERVE_INLINE vf row_scales16(const B* first, int64_t stride, int64_t nt, int64_t head_dim) {
  alignas(64) float scales[16] = {};
  for (int64_t u = 0; u < nt; ++u) scales[u] = row_scale(first + u * stride, head_dim);
  return load(scales);
}

template <typename T>
void quantize_row(int8_t* dst, const T* x, int64_t head_dim) {
  float amax = 0.f;
  for (int64_t i = 0; i < head_dim; ++i) amax = std::max(amax, std::fabs(to_float(x[i])));
  const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int64_t i = 0; i < head_dim; ++i) dst[i] = static_cast<int8_t>(std::nearbyint(to_float(x[i]) * inv));
  std::memcpy(dst + head_dim, &scale, sizeof(scale));
}

// A row back in the model dtype, (q * scale) rounded once, as the torch reference dequantizes;
// head_dim a multiple of 16.
template <typename T>
void dequantize_row(T* dst, const int8_t* row, int64_t head_dim) {
  const vf scale = set1(row_scale(row, head_dim));
  for (int64_t i = 0; i < head_dim; i += 16) store16(dst + i, mul(load16(row + i), scale));
}

// fp8 rows: x * (448 / max|x|) clamped to +-448 (saturating), then to e4m3 by c10's conversion (round
// to nearest even), the one torch's .to(torch.float8_e4m3fn) runs: the same bytes as
// shared/engine/kv_cache.quantize_kv_fp8.
constexpr float kFp8Max = 448.f;

template <typename T>
void quantize_row(Fp8* dst, const T* x, int64_t head_dim) {
  float amax = 0.f;
  for (int64_t i = 0; i < head_dim; ++i) amax = std::max(amax, std::fabs(to_float(x[i])));
  const float scale = amax / kFp8Max, inv = amax > 0.f ? kFp8Max / amax : 0.f;
  for (int64_t i = 0; i < head_dim; ++i)
    dst[i].bits = c10::Float8_e4m3fn(std::clamp(to_float(x[i]) * inv, -kFp8Max, kFp8Max)).x;
  std::memcpy(dst + head_dim, &scale, sizeof(scale));
}

// An fp8 row back in the model dtype, (e4m3 * scale) rounded once (the powers of two of the shifted
// load cancel exactly), as the torch reference dequantizes; head_dim a multiple of 16.
template <typename T>
void dequantize_row(T* dst, const Fp8* row, int64_t head_dim) {
  const vf scale = set1(row_scale(row, head_dim) * kFp8Unshift);
  for (int64_t i = 0; i < head_dim; i += 16) store16(dst + i, mul(load16_fp8_shifted(row + i), scale));
}

// Elements per (token, KV head) row of a cache of C: the values, then for int8 and fp8 the scale's bytes.
template <typename C>
constexpr int64_t cache_row_len(int64_t head_dim) { return head_dim + (kScaledRows<C> ? kScaleBytes : 0); }

// What a cache tensor holds: rows in the model dtype, int8 rows (int8 tensor) or fp8 rows (uint8 tensor:
// torch has no CPU index_copy_ for float8, so the engine keeps e4m3 bytes as uint8).
enum class CacheKind { kModel, kInt8, kFp8 };
inline CacheKind cache_kind(const at::Tensor& cache) {
  return cache.scalar_type() == at::kChar ? CacheKind::kInt8 : cache.scalar_type() == at::kByte ? CacheKind::kFp8 : CacheKind::kModel;
}
inline int64_t cache_head_dim(const at::Tensor& cache) {
  return cache.size(3) - (cache_kind(cache) == CacheKind::kModel ? 0 : kScaleBytes);
}

// A paged cache in q's dtype, or int8/fp8 rows with their scales.
inline CacheKind check_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, at::ScalarType dtype, int64_t kv_heads,
                             int64_t head_dim, const char* op) {
  const CacheKind kind = cache_kind(k_cache);
  const bool scaled = kind != CacheKind::kModel;
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              op, ": caches must be alike, [blocks, block_size, kv_heads, head_dim (+ 4 for int8/fp8)]");
  TORCH_CHECK(scaled || k_cache.scalar_type() == dtype, op, ": cache dtype must be int8, uint8 (fp8) or the dtype of q/qkv");
  TORCH_CHECK(k_cache.size(2) == kv_heads && k_cache.size(3) == head_dim + (scaled ? kScaleBytes : 0), op,
              ": cache rows must be [kv_heads, head_dim", scaled ? " + 4]" : "]");
  return kind;
}

}  // namespace llmserve
