// CPU kernels for the hot parts of a Llama forward pass (registered as torch.ops.llmserve_cpu.*).
//
// Why they exist: a single-token decode step of a small model is ~30 layers x ~25 tiny torch ops, each
// paying dispatch and an OpenMP fork/join; batched decode attention spent most of a step gathering
// blocks into a padded, masked SDPA; prefill attention computed (and masked) the whole causal square;
// and oneDNN's bf16 matrix-vector product reads weights at ~60% of the DRAM bandwidth. These kernels
// fuse the elementwise work (RMSNorm + residual, RoPE + KV-cache write, SiLU-and-mul), read the paged
// KV cache in place for decode and prefill attention, and multiply bf16 weights packed once in pairs
// (at the DRAM bandwidth for decode, level with oneDNN for prefill) or int8 weights in quads with
// int8 activations (quantization="int8": AVX512-VNNI, 1.7-2.3x the bf16 linear). The cache and the
// attention kernels also take int8 K/V rows with a scale each (kv_cache_dtype="int8"). A row argmax
// replaces torch's scalar bf16 one for greedy sampling.
//
// Every op has a torch reference in shared/engine (the same maths, unfused) and is tested against it.
// Built once per machine by kernels/cpu/__init__.py with -O3 -march=native; AVX-512F is required
// (elsewhere the build stops here and the engine keeps the torch path), AVX512-BF16 for the bf16
// linear and for bf16 attention dot products, AVX512-VNNI for the int8 linear.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#if !defined(__AVX512F__) || !defined(__AVX512BW__)
#error "llmserve CPU kernels need AVX-512F/BW; the engine falls back to its torch path"
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
template <typename T> inline T from_float(float x) { return static_cast<T>(x); }  // BFloat16: round to nearest even

void check_cpu_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// Both dtypes the engine runs on CPU; the body sees scalar_t.
#define LLMSERVE_DISPATCH(TYPE, NAME, ...) \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

// Every block a sequence reads must exist: checked on the raw values (a torch reduction per layer
// would cost more than some of the ops).
void check_block_tables(const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t block_size, int64_t num_blocks) {
  for (int64_t s = 0; s < seq_lens.numel(); ++s) {
    const int64_t len = seq_lens.data_ptr<int64_t>()[s];
    TORCH_CHECK(len >= 1 && len <= block_tables.size(1) * block_size, "sequence ", s, " length ", len, " does not fit its block table");
    const int64_t* table = block_tables.data_ptr<int64_t>() + s * block_tables.size(1);
    for (int64_t b = 0; b < (len + block_size - 1) / block_size; ++b)
      TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, "block id ", table[b], " outside the cache");
  }
}

// ---- 16-lane fp32 helpers (AVX-512F) -----------------------------------------------------------------

inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << remaining) - 1);
}

// Loads up to 16 elements as fp32 (bf16 widens by a 16-bit shift); masked-off lanes read as 0.
inline __m512 load16(const float* p, __mmask16 m = 0xFFFF) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 m = 0xFFFF) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// fp32 -> bf16 bits, round to nearest even (finite inputs), as c10::BFloat16's constructor rounds.
inline __m256i to_bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

inline void store16(float* p, __m512 v, __mmask16 m = 0xFFFF) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(c10::BFloat16* p, __m512 v, __mmask16 m = 0xFFFF) { _mm256_mask_storeu_epi16(p, m, to_bf16_bits(v)); }

// The value T would hold: identity for fp32, a round trip through bf16 otherwise.
inline __m512 round_as(float*, __m512 v) { return v; }
inline __m512 round_as(c10::BFloat16*, __m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16_bits(v)), 16));
}

// A 16 x 16 fp32 transpose in registers, in place: r[i] lane j <- r[j] lane i.
inline void transpose16(__m512 (&r)[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int g = 0; g < 16; g += 4) {  // rows g..g+3: u[g + c] holds columns c, c + 4, c + 8, c + 12
    const __m512d a = _mm512_castps_pd(t[g]), b = _mm512_castps_pd(t[g + 1]);
    const __m512d c = _mm512_castps_pd(t[g + 2]), d = _mm512_castps_pd(t[g + 3]);
    u[g] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    u[g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    u[g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    u[g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 e0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88), e1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
    const __m512 o0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD), o1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
    r[c] = _mm512_shuffle_f32x4(e0, e1, 0x88);
    r[c + 8] = _mm512_shuffle_f32x4(e0, e1, 0xDD);
    r[c + 4] = _mm512_shuffle_f32x4(o0, o1, 0x88);
    r[c + 12] = _mm512_shuffle_f32x4(o0, o1, 0xDD);
  }
}

// exp(x) for 16 lanes: x = n ln2 + r with |r| <= ln2/2, e^r by its Taylor series to r^7 (relative
// error ~6e-9, under one fp32 ulp), then scaled by 2^n. Inputs below -87 flush towards 0.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2 split in two for exactness
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// ---- int8 KV-cache rows ------------------------------------------------------------------------------
// An int8 cache (kv_cache_dtype="int8") holds each (token, KV head) row as head_dim int8 values followed
// by their fp32 scale (4 bytes, unaligned): x ~= scale * q, scale = max|x| / 127 (0 for an all-zero row),
// q = x * (127 / max|x|) rounded half to even (the int8 linear's rounding of its inputs). One scale per
// row makes a dot product with the row scale * (sum of integer products), so decode attention scales
// whole scores and softmax weights, not elements. Half the bytes of bf16 (plus 4 per row): decode
// attention reads 1.88x fewer bytes per token (its times for both caches: see decode attention). The
// same rounding as shared/engine/kv_cache.quantize_kv, bit for bit.
constexpr int64_t kScaleBytes = 4;

inline float row_scale(const int8_t* row, int64_t head_dim) {
  float s;
  std::memcpy(&s, row + head_dim, sizeof(s));
  return s;
}

// The scales of nt <= 16 rows (stride apart from `first`) in lanes; 0 past nt.
__attribute__((always_inline)) inline __m512 row_scales16(const int8_t* first, int64_t stride, int64_t nt, int64_t head_dim) {
  alignas(64) float scales[16] = {};
  for (int64_t u = 0; u < nt; ++u) scales[u] = row_scale(first + u * stride, head_dim);
  return _mm512_load_ps(scales);
}

template <typename T>
void quantize_row(int8_t* dst, const T* x, int64_t head_dim) {
  float amax = 0.f;
  for (int64_t i = 0; i < head_dim; ++i) amax = std::max(amax, std::fabs(to_float(x[i])));
  const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int64_t i = 0; i < head_dim; ++i) dst[i] = static_cast<int8_t>(std::nearbyint(to_float(x[i]) * inv));
  std::memcpy(dst + head_dim, &scale, sizeof(scale));
}

// 16 int8 values as fp32 (exact).
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// A row back in the model dtype, (q * scale) rounded once, as the torch reference dequantizes;
// head_dim a multiple of 16.
template <typename T>
void dequantize_row(T* dst, const int8_t* row, int64_t head_dim) {
  const __m512 scale = _mm512_set1_ps(row_scale(row, head_dim));
  for (int64_t i = 0; i < head_dim; i += 16) store16(dst + i, _mm512_mul_ps(load16(row + i), scale));
}

// Elements per (token, KV head) row of a cache of C: the values, then for int8 the scale's bytes.
template <typename C>
constexpr int64_t cache_row_len(int64_t head_dim) { return head_dim + (std::is_same_v<C, int8_t> ? kScaleBytes : 0); }

// ---- RMSNorm, optionally fused with the residual add ------------------------------------------------
// out = x / sqrt(mean(x^2) + eps) * weight, accumulated in fp32. With a residual: residual += x first
// (in place, rounded to the model dtype as the unfused add would be) and the sum is normalized.

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

// ---- RoPE on the fused QKV rows + K/V written to their cache slots ----------------------------------
// qkv: [tokens, (heads + 2 kv_heads) * head_dim]. Q and K heads are rotated in place (half-split layout:
// element i pairs with i + head_dim/2); K and V rows are then copied to slot_mapping[t] of the caches
// ([blocks, block_size, kv_heads, head_dim] viewed as [slots, kv_heads * head_dim]), or quantized into
// them when the caches are int8 ([blocks, block_size, kv_heads, head_dim + 4]).

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
      if constexpr (std::is_same_v<C, int8_t>) {
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

// A paged cache in q's dtype, or int8 rows with their scales; returns whether it is int8.
bool check_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, at::ScalarType dtype, int64_t kv_heads,
                 int64_t head_dim, const char* op) {
  const bool int8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              op, ": caches must be alike, [blocks, block_size, kv_heads, head_dim (+ 4 for int8)]");
  TORCH_CHECK(int8 || k_cache.scalar_type() == dtype, op, ": cache dtype must be int8 or the dtype of q/qkv");
  TORCH_CHECK(k_cache.size(2) == kv_heads && k_cache.size(3) == head_dim + (int8 ? kScaleBytes : 0), op,
              ": cache rows must be [kv_heads, head_dim", int8 ? " + 4]" : "]");
  return int8;
}

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
  const bool int8 = check_cache(k_cache, v_cache, qkv.scalar_type(), kv_heads, head_dim, "rope_and_cache");
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
    if (int8) run(k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>());
    else run(k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>());
  });
}

