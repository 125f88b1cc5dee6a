// Causal attention of prefill chunks over the paged KV cache.

#include "common.h"
#include "ops.h"

namespace llmserve {
namespace {

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
// Two layouts (KeyBlock): fp32 products for any T (bf16 widened to fp32 as the block is loaded), and
// for bf16 with AVX512-BF16, pairs (queries as [D/2][16 rows][2 dims], V as [8][D][2 keys]) for bf16
// dot products, 32 per instruction: the scores are exact products summed in fp32; the softmax weights
// are rounded to bf16 for P.V (relative error 2^-9 per weight, as flash attention does on GPUs; the
// sums and the normalizer stay fp32). Without AVX512-BF16 (AVX2, plain AVX-512) bf16 takes the fp32
// layout: the weights stay fp32.

constexpr int64_t kKeys = 16, kLanes = 16;

// Register blocking of the fp32-product KeyBlock's two loops (scores: keys at a time; P.V: dims at a
// time), sized to the register file so that the sums stay in registers. AVX-512 (32 zmm): all 16 keys'
// sums in 16 registers; P.V 16 dims' sums beside the 16 weight vectors. AVX2 (16 ymm, a vf being two):
// 6 keys (12 ymm of sums, the query's two halves, a broadcast key element: 8 loads per 12 multiply-
// adds), then the rest; P.V 6 dims (12 ymm of sums, a weight vector's two halves, a broadcast value),
// then the rest. Twice as many sums would not fit: they would go to the stack and back every step.
#if LLMSERVE_VEC_AVX512
constexpr int64_t kScoreKeys = 16, kPvDims = 16;
#else
constexpr int64_t kScoreKeys = 6, kPvDims = 6;
#endif

// Keeps a weight vector in registers for the P.V multiply-adds that share it. Under AVX2 GCC otherwise
// reads it again from the stack as a memory operand of each multiply-add (three loads per two
// multiply-adds instead of two per three); with 32 zmm it is in registers anyway.
#if LLMSERVE_VEC_AVX512
LLMSERVE_INLINE void in_registers(vf&) {}
#else
LLMSERVE_INLINE void in_registers(vf& v) { asm("" : "+x"(v.lo), "+x"(v.hi)); }
#endif

// Slot of position pos in a sequence's block table.
inline int64_t slot_of(const int64_t* table, int64_t pos, int64_t block_size) {
  return table[pos / block_size] * block_size + pos % block_size;
}

template <typename T, int NV>
struct KeyBlock {
  static constexpr int64_t D = NV * 16;
  using QType = float;                      // a pass's queries: [D][16 rows]
  static constexpr int64_t kQUnits = D;     // QType values per row
  alignas(64) float k32[kKeys][D];  // K rows as fp32
  alignas(64) float v32[kKeys][D];  // V rows as fp32