// ---- SiLU(gate) * up ---------------------------------------------------------------------------------

template <typename T>
void silu_mul_impl(T* out, const T* gate_up, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows * inter, 4096, [&](int64_t begin, int64_t end) {
    // Flattened over rows x features so one decode row still splits across threads.
    for (int64_t idx = begin; idx < end;) {
      const int64_t r = idx / inter, i = idx % inter, n = std::min(end - idx, inter - i);
      const T* g = gate_up + r * 2 * inter + i;
      const T* u = g + inter;
      T* o = out + r * inter + i;
      for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 m = tail_mask(n - j);
        const __m512 gv = load16(g + j, m);
        // silu(g) rounded to the model dtype before the product, as the unfused ops round.
        const __m512 silu = round_as(o, _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv)))));
        store16(o + j, _mm512_mul_ps(silu, load16(u + j, m)), m);
      }
      idx += n;
    }
  });
}

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

// ---- Argmax of each row --------------------------------------------------------------------------------
// torch.argmax's answer (the first index of the row's maximum, or of its first NaN: NaN counts as the
// maximum), for greedy sampling. torch's bf16 argmax is scalar: ~2.9 ms for a decode step's 32 x
// 49,152 logits on this host, against 0.12 ms for this lane-wise pass (0.7 ms for torch's fp32 one).

template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  // Lane u keeps the largest value among indices = u (mod 16) and its first index: strictly greater
  // replaces, so ties keep the earlier one; the first index among the lanes holding the maximum wins.
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i best_at = _mm512_setzero_si512(), at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __mmask16 nan = 0;
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = tail_mask(n - j);
    const __m512 v = load16(x + j, m);
    const __mmask16 greater = _mm512_mask_cmp_ps_mask(m, v, best, _CMP_GT_OQ);
    nan |= _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
    best = _mm512_mask_mov_ps(best, greater, v);
    best_at = _mm512_mask_mov_epi32(best_at, greater, at);
    at = _mm512_add_epi32(at, _mm512_set1_epi32(16));
  }
  if (nan) {
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(to_float(x[j]))) return j;
  }
  // A row of -inf never replaces a lane: every lane holds index 0, its first.
  const __mmask16 at_max = _mm512_cmp_ps_mask(best, _mm512_set1_ps(_mm512_reduce_max_ps(best)), _CMP_EQ_OQ);
  return _mm512_mask_reduce_min_epi32(at_max, best_at);
}

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

// ---- Decode attention over the paged cache ----------------------------------------------------------
// One query token per sequence. Each KV head's group of query heads scores every cached key of the
// sequence, read block by block in place (fp32 sums), softmax, then the weighted sum of values. The
// cache is read once per KV head, not once per query head.
//
// Measured on this 2-core host, SmolLM2 shapes, 30 layers x 32 sequences x 400 tokens (295 MB of K/V,
// blocks shuffled through the pool): 34 ms as first written (one KV head per item, fp32 products,
// prefetch into L1) -> 27 ms with a whole sequence per item -> 15.5 ms prefetching into L2 instead
// (a burst of L1 prefetches stalls on the fill buffers) -> 13-16 ms with bf16 dot products for the
// scores, four keys per horizontal reduction -> 12.7-13.0 ms with 16 keys moved into lanes by register
// transposes (alternating runs with the previous build, which took 14.1-15.9; the int8 cache went from
// 11.9-12.8 to 10.1-11.6 ms, and at 8 x 2,048 tokens from 15.8-16.0 to 12.0-13.3).
// One sequence of 4,096 tokens: 6.4 ms with its three KV heads as items (two threads: 2 + 1) -> 4.0 ms
// with its keys split in four parts (`python -m loadtests.bench_kernels --batches 1 --context 4096`).
// Splitting by each sequence's own length instead (parts of up to 256 tokens, so that a sequence's
// output is the same in any batch), in alternating runs with the batch-sized split: 1 x 4,096 tokens
// 4.5-4.6 vs 4.7-5.7 ms, 32 x 400 14.4-16.4 vs 15.9-18.7 ms, 8 x 2,048 17.3-22.3 vs 16.9-23.0 ms.
// Values two keys per dot product (weighted_values), against fp32 multiply-adds of one key, 32 x 400
// tokens, three alternating runs each on a busy host (`python -m loadtests.bench_kernels --batches 32,8
// --kv-cache-dtype ...`; "cached": every sequence reads the same blocks, so what is left is compute):
// bf16 cached 11.0-11.4 -> 9.3-10.8 ms, from DRAM 15.1-18.7 -> 14.9-15.9 ms (bound by the scattered
// blocks' bandwidth, ~17-21 GB/s of the ~28 a sequential read gets); int8 cached 11.2-12.6 -> 9.6-13.3
// ms, from DRAM 13.7-15.6 -> 11.9-15.7 ms, at 8 x 400 3.6-4.4 -> 3.0-3.5 ms.

// Blocks of a sequence sit anywhere in the pool, so the hardware prefetcher cannot see the next one
// coming: ask for its rows into L2 while the current block is computed, kAheadBlocks ahead.
constexpr int64_t kAheadBlocks = 2;
template <typename T>
inline void prefetch_rows(const T* first, int64_t rows, int64_t row_stride, int64_t row_len) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t off = 0; off < row_len * static_cast<int64_t>(sizeof(T)); off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(first + r * row_stride) + off, _MM_HINT_T1);
}

// Head kh's share of the rows [t, t + rows) of the block ahead (nothing if none): spread over the
// heads' turns, as a burst of 16 rows stalls on the fill buffers. Forced inline: GCC called it out of
// line from the key pass's lambda, and decode attention from DRAM took 24-34 ms instead of 14-19
// (`bench_kernels --batches 32`, bf16).
template <typename C>
__attribute__((always_inline)) inline void prefetch_share(const C* ahead, int64_t t, int64_t rows, int64_t kh, int64_t kv_heads, int64_t kv_row) {
  if (ahead == nullptr) return;
  const int64_t r0 = rows * kh / kv_heads, r1 = rows * (kh + 1) / kv_heads;
  prefetch_rows(ahead + (t + r0) * kv_row, r1 - r0, kv_row, kv_row);
}

// Runs body(rows, ahead, n, t0) over blocks b_lo..b_hi-1 of a sequence (block table `table`, `len` keys) in
// `cache`: each block's rows, those of the block kAheadBlocks on (nullptr past b_hi: the body prefetches
// them as it goes), its key count and its first key's index counted from block b_lo. The first
// kAheadBlocks blocks are prefetched before the first call.
template <typename C, typename Body>
inline void for_each_block(const C* cache, const int64_t* table, int64_t b_lo, int64_t b_hi, int64_t len, int64_t block_size,
                           int64_t kv_row, const Body& body) {
  auto rows = [&](int64_t b) { return cache + table[b] * block_size * kv_row; };
  for (int64_t b = b_lo; b < std::min(b_lo + kAheadBlocks, b_hi); ++b) prefetch_rows(rows(b), block_size, kv_row, kv_row);
  for (int64_t b = b_lo; b < b_hi; ++b)
    body(rows(b), b + kAheadBlocks < b_hi ? rows(b + kAheadBlocks) : nullptr, std::min(block_size, len - b * block_size),
         (b - b_lo) * block_size);
}

// The largest of x[0..len), len >= 1: 16 lanes at a time (exact in any order). The scalar loop it
// replaced stored its running max every key: ~12% of decode attention's samples with the blocks in L2
// (perf), 7.3 -> 6.6 ms at 32 x 400 tokens x 30 layers.
inline float max_of(const float* x, int64_t len) {
  const __m512 lowest = _mm512_set1_ps(-INFINITY);
  __m512 m = lowest;
  for (int64_t i = 0; i < len; i += 16) m = _mm512_max_ps(m, _mm512_mask_loadu_ps(lowest, tail_mask(len - i), x + i));
  return _mm512_reduce_max_ps(m);
}

// In place: x[i] = exp(x[i] - shift); returns the sum.
inline float exp_shifted_sum(float* x, int64_t len, float shift) {
  const __m512 vs = _mm512_set1_ps(shift);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; t += 16) {
    const __mmask16 m = tail_mask(len - t);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + t), vs));
    _mm512_mask_storeu_ps(x + t, m, e);
    sum = _mm512_mask_add_ps(sum, m, sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

// Scores of G query heads (head_dim = NV * 16 apart at q) against nt <= 16 key rows (stride apart at
// k): dot[j] lane u = q_j . k_u, 0 for u >= nt. The rows' 32-bit units (a dim, a bf16 pair or four
// int8) are moved into lanes by 16 x 16 register transposes, so each key's products accumulate in its
// own lane: no horizontal sums (with four keys per horizontal reduction instead, those cost as much
// as the products).
template <int G, int NV, typename T>
inline void key_scores(__m512 (&dot)[G], const T* q, const T* k, int64_t stride, int64_t nt) {
  for (int j = 0; j < G; ++j) dot[j] = _mm512_setzero_ps();
  for (int c = 0; c < NV; ++c) {  // 16 dims at a time
    __m512 r[16];
    for (int64_t u = 0; u < 16; ++u) r[u] = u < nt ? load16(k + u * stride + c * 16) : _mm512_setzero_ps();
    transpose16(r);  // r[i] lane u = k_u[16c + i]
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < G; ++j) dot[j] = _mm512_fmadd_ps(_mm512_set1_ps(to_float(q[j * NV * 16 + c * 16 + i])), r[i], dot[j]);
  }
}

// 64 bytes of each of 16 key rows (at `first` + u * stride_bytes; zero for u >= nt), transposed: r[i]
// lane u = row u's 32-bit unit i (a bf16 pair or four int8, as fp32 bits).
inline void load_units_transposed(__m512 (&r)[16], const void* first, int64_t stride_bytes, int64_t nt) {
  const char* p = static_cast<const char*>(first);
  for (int64_t u = 0; u < 16; ++u) r[u] = u < nt ? _mm512_loadu_ps(p + u * stride_bytes) : _mm512_setzero_ps();
  transpose16(r);
}

#if defined(__AVX512BF16__)
// bf16 keys and queries multiply as they are: 32 exact products per instruction, summed in fp32.
template <int G, int NV>
inline void key_scores(__m512 (&dot)[G], const c10::BFloat16* q, const c10::BFloat16* k, int64_t stride, int64_t nt) {
  for (int j = 0; j < G; ++j) dot[j] = _mm512_setzero_ps();
  for (int c = 0; c < NV / 2; ++c) {  // 16 pairs = 32 dims at a time
    __m512 r[16];
    // r[i] lane u = (k_u[32c + 2i], k_u[32c + 2i + 1])
    load_units_transposed(r, k + c * 32, stride * static_cast<int64_t>(sizeof(*k)), nt);
    const uint32_t* qp = reinterpret_cast<const uint32_t*>(q) + c * 16;
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < G; ++j)
        dot[j] = _mm512_dpbf16_ps(dot[j], (__m512bh)_mm512_castps_si512(r[i]), (__m512bh)_mm512_set1_epi32(qp[j * NV * 8 + i]));
  }
}
#endif

// sum + the pairwise sums of int16 products a * b, in int32 lanes (one instruction with AVX512-VNNI).
inline __m512i add_dot_i16(__m512i sum, __m512i a, __m512i b) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(sum, a, b);
#else
  return _mm512_add_epi32(sum, _mm512_madd_epi16(a, b));
#endif
}

// int8 keys against queries quantized to int16 (one scale per head, relative error 2^-16 of the head's
// largest element: far below bf16's rounding) and stored as pairs by prepare_query_int16: after the
// transpose a lane holds four int8 of one key, whose even and odd bytes sign-extend to int16 pairs
// (dims 4i, 4i+2 and 4i+1, 4i+3) for 32 exact products per instruction into int32 lanes that cannot
// overflow (64 x 127 x 32767 < 2^31 per lane at head_dim 128). The caller multiplies each finished
// score by the query's and the key row's scales.
template <int G, int NV>
inline void key_scores(__m512 (&dot)[G], const int32_t* q, const int8_t* k, int64_t stride, int64_t nt) {
  __m512i acc[G];
  for (int j = 0; j < G; ++j) acc[j] = _mm512_setzero_si512();
  for (int c = 0; c < NV / 4; ++c) {  // 64 dims at a time
    __m512 r[16];
    load_units_transposed(r, k + c * 64, stride, nt);  // r[i] lane u = k_u[64c + 4i .. 64c + 4i + 3]
    for (int i = 0; i < 16; ++i) {
      const __m512i x = _mm512_castps_si512(r[i]);
      const __m512i even = _mm512_srai_epi16(_mm512_slli_epi16(x, 8), 8), odd = _mm512_srai_epi16(x, 8);
      const int32_t* qi = q + 2 * (c * 16 + i);
      for (int j = 0; j < G; ++j) {
        acc[j] = add_dot_i16(acc[j], even, _mm512_set1_epi32(qi[j * NV * 8]));
        acc[j] = add_dot_i16(acc[j], odd, _mm512_set1_epi32(qi[j * NV * 8 + 1]));
      }
    }
  }
  for (int j = 0; j < G; ++j) dot[j] = _mm512_cvtepi32_ps(acc[j]);
}

// Each of the num_heads * head_dim query values as int16 (round half to even) with one fp32 scale per
// head, stored as the int16 pairs key_scores multiplies: for each four dims, (q[4i], q[4i+2]) then
// (q[4i+1], q[4i+3]).
template <typename T>
void prepare_query_int16(int32_t* dst, float* scales, const T* q, int64_t num_heads, int64_t head_dim) {
  for (int64_t h = 0; h < num_heads; ++h) {
    const T* x = q + h * head_dim;
    float amax = 0.f;
    for (int64_t i = 0; i < head_dim; ++i) amax = std::max(amax, std::fabs(to_float(x[i])));
    scales[h] = amax / 32767.f;
    auto q16 = [&](int64_t i) -> uint32_t {
      return static_cast<uint16_t>(amax > 0.f ? static_cast<int16_t>(std::nearbyint(to_float(x[i]) / scales[h])) : 0);
    };
    for (int64_t i = 0; i < head_dim; i += 4) {
      dst[(h * head_dim + i) / 2] = static_cast<int32_t>(q16(i) | q16(i + 2) << 16);
      dst[(h * head_dim + i) / 2 + 1] = static_cast<int32_t>(q16(i + 1) | q16(i + 3) << 16);
    }
  }
}

// accs [kv_heads * G heads][head_dim] += the part's softmax weights (sc: [head][span], the part's
// keys from block b_lo on) times its value rows, in fp32 products: four tokens at a time, then each
// head's accumulators (kept in registers for those four tokens, in the buffer between them): fp32
// values, and bf16 ones without AVX512-BF16. The overloads below take bf16 and int8 values.
template <int G, int NV, typename C>
void weighted_values(float* accs, const float* sc, int64_t span, const C* v_cache, const int64_t* table,
                     int64_t b_lo, int64_t b_hi, int64_t len, int64_t block_size, int64_t kv_heads) {
  constexpr int64_t head_dim = NV * 16, head_row = cache_row_len<C>(head_dim);
  const int64_t kv_row = kv_heads * head_row;
  for_each_block(v_cache, table, b_lo, b_hi, len, block_size, kv_row,
                 [&](const C* vb, const C* ahead, int64_t n, int64_t t0) {
    for (int64_t t = 0; t < n; t += 4) {
      if (ahead != nullptr) prefetch_rows(ahead + t * kv_row, std::min<int64_t>(4, block_size - t), kv_row, kv_row);
      const int64_t nt = std::min<int64_t>(4, n - t);
      for (int64_t kh = 0; kh < kv_heads; ++kh) {
        const float* sk = sc + kh * G * span + t0 + t;
        float* ak = accs + kh * G * head_dim;
        __m512 acc[G][NV];
        for (int j = 0; j < G; ++j)
          for (int v = 0; v < NV; ++v) acc[j][v] = _mm512_loadu_ps(ak + j * head_dim + v * 16);
        for (int64_t u = 0; u < nt; ++u) {
          const C* vr = vb + (t + u) * kv_row + kh * head_row;
          for (int v = 0; v < NV; ++v) {
            const __m512 val = load16(vr + v * 16);
            for (int j = 0; j < G; ++j) acc[j][v] = _mm512_fmadd_ps(_mm512_set1_ps(sk[j * span + u]), val, acc[j][v]);
          }
        }
        for (int j = 0; j < G; ++j)
          for (int v = 0; v < NV; ++v) _mm512_storeu_ps(ak + j * head_dim + v * 16, acc[j][v]);
      }
    }
  });
}

// The partner of a key without one (the odd last key of a block): a value row of zeros, as long as
// the longest row (head_dim 128 in bf16).
alignas(64) constexpr uint8_t kZeroRow[256] = {};

// Two keys' value rows a, b interleaved by unpacklo/hi_epi16 into (a[d], b[d]) pairs give, for each
// 32 dims, sums in the order 0-3, 8-11, 16-19, 24-27 (the unpacklo vector) | 4-7, 12-15, 20-23, 28-31
// (the unpackhi one). Puts `count` such sums (a multiple of 32) back in order.
inline void unpermute_pair_sums(float* sums, int64_t count) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (float* a = sums; a < sums + count; a += 32) {
    const __m512 lo = _mm512_loadu_ps(a), hi = _mm512_loadu_ps(a + 16);
    _mm512_storeu_ps(a, _mm512_permutex2var_ps(lo, first, hi));
    _mm512_storeu_ps(a + 16, _mm512_permutex2var_ps(lo, second, hi));
  }
}