  // Up to 16 query rows (nullptr: padding, zero) into lanes.
  static void load_queries(float* qt, const T* const* rows) {
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      vf r[kLanes];
      for (int64_t lane = 0; lane < kLanes; ++lane) r[lane] = rows[lane] != nullptr ? load16(rows[lane] + d0) : zero();
      transpose16(r);
      for (int64_t j = 0; j < 16; ++j) store(qt + (d0 + j) * kLanes, r[j]);
    }
  }
  // The block's nk key and value rows as fp32; the rest of the 16 read as zero.
  void load(const T* const* k_rows, const T* const* v_rows, int64_t nk) {
    for (int64_t t = 0; t < kKeys; ++t)
      for (int v = 0; v < NV; ++v) {
        store(k32[t] + v * 16, t < nk ? load16(k_rows[t] + v * 16) : zero());
        store(v32[t] + v * 16, t < nk ? load16(v_rows[t] + v * 16) : zero());
      }
  }
  // s[k] = the pass's 16 rows . key k for keys k0 .. k0 + N - 1: N sums in registers (independent
  // chains sharing each query load), stored once at the end.
  template <int64_t N>
  void score_keys(vf* s, const float* qt, int64_t k0) const {
    vf a[N];
    for (int64_t k = 0; k < N; ++k) a[k] = zero();
    for (int64_t i = 0; i < D; ++i) {
      const vf qi = vec::load(qt + i * kLanes);
      for (int64_t k = 0; k < N; ++k) a[k] = fmadd(qi, set1(k32[k0 + k][i]), a[k]);
    }
    for (int64_t k = 0; k < N; ++k) s[k0 + k] = a[k];
  }
  void scores(vf (&s)[kKeys], const float* qt) const {
    constexpr int64_t whole = kKeys / kScoreKeys * kScoreKeys;
    for (int64_t k0 = 0; k0 < whole; k0 += kScoreKeys) score_keys<kScoreKeys>(s, qt, k0);
    if constexpr (whole < kKeys) score_keys<kKeys - whole>(s, qt, whole);
  }
  // acc[d] ([16 rows]) = acc[d] * corr + sum over keys of p[k] * V[k][d] for dims d0 .. d0 + N - 1,
  // their sums in registers.
  template <int64_t N>
  void pv_dims(float* acc, const vf (&p)[kKeys], vf corr, int64_t d0) const {
    vf a[N];
    for (int64_t j = 0; j < N; ++j) a[j] = mul(vec::load(acc + (d0 + j) * kLanes), corr);
    for (int64_t k = 0; k < kKeys; ++k) {
      vf pk = p[k];
      in_registers(pk);
      for (int64_t j = 0; j < N; ++j) a[j] = fmadd(pk, set1(v32[k][d0 + j]), a[j]);
    }
    for (int64_t j = 0; j < N; ++j) store(acc + (d0 + j) * kLanes, a[j]);
  }
  // acc ([D][16 rows]) = acc * corr + sum over keys of p[k] * V[k].
  void add_pv(float* acc, const vf (&p)[kKeys], vf corr) const {
    constexpr int64_t whole = D / kPvDims * kPvDims;
    for (int64_t d0 = 0; d0 < whole; d0 += kPvDims) pv_dims<kPvDims>(acc, p, corr, d0);
    if constexpr (whole < D) pv_dims<D - whole>(acc, p, corr, whole);
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

// C: the cache's element type, T, int8_t or Fp8 (each block's rows are dequantized to T as they are loaded:
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
  struct Item { int64_t seq, kh, tok0, cost; };
  std::vector<Item> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = query_start[s + 1] - query_start[s], first_pos = seq_lens[s] - q_len;
    for (int64_t t0 = 0; t0 < q_len; t0 += kTile) {
      // Query rows x keys the tile reads (up to its last position): the item's work.
      const int64_t ntok = std::min(kTile, q_len - t0), cost = ntok * (first_pos + t0 + ntok);
      for (int64_t kh = 0; kh < kv_heads; ++kh) items.push_back({s, kh, t0, cost});
    }
  }
  // Costliest first, each thread claiming the next item when it is done with one (parallel_claim;
  // longest processing time first): the threads end together even when items differ a lot (a chunk
  // deep in a long prompt beside a short prompt).
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t num_items = static_cast<int64_t>(items.size());
  parallel_claim(num_items, [&](ItemCounter& claims) {
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
    std::vector<T> dequantized(kScaledRows<C> ? 2 * kKeys * D : 0);  // K rows, then V rows
    const T* k_rows[kKeys];
    const T* v_rows[kKeys];
    Block block;
    for (int64_t it = claims.claim(); it < num_items; it = claims.after(it)) {
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
      const vf vscale = set1(scale), neg_inf = set1(-INFINITY);
      for (int64_t k0 = 0; k0 <= last_pos; k0 += kKeys) {
        const int64_t nk = std::min(kKeys, last_pos + 1 - k0);
        for (int64_t t = 0; t < nk; ++t) {
          const int64_t row_at = slot_of(table, k0 + t, block_size) * kv_row + kh * head_row;
          if constexpr (kScaledRows<C>) {
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
          const vi pos = loadu_i32(row_pos.data() + pass * kLanes);
          vf sc[kKeys];
          block.scores(sc, qt + pass * kQPass);
          const vf old_max = loadu(row_max.data() + pass * kLanes);
          vf m = old_max;
          vm valid[kKeys];
          for (int64_t k = 0; k < kKeys; ++k) {  // key k0 + k counts for lanes at or after it
            valid[k] = k < nk ? greater_equal_i32(pos, set1_i32(static_cast<int32_t>(k0 + k))) : no_lanes();
            sc[k] = where(valid[k], mul(sc[k], vscale), neg_inf);
            m = max(m, sc[k]);
          }
          // Every lane has seen key 0 by now, so m is finite; on the first block old_max is -inf and
          // corr ~0 multiplies zeros.
          const vf corr = exp16(sub(old_max, m));
          vf sum = mul(loadu(row_sum.data() + pass * kLanes), corr);
          for (int64_t k = 0; k < kKeys; ++k) {
            sc[k] = maskz(valid[k], exp16(sub(sc[k], m)));
            sum = add(sum, sc[k]);
          }
          storeu(row_max.data() + pass * kLanes, m);
          storeu(row_sum.data() + pass * kLanes, sum);
          block.add_pv(acc + pass * D * kLanes, sc, corr);
        }
      }
      for (int64_t pass = 0; pass < passes; ++pass) {  // normalized, then back from lanes to rows
        const vf inv = div(set1(1.f), loadu(row_sum.data() + pass * kLanes));
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
          vf r[kLanes];
          for (int64_t j = 0; j < 16; ++j) r[j] = mul(load(acc + (pass * D + d0 + j) * kLanes), inv);
          transpose16(r);
          for (int64_t lane = 0; lane < kLanes && pass * kLanes + lane < rows; ++lane) {
            const int64_t row = pass * kLanes + lane;
            store16(out + (query_start[s] + item.tok0 + row / group) * heads * D + (kh * group + row % group) * D + d0, r[lane]);
          }
        }
      }
    }
  });
}

}  // namespace

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& block_tables, const at::Tensor& query_start, const at::Tensor& seq_lens,
                             int64_t heads, double scale) {
  for (auto* t : {&q, &k_cache, &v_cache, &block_tables, &query_start, &seq_lens}) check_cpu_contiguous(*t, "prefill_attention input");
  TORCH_CHECK(k_cache.dim() == 4, "caches must be [blocks, block_size, kv_heads, head_dim (+ 4 for int8/fp8)]");
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t head_dim = cache_head_dim(k_cache);
  const int64_t num_seqs = seq_lens.numel();
  TORCH_CHECK(attention_supports(heads, kv_heads, head_dim), "prefill_attention: unsupported shape: ", heads,
              " heads, ", kv_heads, " KV heads, head_dim ", head_dim);
  for (auto* t : {&block_tables, &query_start, &seq_lens}) TORCH_CHECK(t->scalar_type() == at::kLong, "index tensors must be int64");
  TORCH_CHECK(query_start.numel() == num_seqs + 1 && block_tables.dim() == 2 && block_tables.size(0) == num_seqs,
              "query_start must be [num_seqs + 1] and block_tables [num_seqs, max_blocks]");
  TORCH_CHECK(q.dim() == 2 && q.size(1) == heads * head_dim, "q must be [tokens, heads * head_dim]");
  const CacheKind kind = check_cache(k_cache, v_cache, q.scalar_type(), kv_heads, head_dim, "prefill_attention");
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
    if (kind == CacheKind::kInt8) run(k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>());
    else if (kind == CacheKind::kFp8)
      run(reinterpret_cast<Fp8*>(k_cache.data_ptr<uint8_t>()), reinterpret_cast<Fp8*>(v_cache.data_ptr<uint8_t>()));
    else run(k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>());
  });
  return out;
}

std::vector<std::string> prefill_attention_paths() {
  const std::string fma = std::string("FMA, ") + kVectorName;
  return {
#if defined(__AVX512BF16__)
      "prefill_attention bf16: AVX512-BF16 pair dot products (vdpbf16ps), softmax weights rounded to bf16 for P.V",
#else
      "prefill_attention bf16: widened to fp32, " + fma,
#endif
      "prefill_attention fp32: " + fma,
      "prefill_attention int8 cache: rows dequantized to the model dtype per block of 16 keys",
      "prefill_attention fp8 cache: rows dequantized (e4m3 through F16C) to the model dtype per block of 16 keys"};
}

}  // namespace llmserve