// int8 values: a block's keys go 16 at a time. Their weights, times each value row's scale, are held as
// int16 with one scale per head and 16 keys (round half to even; error 2^-16 of the largest, far
// below the bf16 rounding of the bf16 path), and two keys go per instruction: their rows sign-extended
// to int16 and interleaved into (V[u][d], V[u+1][d]) pairs against the broadcast pair of weights, 32
// exact products into int32 sums (at most 16 x 127 x 32767 per lane: no overflow), converted and
// scaled into the fp32 sums after each 16 keys. ~15 instructions a key instead of ~30.
template <int G, int NV>
void weighted_values(float* accs, const float* sc, int64_t span, const int8_t* v_cache, const int64_t* table,
                     int64_t b_lo, int64_t b_hi, int64_t len, int64_t block_size, int64_t kv_heads) {
  constexpr int64_t head_dim = NV * 16, head_row = cache_row_len<int8_t>(head_dim);
  const int64_t kv_row = kv_heads * head_row;
  for_each_block(v_cache, table, b_lo, b_hi, len, block_size, kv_row,
                 [&](const int8_t* vb, const int8_t* ahead, int64_t n, int64_t t0) {
    for (int64_t t = 0; t < n; t += 16) {
      const int64_t nt = std::min<int64_t>(16, n - t), ahead_rows = std::min<int64_t>(16, block_size - t);
      for (int64_t kh = 0; kh < kv_heads; ++kh) {
        prefetch_share(ahead, t, ahead_rows, kh, kv_heads, kv_row);
        const int8_t* v0 = vb + t * kv_row + kh * head_row;
        const __m512 vs = row_scales16(v0, kv_row, nt, head_dim);
        alignas(64) int16_t w16[G][32] = {};  // the 16 keys' weights, then zeros (a key without a partner)
        float w_scale[G];
        for (int j = 0; j < G; ++j) {
          const __m512 w = _mm512_mul_ps(_mm512_maskz_loadu_ps(tail_mask(nt), sc + (kh * G + j) * span + t0 + t), vs);
          const float w_max = _mm512_reduce_max_ps(w);  // weights are >= 0
          w_scale[j] = w_max / 32767.f;
          if (w_max > 0.f)
            _mm256_store_si256(reinterpret_cast<__m256i*>(w16[j]),
                               _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(w, _mm512_set1_ps(32767.f / w_max)))));
        }
        __m512i acc[G][NV];
        for (int j = 0; j < G; ++j)
          for (int v = 0; v < NV; ++v) acc[j][v] = _mm512_setzero_si512();
        for (int64_t u = 0; u < nt; u += 2) {
          const int8_t* a_row = v0 + u * kv_row;
          const int8_t* b_row = u + 1 < nt ? a_row + kv_row : reinterpret_cast<const int8_t*>(kZeroRow);
          __m512i w[G];
          for (int j = 0; j < G; ++j) {
            int32_t bits;
            std::memcpy(&bits, w16[j] + u, sizeof(bits));  // (w[u], w[u + 1])
            w[j] = _mm512_set1_epi32(bits);
          }
          for (int c = 0; c < NV / 2; ++c) {
            const __m512i a = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a_row + 32 * c)));
            const __m512i z = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b_row + 32 * c)));
            const __m512i lo = _mm512_unpacklo_epi16(a, z), hi = _mm512_unpackhi_epi16(a, z);
            for (int j = 0; j < G; ++j) {
              acc[j][2 * c] = add_dot_i16(acc[j][2 * c], lo, w[j]);
              acc[j][2 * c + 1] = add_dot_i16(acc[j][2 * c + 1], hi, w[j]);
            }
          }
        }
        float* ak = accs + kh * G * head_dim;
        for (int j = 0; j < G; ++j)
          for (int v = 0; v < NV; ++v) {
            float* a = ak + j * head_dim + v * 16;
            _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[j][v]), _mm512_set1_ps(w_scale[j]), _mm512_loadu_ps(a)));
          }
      }
    }
  });
  unpermute_pair_sums(accs, G * kv_heads * head_dim);
}

#if defined(__AVX512BF16__)
// bf16 values: the weights are rounded to bf16 (relative error 2^-9 each, as the prefill kernel and
// flash attention do; the normalizer stays the fp32 sum) and two keys go per dot product: their value
// rows interleaved by unpacklo/hi_epi16 into (V[u][d], V[u+1][d]) pairs against the broadcast pair of
// their weights, 32 products per instruction into fp32 sums. A key's work is ~12 instructions instead
// of ~30 (value widening, G broadcasts, G * NV fused multiply-adds); the sums are put back in
// order once, at the end (unpermute_pair_sums). Rows go four at a time, every head for them before
// the next four, as the fp32 path reads them (a head's whole block at a time, with its share of the
// prefetches in one burst, was slower from DRAM: 16.6-18.7 against 13.8-16.6 ms in alternating runs).
template <int G, int NV>
void weighted_values(float* accs, const float* sc, int64_t span, const c10::BFloat16* v_cache, const int64_t* table,
                     int64_t b_lo, int64_t b_hi, int64_t len, int64_t block_size, int64_t kv_heads) {
  constexpr int64_t head_dim = NV * 16;
  const int64_t heads = G * kv_heads, kv_row = kv_heads * head_dim;
  // [head][span + 1]: a key without a partner (odd tail of a block) reads the next weight, or this
  // zero, against a zero value row.
  const int64_t wstride = span + 1;
  thread_local std::vector<uint16_t> weights;
  weights.resize(heads * wstride);
  for (int64_t r = 0; r < heads; ++r) {
    for (int64_t t = 0; t < span; t += 16) {
      const __mmask16 m = tail_mask(span - t);
      _mm256_mask_storeu_epi16(weights.data() + r * wstride + t, m, to_bf16_bits(_mm512_maskz_loadu_ps(m, sc + r * span + t)));
    }
    weights[r * wstride + span] = 0;
  }
  for_each_block(v_cache, table, b_lo, b_hi, len, block_size, kv_row,
                 [&](const c10::BFloat16* vb, const c10::BFloat16* ahead, int64_t n, int64_t t0) {
    for (int64_t t = 0; t < n; t += 4) {
      if (ahead != nullptr) prefetch_rows(ahead + t * kv_row, std::min<int64_t>(4, block_size - t), kv_row, kv_row);
      for (int64_t kh = 0; kh < kv_heads; ++kh) {
        float* ak = accs + kh * G * head_dim;
        const uint16_t* wk = weights.data() + kh * G * wstride + t0;
        __m512 acc[G][NV];
        for (int j = 0; j < G; ++j)
          for (int v = 0; v < NV; ++v) acc[j][v] = _mm512_loadu_ps(ak + j * head_dim + v * 16);
        for (int64_t u = t; u < std::min<int64_t>(t + 4, n); u += 2) {
          const c10::BFloat16* v0 = vb + u * kv_row + kh * head_dim;
          const c10::BFloat16* v1 = u + 1 < n ? v0 + kv_row : reinterpret_cast<const c10::BFloat16*>(kZeroRow);
          __m512i w[G];
          for (int j = 0; j < G; ++j) {
            uint32_t bits;
            std::memcpy(&bits, wk + j * wstride + u, sizeof(bits));  // (w[u], w[u + 1])
            w[j] = _mm512_set1_epi32(static_cast<int32_t>(bits));
          }
          for (int c = 0; c < NV / 2; ++c) {
            const __m512i a = _mm512_loadu_si512(v0 + 32 * c);
            const __m512i z = _mm512_loadu_si512(v1 + 32 * c);
            const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, z), hi = (__m512bh)_mm512_unpackhi_epi16(a, z);
            for (int j = 0; j < G; ++j) {
              acc[j][2 * c] = _mm512_dpbf16_ps(acc[j][2 * c], lo, (__m512bh)w[j]);
              acc[j][2 * c + 1] = _mm512_dpbf16_ps(acc[j][2 * c + 1], hi, (__m512bh)w[j]);
            }
          }
        }
        for (int j = 0; j < G; ++j)
          for (int v = 0; v < NV; ++v) _mm512_storeu_ps(ak + j * head_dim + v * 16, acc[j][v]);
      }
    }
  });
  unpermute_pair_sums(accs, heads * head_dim);
}
#endif

// G query heads share a KV head; NV = head_dim / 16 vectors per row. Both are compile-time so the
// query and accumulator vectors (G * NV zmm) stay in registers. A work item is one part of a
// sequence's keys for all its heads: each block's rows are read whole and in address order (25%
// faster than one head per item at 8 and 32 sequences). Sequence s's keys are split into
// first_item[s + 1] - first_item[s] runs of blocks (flash-decoding, so that one long sequence keeps
// every thread busy): each part writes its unnormalized sums with its max and normalizer, and a second
// pass merges the parts in order. The split depends on the sequence's own length only, never on the
// batch or the thread count, so a sequence's output is bit-identical whatever else is decoded with it
// (seeded sampling must not depend on the batch).
// C: the cache's element type, T or int8_t (rows with scales: the item's queries are quantized to int16
// once, key scales multiply the scores, value scales the softmax weights).
template <typename T, typename C, int G, int NV>
void decode_attention_impl(T* out, const T* q, const C* k_cache, const C* v_cache, const int64_t* block_tables,
                           int64_t max_blocks, const int64_t* seq_lens, int64_t num_seqs, int64_t kv_heads,
                           const int64_t* first_item, int64_t block_size, float scale) {
  constexpr bool kInt8 = std::is_same_v<C, int8_t>;
  constexpr int64_t head_dim = NV * 16;
  constexpr int64_t head_row = cache_row_len<C>(head_dim);
  const int64_t heads = G * kv_heads, kv_row = kv_heads * head_row;
  // Per (item, head): head_dim sums, then max and normalizer (read only for split sequences).
  const int64_t partial_row = head_dim + 2, num_items = first_item[num_seqs];
  std::vector<int64_t> item_seq(num_items);
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t item = first_item[s]; item < first_item[s + 1]; ++item) item_seq[item] = s;
  std::vector<float> partials(num_items > num_seqs ? num_items * heads * partial_row : 0);
  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, accs(heads * head_dim), q_scales(kInt8 ? heads : 0), row_max(heads), row_sum(heads);
    std::vector<int32_t> q_pairs(kInt8 ? heads * head_dim / 2 : 0);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item_seq[item], part = item - first_item[s], parts = first_item[s + 1] - first_item[s];
      const int64_t len = seq_lens[s];
      const int64_t* table = block_tables + s * max_blocks;
      const int64_t seq_blocks = (len + block_size - 1) / block_size;
      const int64_t b_lo = seq_blocks * part / parts, b_hi = seq_blocks * (part + 1) / parts;
      const int64_t t_lo = b_lo * block_size, span = std::min(len, b_hi * block_size) - t_lo;  // keys of this part
      const T* qs = q + s * heads * head_dim;
      if constexpr (kInt8) prepare_query_int16(q_pairs.data(), q_scales.data(), qs, heads, head_dim);
      scores.resize(heads * std::max<int64_t>(span, 1));
      std::fill(accs.begin(), accs.end(), 0.f);
      float* sc = scores.data();  // [head][span]
      // Scores, 16 tokens at a time and every head for those tokens before the next 16, so the rows
      // are read in address order; the same rows of the block kAheadBlocks on are prefetched as we go.
      for_each_block(k_cache, table, b_lo, b_hi, len, block_size, kv_row, [&](const C* kb, const C* ahead, int64_t n, int64_t t0) {
        for (int64_t t = 0; t < n; t += 16) {
          const int64_t nt = std::min<int64_t>(16, n - t);
          const int64_t ahead_rows = std::min<int64_t>(16, block_size - t);
          for (int64_t kh = 0; kh < kv_heads; ++kh) {
            prefetch_share(ahead, t, ahead_rows, kh, kv_heads, kv_row);
            const C* k16 = kb + t * kv_row + kh * head_row;
            __m512 dot[G];
            __m512 key_scales = _mm512_set1_ps(scale);  // per score: scale, times the key row's for int8
            if constexpr (kInt8) {
              key_scores<G, NV>(dot, q_pairs.data() + kh * G * head_dim / 2, k16, kv_row, nt);
              key_scales = _mm512_mul_ps(key_scales, row_scales16(k16, kv_row, nt, head_dim));
            } else {
              key_scores<G, NV>(dot, qs + kh * G * head_dim, k16, kv_row, nt);
            }
            float* sk = sc + kh * G * span + t0 + t;
            for (int j = 0; j < G; ++j) {
              __m512 sj = _mm512_mul_ps(dot[j], key_scales);
              if constexpr (kInt8) sj = _mm512_mul_ps(sj, _mm512_set1_ps(q_scales[kh * G + j]));
              _mm512_mask_storeu_ps(sk + j * span, tail_mask(nt), sj);
            }
          }
        }
      });
      std::fill(row_max.begin(), row_max.end(), -INFINITY);
      std::fill(row_sum.begin(), row_sum.end(), 0.f);
      for (int64_t r = 0; r < heads && span > 0; ++r) {
        float* sr = sc + r * span;
        row_max[r] = max_of(sr, span);
        row_sum[r] = exp_shifted_sum(sr, span, row_max[r]);
      }
      weighted_values<G, NV>(accs.data(), sc, span, v_cache, table, b_lo, b_hi, len, block_size, kv_heads);
      if (parts == 1) {
        T* os = out + s * heads * head_dim;
        for (int64_t r = 0; r < heads; ++r)
          for (int v = 0; v < NV; ++v)
            store16(os + r * head_dim + v * 16,
                    _mm512_mul_ps(_mm512_loadu_ps(accs.data() + r * head_dim + v * 16), _mm512_set1_ps(1.f / row_sum[r])));
      } else {
        float* pr = partials.data() + item * heads * partial_row;
        for (int64_t r = 0; r < heads; ++r) {
          std::memcpy(pr + r * partial_row, accs.data() + r * head_dim, head_dim * sizeof(float));
          pr[r * partial_row + head_dim] = row_max[r];
          pr[r * partial_row + head_dim + 1] = row_sum[r];
        }
      }
    }
  });
  std::vector<int64_t> split;  // sequences of more than one part
  for (int64_t s = 0; s < num_seqs; ++s)
    if (first_item[s + 1] - first_item[s] > 1) split.push_back(s);
  // Merge: out = sum_p e^(m_p - M) acc_p / sum_p e^(m_p - M) l_p, M the largest part max (an empty
  // part has max -inf and weighs nothing).
  at::parallel_for(0, static_cast<int64_t>(split.size()) * heads, 16, [&](int64_t begin, int64_t end) {
    for (int64_t sr = begin; sr < end; ++sr) {
      const int64_t s = split[sr / heads], r = sr % heads, parts = first_item[s + 1] - first_item[s];
      const float* first = partials.data() + (first_item[s] * heads + r) * partial_row;
      const int64_t stride = heads * partial_row;  // next part, same head
      float m = -INFINITY, l = 0.f;
      for (int64_t p = 0; p < parts; ++p) m = std::max(m, first[p * stride + head_dim]);
      __m512 acc[NV];
      for (int v = 0; v < NV; ++v) acc[v] = _mm512_setzero_ps();
      for (int64_t p = 0; p < parts; ++p) {
        const float* pp = first + p * stride;
        const float w = std::exp(pp[head_dim] - m);
        l += w * pp[head_dim + 1];
        for (int v = 0; v < NV; ++v) acc[v] = _mm512_fmadd_ps(_mm512_set1_ps(w), _mm512_loadu_ps(pp + v * 16), acc[v]);
      }
      T* os = out + s * heads * head_dim + r * head_dim;
      for (int v = 0; v < NV; ++v) store16(os + v * 16, _mm512_mul_ps(acc[v], _mm512_set1_ps(1.f / l)));
    }
  });
}

template <typename T, typename C, int NV>
void decode_attention_group(int64_t group, T* out, const T* q, const C* k, const C* v, const int64_t* bt, int64_t mb,
                            const int64_t* lens, int64_t ns, int64_t kvh, const int64_t* per, int64_t bs, float scale) {
  switch (group) {
    case 1: return decode_attention_impl<T, C, 1, NV>(out, q, k, v, bt, mb, lens, ns, kvh, per, bs, scale);
    case 2: return decode_attention_impl<T, C, 2, NV>(out, q, k, v, bt, mb, lens, ns, kvh, per, bs, scale);
    case 3: return decode_attention_impl<T, C, 3, NV>(out, q, k, v, bt, mb, lens, ns, kvh, per, bs, scale);
    case 4: return decode_attention_impl<T, C, 4, NV>(out, q, k, v, bt, mb, lens, ns, kvh, per, bs, scale);
    case 5: return decode_attention_impl<T, C, 5, NV>(out, q, k, v, bt, mb, lens, ns, kvh, per, bs, scale);
    case 6: return decode_attention_impl<T, C, 6, NV>(out, q, k, v, bt, mb, lens, ns, kvh, per, bs, scale);
    case 7: return decode_attention_impl<T, C, 7, NV>(out, q, k, v, bt, mb, lens, ns, kvh, per, bs, scale);
    case 8: return decode_attention_impl<T, C, 8, NV>(out, q, k, v, bt, mb, lens, ns, kvh, per, bs, scale);
  }
  TORCH_CHECK(false, "decode_attention supports 1..8 query heads per KV head, got ", group);
}

template <typename T, typename C>
void decode_attention_dispatch(int64_t head_dim, int64_t group, T* out, const T* q, const C* k, const C* v,
                               const int64_t* bt, int64_t mb, const int64_t* lens, int64_t ns, int64_t kvh, const int64_t* per,
                               int64_t bs, float scale) {
  switch (head_dim) {
    case 64: return decode_attention_group<T, C, 4>(group, out, q, k, v, bt, mb, lens, ns, kvh, per, bs, scale);
    case 128: return decode_attention_group<T, C, 8>(group, out, q, k, v, bt, mb, lens, ns, kvh, per, bs, scale);
  }
  TORCH_CHECK(false, "decode_attention supports head_dim 64 or 128, got ", head_dim);
}

bool attention_supports(int64_t heads, int64_t kv_heads, int64_t head_dim) {
  return kv_heads > 0 && heads % kv_heads == 0 && heads / kv_heads <= 8 && (head_dim == 64 || head_dim == 128);
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t heads, double scale) {
  for (auto* t : {&q, &k_cache, &v_cache, &block_tables, &seq_lens}) check_cpu_contiguous(*t, "decode_attention input");
  TORCH_CHECK(k_cache.dim() == 4, "caches must be [blocks, block_size, kv_heads, head_dim (+ 4 for int8)]");
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t head_dim = k_cache.size(3) - (k_cache.scalar_type() == at::kChar ? kScaleBytes : 0);
  const int64_t num_seqs = seq_lens.numel();
  TORCH_CHECK(attention_supports(heads, kv_heads, head_dim), "decode_attention: unsupported shape: ", heads,
              " heads, ", kv_heads, " KV heads, head_dim ", head_dim);
  TORCH_CHECK(q.dim() == 2 && q.size(0) == num_seqs && q.size(1) == heads * head_dim, "q must be [num_seqs, heads * head_dim]");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "block_tables and seq_lens must be int64");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs, "block_tables must be [num_seqs, max_blocks]");
  const bool int8 = check_cache(k_cache, v_cache, q.scalar_type(), kv_heads, head_dim, "decode_attention");
  check_block_tables(block_tables, seq_lens, block_size, k_cache.size(0));
  at::Tensor out = at::empty_like(q);
  const float sc = static_cast<float>(scale);
  // A sequence's keys go in parts of at most kPartTokens (rounded to whole blocks): one long sequence
  // alone still fills both threads, and shorter parts would cost more to merge than they save.
  constexpr int64_t kPartTokens = 256;
  const int64_t part_blocks = std::max<int64_t>(1, kPartTokens / block_size);
  std::vector<int64_t> first_item(num_seqs + 1, 0);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t seq_blocks = (seq_lens.data_ptr<int64_t>()[s] + block_size - 1) / block_size;
    first_item[s + 1] = first_item[s] + std::max<int64_t>(1, (seq_blocks + part_blocks - 1) / part_blocks);
  }
  LLMSERVE_DISPATCH(q.scalar_type(), "decode_attention", [&] {
    auto run = [&](auto* k, auto* v) {
      decode_attention_dispatch(head_dim, heads / kv_heads, out.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), k, v,
                                block_tables.data_ptr<int64_t>(), block_tables.size(1), seq_lens.data_ptr<int64_t>(),
                                num_seqs, kv_heads, first_item.data(), block_size, sc);
    };
    if (int8) run(k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>());
    else run(k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>());
  });
  return out;
}

// ---- Causal attention of prefill chunks over the paged cache -----------------------------------------
// Sequence s has q_len = query_start[s+1] - query_start[s] new tokens, the last q_len of its seq_lens[s]
// (their K/V already written). Work item = (sequence, KV head, tile of kTile query tokens); its rows
// are the tile's tokens x the KV head's query heads, so each key block is converted once for all of
// them. The rows go 16 at a time, one per vector lane (a pass), against 16 keys at a time (one cache
// block when block_size is 16): a key's scores for the pass are a run of broadcast multiply-adds into
// one vector, and the online softmax (running max and sum per row) is then lane-wise arithmetic across
// the 16 key vectors: no horizontal reductions, no branches, one exp for a pass's rescaling. Blocks
// past a pass's last position are never read: the causal half of the work is skipped, not masked.
//
// Two layouts (KeyBlock): fp32 products for any T, and for bf16 with AVX512-BF16, pairs (queries as
// [D/2][16 rows][2 dims], V as [8][D][2 keys]) for bf16 dot products, 32 per instruction: the scores
// are exact products summed in fp32; the softmax weights are rounded to bf16 for P.V (relative error
// 2^-9 per weight, as flash attention does on GPUs; the sums and the normalizer stay fp32). Measured on
// this host, SmolLM2 shapes, 2,048 new tokens in five prompts x 30 layers (`python -m
// loadtests.bench_kernels`): 430 ms as first written (fp32 products, a row per pass, every row rescaled
// every block); 215-250 ms with bf16 pairs, a row per pass, rows rescaled only when their max grows
// (about 30% of the two cores' 464 GFLOP/s bf16 peak: each row's max, exp and sum were horizontal
// and latency-bound); 125-155 ms with rows in lanes (210-260 GFLOP/s; on an int8 cache 130-165 ms,
// was 230-265). Of the 125, scores and P.V take ~95 ms, about what their dot products need at one per
// cycle, and the 17 exps of a pass ~30 ms.

constexpr int64_t kKeys = 16, kLanes = 16;

// Slot of position pos in a sequence's block table.
inline int64_t slot_of(const int64_t* table, int64_t pos, int64_t block_size) {
  return table[pos / block_size] * block_size + pos % block_size;
}

template <typename T, int NV>
struct KeyBlock {
  static constexpr int64_t D = NV * 16;
  using QType = float;                      // a pass's queries: [D][16 rows]
  static constexpr int64_t kQUnits = D;     // QType values per row
  alignas(64) float kf[kKeys][D];
  alignas(64) float vf[kKeys][D];

  // Up to 16 query rows (nullptr: padding, zero) into lanes.
  static void load_queries(float* qt, const T* const* rows) {
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      __m512 r[kLanes];
      for (int64_t lane = 0; lane < kLanes; ++lane)
        r[lane] = rows[lane] != nullptr ? load16(rows[lane] + d0) : _mm512_setzero_ps();
      transpose16(r);
      for (int64_t j = 0; j < 16; ++j) _mm512_store_ps(qt + (d0 + j) * kLanes, r[j]);
    }
  }
  // The block's nk key and value rows; the rest of the 16 read as zero.
  void load(const T* const* k_rows, const T* const* v_rows, int64_t nk) {
    for (int64_t t = 0; t < kKeys; ++t)
      for (int v = 0; v < NV; ++v) {
        _mm512_store_ps(kf[t] + v * 16, t < nk ? load16(k_rows[t] + v * 16) : _mm512_setzero_ps());
        _mm512_store_ps(vf[t] + v * 16, t < nk ? load16(v_rows[t] + v * 16) : _mm512_setzero_ps());
      }
  }
  // s[k] = the pass's 16 rows . key k (16 independent chains share each query load).
  void scores(__m512 (&s)[kKeys], const float* qt) const {
    __m512 a[kKeys];  // local, so the compiler keeps it in registers (s is stored once, at the end)
    for (int64_t k = 0; k < kKeys; ++k) a[k] = _mm512_setzero_ps();
    for (int64_t i = 0; i < D; ++i) {
      const __m512 qi = _mm512_load_ps(qt + i * kLanes);
      for (int64_t k = 0; k < kKeys; ++k) a[k] = _mm512_fmadd_ps(qi, _mm512_set1_ps(kf[k][i]), a[k]);
    }
    for (int64_t k = 0; k < kKeys; ++k) s[k] = a[k];
  }
  // acc ([D][16 rows]) = acc * corr + sum over keys of p[k] * V[k], 16 dims at a time in registers.
  void add_pv(float* acc, const __m512 (&p)[kKeys], __m512 corr) const {
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      __m512 a[16];
      for (int j = 0; j < 16; ++j) a[j] = _mm512_mul_ps(_mm512_load_ps(acc + (d0 + j) * kLanes), corr);
      for (int64_t k = 0; k < kKeys; ++k)
        for (int j = 0; j < 16; ++j) a[j] = _mm512_fmadd_ps(p[k], _mm512_set1_ps(vf[k][d0 + j]), a[j]);
      for (int j = 0; j < 16; ++j) _mm512_store_ps(acc + (d0 + j) * kLanes, a[j]);
    }
  }
};

#if defined(__AVX512BF16__)
template <int NV>
struct KeyBlock<c10::BFloat16, NV> {
  static constexpr int64_t D = NV * 16;
  using QType = uint32_t;                   // a pass's queries: [D/2][16 rows] bf16 pairs (q[2i], q[2i+1])
  static constexpr int64_t kQUnits = D / 2;
  alignas(64) uint32_t kp[kKeys][D / 2];    // K rows as bf16 pairs
  alignas(64) uint32_t vp[kKeys / 2][D];    // [key pair][dim]: bf16 (V[2t][d], V[2t+1][d])

  static void load_queries(uint32_t* qt, const c10::BFloat16* const* rows) {
    for (int64_t i0 = 0; i0 < D / 2; i0 += 16) {  // 16 pairs of each row at a time, moved as fp32 bits
      __m512 r[kLanes];
      for (int64_t lane = 0; lane < kLanes; ++lane)
        r[lane] = rows[lane] != nullptr ? _mm512_loadu_ps(reinterpret_cast<const uint32_t*>(rows[lane]) + i0)
                                        : _mm512_setzero_ps();
      transpose16(r);
      for (int64_t j = 0; j < 16; ++j) _mm512_store_ps(reinterpret_cast<float*>(qt + (i0 + j) * kLanes), r[j]);
    }
  }
  void load(const c10::BFloat16* const* k_rows, const c10::BFloat16* const* v_rows, int64_t nk) {
    static const c10::BFloat16 zeros[D] = {};
    const c10::BFloat16* vr[kKeys];
    for (int64_t t = 0; t < kKeys; ++t) {
      std::memcpy(kp[t], t < nk ? k_rows[t] : zeros, D * sizeof(c10::BFloat16));
      vr[t] = t < nk ? v_rows[t] : zeros;
    }
    // Interleave value rows two by two: 16 dims of key 2t and of key 2t+1 -> 16 pairs.
    for (int64_t t = 0; t < kKeys / 2; ++t)
      for (int v = 0; v < NV; ++v) {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vr[2 * t] + v * 16));
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vr[2 * t + 1] + v * 16));
        const __m512i wa = _mm512_cvtepu16_epi32(a), wb = _mm512_cvtepu16_epi32(b);
        _mm512_store_si512(vp[t] + v * 16, _mm512_or_si512(wa, _mm512_slli_epi32(wb, 16)));
      }
  }
  void scores(__m512 (&s)[kKeys], const uint32_t* qt) const {
    __m512 a[kKeys];
    for (int64_t k = 0; k < kKeys; ++k) a[k] = _mm512_setzero_ps();
    for (int64_t i = 0; i < D / 2; ++i) {
      const __m512bh qi = (__m512bh)_mm512_load_si512(qt + i * kLanes);
      for (int64_t k = 0; k < kKeys; ++k) a[k] = _mm512_dpbf16_ps(a[k], qi, (__m512bh)_mm512_set1_epi32(kp[k][i]));
    }
    for (int64_t k = 0; k < kKeys; ++k) s[k] = a[k];
  }
  void add_pv(float* acc, const __m512 (&p)[kKeys], __m512 corr) const {
    __m512i pairs[kKeys / 2];  // lane r: bf16 (p[2t][r], p[2t+1][r])
    for (int64_t t = 0; t < kKeys / 2; ++t)
      pairs[t] = _mm512_or_si512(_mm512_cvtepu16_epi32(to_bf16_bits(p[2 * t])),
                                 _mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16_bits(p[2 * t + 1])), 16));
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      __m512 a[16];
      for (int j = 0; j < 16; ++j) a[j] = _mm512_mul_ps(_mm512_load_ps(acc + (d0 + j) * kLanes), corr);
      for (int64_t t = 0; t < kKeys / 2; ++t)
        for (int j = 0; j < 16; ++j)
          a[j] = _mm512_dpbf16_ps(a[j], (__m512bh)pairs[t], (__m512bh)_mm512_set1_epi32(vp[t][d0 + j]));
      for (int j = 0; j < 16; ++j) _mm512_store_ps(acc + (d0 + j) * kLanes, a[j]);
    }
  }
};
#endif

// C: the cache's element type, T or int8_t (each block's rows are dequantized to T as they are loaded:
// the attention is then the one over the dequantized cache that the torch reference computes).
template <typename T, typename C, int NV>
void prefill_attention_impl(T* out, const T* q, const C* k_cache, const C* v_cache, const int64_t* block_tables,
                            int64_t max_blocks, const int64_t* query_start, const int64_t* seq_lens, int64_t num_seqs,
                            int64_t heads, int64_t kv_heads, int64_t block_size, float scale) {
  using Block = KeyBlock<T, NV>;
  using Q = typename Block::QType;
  constexpr int64_t D = NV * 16, kTile = 32, head_row = cache_row_len<C>(D), kQPass = Block::kQUnits * kLanes;
  const int64_t group = heads / kv_heads, kv_row = kv_heads * head_row;
  const int64_t passes_max = (kTile * group + kLanes - 1) / kLanes;
  struct Item { int64_t seq, kh, tok0; };
  std::vector<Item> items;
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t t0 = 0; t0 < query_start[s + 1] - query_start[s]; t0 += kTile)
      for (int64_t kh = 0; kh < kv_heads; ++kh) items.push_back({s, kh, t0});
  const int64_t num_threads = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(items.size()));
  // Later tiles see more keys: threads take items round-robin so each gets a mix of costs.
  at::parallel_for(0, num_threads, 1, [&](int64_t tbegin, int64_t tend) {
    // Per pass: queries in lanes, the accumulators [D][16], each lane's position, max and sum.
    // Scratch from torch's CPU allocator, which aligns to 64 bytes: aligned vector loads, and none
    // straddles a cache line. Q is 4 bytes (fp32 or a bf16 pair).
    static_assert(sizeof(Q) == 4);
    const at::Tensor qt_buf = at::empty({passes_max * kQPass}, at::kInt);
    const at::Tensor acc_buf = at::empty({passes_max * D * kLanes}, at::kFloat);
    Q* qt = reinterpret_cast<Q*>(qt_buf.data_ptr<int32_t>());
    float* acc = acc_buf.data_ptr<float>();
    std::vector<float> row_max(passes_max * kLanes), row_sum(passes_max * kLanes);
    std::vector<int32_t> row_pos(passes_max * kLanes);
    std::vector<T> dequantized(std::is_same_v<C, int8_t> ? 2 * kKeys * D : 0);  // K rows, then V rows
    const T* k_rows[kKeys];
    const T* v_rows[kKeys];
    Block block;
    for (int64_t tid = tbegin; tid < tend; ++tid) {
      for (size_t it = tid; it < items.size(); it += num_threads) {
        const Item item = items[it];
        const int64_t s = item.seq, kh = item.kh, len = seq_lens[s];
        const int64_t q_len = query_start[s + 1] - query_start[s], first_pos = len - q_len;
        const int64_t ntok = std::min(kTile, q_len - item.tok0), rows = ntok * group;
        const int64_t passes = (rows + kLanes - 1) / kLanes, pos0 = first_pos + item.tok0;
        const int64_t* table = block_tables + s * max_blocks;
        // Row r = token r / group, head r % group of the KV head's group; padding lanes repeat the
        // last row's position (their results are never stored).
        for (int64_t pass = 0; pass < passes; ++pass) {
          const T* q_rows[kLanes];
          for (int64_t lane = 0; lane < kLanes; ++lane) {
            const int64_t r = pass * kLanes + lane, rc = std::min(r, rows - 1);
            q_rows[lane] = r < rows ? q + (query_start[s] + item.tok0 + r / group) * heads * D + (kh * group + r % group) * D
                                    : nullptr;
            row_pos[pass * kLanes + lane] = static_cast<int32_t>(pos0 + rc / group);
          }
          Block::load_queries(qt + pass * kQPass, q_rows);
        }
        std::fill(acc, acc + passes * D * kLanes, 0.f);
        std::fill(row_max.begin(), row_max.begin() + passes * kLanes, -INFINITY);
        std::fill(row_sum.begin(), row_sum.begin() + passes * kLanes, 0.f);
        const int64_t last_pos = pos0 + (rows - 1) / group;  // keys 0..last_pos are needed
        const __m512 vscale = _mm512_set1_ps(scale), neg_inf = _mm512_set1_ps(-INFINITY);
        for (int64_t k0 = 0; k0 <= last_pos; k0 += kKeys) {
          const int64_t nk = std::min(kKeys, last_pos + 1 - k0);
          for (int64_t t = 0; t < nk; ++t) {
            const int64_t row_at = slot_of(table, k0 + t, block_size) * kv_row + kh * head_row;
            if constexpr (std::is_same_v<C, int8_t>) {
              T* kd = dequantized.data() + t * D;
              T* vd = kd + kKeys * D;
              dequantize_row(kd, k_cache + row_at, D);
              dequantize_row(vd, v_cache + row_at, D);
              k_rows[t] = kd;
              v_rows[t] = vd;
            } else {
              k_rows[t] = k_cache + row_at;
              v_rows[t] = v_cache + row_at;
            }
          }
          block.load(k_rows, v_rows, nk);
          for (int64_t pass = 0; pass < passes; ++pass) {
            const int64_t last_row = std::min(rows, (pass + 1) * kLanes) - 1;
            if (pos0 + last_row / group < k0) continue;  // every row of the pass ends before the block
            const __m512i pos = _mm512_loadu_si512(row_pos.data() + pass * kLanes);
            __m512 sc[kKeys];
            block.scores(sc, qt + pass * kQPass);
            const __m512 old_max = _mm512_loadu_ps(row_max.data() + pass * kLanes);
            __m512 m = old_max;
            __mmask16 valid[kKeys];
            for (int64_t k = 0; k < kKeys; ++k) {  // key k0 + k counts for lanes at or after it
              valid[k] = k < nk ? _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(static_cast<int32_t>(k0 + k))) : 0;
              sc[k] = _mm512_mask_mul_ps(neg_inf, valid[k], sc[k], vscale);
              m = _mm512_max_ps(m, sc[k]);
            }
            // Every lane has seen key 0 by now, so m is finite; on the first block old_max is -inf and
            // corr ~0 multiplies zeros.
            const __m512 corr = exp16(_mm512_sub_ps(old_max, m));
            __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(row_sum.data() + pass * kLanes), corr);
            for (int64_t k = 0; k < kKeys; ++k) {
              sc[k] = _mm512_maskz_mov_ps(valid[k], exp16(_mm512_sub_ps(sc[k], m)));
              sum = _mm512_add_ps(sum, sc[k]);
            }
            _mm512_storeu_ps(row_max.data() + pass * kLanes, m);
            _mm512_storeu_ps(row_sum.data() + pass * kLanes, sum);
            block.add_pv(acc + pass * D * kLanes, sc, corr);
          }
        }
        for (int64_t pass = 0; pass < passes; ++pass) {  // normalized, then back from lanes to rows
          const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_loadu_ps(row_sum.data() + pass * kLanes));
          for (int64_t d0 = 0; d0 < D; d0 += 16) {
            __m512 r[kLanes];
            for (int64_t j = 0; j < 16; ++j) r[j] = _mm512_mul_ps(_mm512_load_ps(acc + (pass * D + d0 + j) * kLanes), inv);
            transpose16(r);
            for (int64_t lane = 0; lane < kLanes && pass * kLanes + lane < rows; ++lane) {
              const int64_t row = pass * kLanes + lane;
              store16(out + (query_start[s] + item.tok0 + row / group) * heads * D + (kh * group + row % group) * D + d0, r[lane]);
            }
          }
        }
      }
    }
  });
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& block_tables, const at::Tensor& query_start, const at::Tensor& seq_lens,
                             int64_t heads, double scale) {
  for (auto* t : {&q, &k_cache, &v_cache, &block_tables, &query_start, &seq_lens}) check_cpu_contiguous(*t, "prefill_attention input");
  TORCH_CHECK(k_cache.dim() == 4, "caches must be [blocks, block_size, kv_heads, head_dim (+ 4 for int8)]");
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t head_dim = k_cache.size(3) - (k_cache.scalar_type() == at::kChar ? kScaleBytes : 0);
  const int64_t num_seqs = seq_lens.numel();
  TORCH_CHECK(attention_supports(heads, kv_heads, head_dim), "prefill_attention: unsupported shape: ", heads,
              " heads, ", kv_heads, " KV heads, head_dim ", head_dim);
  for (auto* t : {&block_tables, &query_start, &seq_lens}) TORCH_CHECK(t->scalar_type() == at::kLong, "index tensors must be int64");
  TORCH_CHECK(query_start.numel() == num_seqs + 1 && block_tables.dim() == 2 && block_tables.size(0) == num_seqs,
              "query_start must be [num_seqs + 1] and block_tables [num_seqs, max_blocks]");
  TORCH_CHECK(q.dim() == 2 && q.size(1) == heads * head_dim, "q must be [tokens, heads * head_dim]");
  const bool int8 = check_cache(k_cache, v_cache, q.scalar_type(), kv_heads, head_dim, "prefill_attention");
  const int64_t* qs = query_start.data_ptr<int64_t>();
  TORCH_CHECK(num_seqs == 0 || (qs[0] == 0 && qs[num_seqs] == q.size(0)), "query_start must run from 0 to the number of q rows");
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = seq_lens.data_ptr<int64_t>()[s], q_len = qs[s + 1] - qs[s];
    TORCH_CHECK(q_len >= 1 && q_len <= len, "sequence ", s, ": ", q_len, " new tokens but length ", len);
  }
  check_block_tables(block_tables, seq_lens, block_size, k_cache.size(0));
  at::Tensor out = at::empty_like(q);
  const float sc = static_cast<float>(scale);
  LLMSERVE_DISPATCH(q.scalar_type(), "prefill_attention", [&] {
    auto run = [&](auto* k, auto* v) {
      using C = std::remove_pointer_t<decltype(k)>;
      auto fn = head_dim == 64 ? prefill_attention_impl<scalar_t, C, 4> : prefill_attention_impl<scalar_t, C, 8>;
      fn(out.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), k, v, block_tables.data_ptr<int64_t>(), block_tables.size(1),
         qs, seq_lens.data_ptr<int64_t>(), num_seqs, heads, kv_heads, block_size, sc);
    };
    if (int8) run(k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>());
    else run(k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>());
  });
  return out;
}

// ---- bf16 linear on a pair-interleaved weight: y = x W^T (+ b) -----------------------------------------
// W [N, K] is packed once (pack_linear_bf16) into panels of 48 output columns, [N/48][K/2][48] 32-bit
// pairs (W[n][2i], W[n][2i+1]), the layout AVX512-BF16 dot products want: one input pair x[m][2i..2i+1]
// broadcast against a panel row adds 32 exact products into 16 columns' fp32 sums per instruction, so
// the accumulators hold whole output columns (no horizontal sums) and a tile of up to kMR = 8 rows x
// 48 columns stays in 24 registers (8 rows: a decode batch of 8 reads each panel once). Threads take
// (panel, chunk of kMChunk rows) items; the first rows stream a panel from DRAM (54 KB at K = 576, the
// next one prefetched into L2 meanwhile) and the rest re-read it from L2.
//
// One layout serves every batch size, so a bf16 model holds one copy of each weight. Measured over
// SmolLM2's 30 layers of linears (`python -m loadtests.bench_kernels`), against oneDNN on its own
// pre-packed copy: 1 row 6.5-6.8 vs 10.5 ms (212 MB at ~32 GB/s), 8 rows 6.2-7.4 vs 11.0, 32 rows
// 17.5-18.2 vs 22.3-22.7, 2,048 rows (prefill) 992-1,243 vs 1,137-1,149 ms over three runs (level
// within this host's noise). 64-column panels with 6-row tiles took 9.2 ms at 8 rows.

bool has_avx512_bf16() {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

constexpr int64_t kPanel = 48, kNR = kPanel / 16, kMR = 8, kMChunk = 48;

void check_linear_bf16_ops() { TORCH_CHECK(has_avx512_bf16(), "the bf16 linear kernels need a CPU with AVX512-BF16"); }

// Rows of `units` 32-bit units (bf16 pairs or int8 quads) -> panels [ceil(n/48)][units][48]; columns past
// n stay 0.
at::Tensor pack_panels(const at::Tensor& w, int64_t units) {
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
void check_panels(const at::Tensor& packed, int64_t out_features, const at::Tensor& x, int64_t per_unit,
                  const char* kind) {
  check_cpu_contiguous(packed, "packed weight");
  TORCH_CHECK(packed.scalar_type() == at::kInt && packed.dim() == 3 && packed.size(2) == kPanel &&
                  packed.size(0) == (out_features + kPanel - 1) / kPanel,
              kind, ": the weight must come from pack_", kind, " for ", out_features, " out_features");
  TORCH_CHECK(x.size(1) == per_unit * packed.size(1), kind, ": x has ", x.size(1), " features, the weight ",
              per_unit * packed.size(1));
}

at::Tensor pack_linear_bf16(const at::Tensor& w) {
  check_linear_bf16_ops();
  check_cpu_contiguous(w, "weight");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.size(1) % 2 == 0,
              "pack_linear_bf16: weight must be bf16 [out_features, in_features] with even in_features");
  return pack_panels(w, w.size(1) / 2);
}

// Lanes of the 16 columns starting at c that exist (c < n).
inline __mmask16 column_mask(int64_t c, int64_t n) {
  return c >= n ? 0 : tail_mask(n - c);
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
#endif
  return y;
}

// ---- int8 linear (W8A8): y = sx[m] * sw[n] * (q_x q_W^T) (+ b) ---------------------------------------
// The weight is quantized once per output feature (sw = max|w| / 127, q in [-127, 127]; see
// shared/engine/models/int8_linear.py) and packed like the bf16 one, in quads: [N/48][K/4][48] 32-bit units
// of (q[n][4i..4i+3]). Each call quantizes its input rows the same way (sx = max|x| / 127, round half to
// even) and stores them offset by 128 as unsigned bytes, because AVX512-VNNI multiplies unsigned by
// signed bytes: one broadcast quad against a panel row adds 64 exact products into 16 columns' int32
// sums. The offset is taken back by starting each column's sum at -128 * sum_k q[n][k] (`colsum`).
// Sums are exact: int32 arithmetic wraps, and the final |sum| <= 127 * 127 * K fits for K < 133,000. Only
// the epilogue rounds (fp32, then the output dtype).

bool has_avx512_vnni() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

void check_linear_int8_ops() { TORCH_CHECK(has_avx512_vnni(), "the int8 linear kernels need a CPU with AVX512-VNNI"); }

at::Tensor pack_linear_int8(const at::Tensor& q) {
  check_linear_int8_ops();
  check_cpu_contiguous(q, "weight");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.size(1) % 4 == 0,
              "pack_linear_int8: weight must be int8 [out_features, in_features] with in_features a multiple of 4");
  return pack_panels(q, q.size(1) / 4);
}

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
// stack (measured 0.66x the bf16 linear instead of 1.8x).
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
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY(llmserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!)? residual=None) -> Tensor");
  m.def("rope_and_cache(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache, "
        "Tensor slot_mapping, int heads, int kv_heads, int head_dim) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("pack_linear_bf16(Tensor weight) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("has_avx512_bf16() -> bool", has_avx512_bf16);
  m.def("pack_linear_int8(Tensor weight) -> Tensor");
  m.def("linear_int8(Tensor x, Tensor packed, Tensor scale, Tensor colsum, Tensor? smooth, Tensor? bias) -> Tensor");
  m.def("has_avx512_vnni() -> bool", has_avx512_vnni);
  m.def("attention_supports(int heads, int kv_heads, int head_dim) -> bool", attention_supports);
  m.def("prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor query_start, Tensor seq_lens, int heads, float scale) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, int heads, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmserve_cpu, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("rope_and_cache", rope_and_cache);
  m.impl("silu_mul", silu_mul);
  m.impl("argmax_rows", argmax_rows);
  m.impl("pack_linear_bf16", pack_linear_bf16);
  m.impl("linear_bf16", linear_bf16);
  m.impl("pack_linear_int8", pack_linear_int8);
  m.impl("linear_int8", linear_int8);
  m.impl("decode_attention", decode_attention);
  m.impl("prefill_attention", prefill_attention);
}
