// Decode attention over the paged KV cache: one query token per sequence. Each KV head's group of
// query heads scores every cached key of the sequence, read block by block in place (fp32 sums),
// softmax, then the weighted sum of values. The cache is read once per KV head, not once per query
// head. The block walk, softmax, fp32 and bf16 value sums and the merge of a sequence's parts are
// written once against the 16-lane vec API. The key scores have an AVX-512 form (16 x 16 register
// transposes) and an AVX2 one (8 x 8, keys in two groups: 16 registers; bf16 keys of up to 3 query
// heads with their dims in lanes), the bf16 and int8 value sums an AVX2 form (values widened from
// memory beside the sums; integer shuffles), and bf16 caches take AVX512-BF16 dot products where the
// build has them. fp8 (e4m3) rows are widened to fp32 exactly (F16C: no CPU here converts fp8
// natively) and take the fp32 forms.
// The pieces: decode_blocks.h (block walk, softmax), decode_keys.h (scores), decode_values.h (value sums).
#include "common.h"
#include "decode_keys.h"
#include "decode_values.h"
#include "ops.h"

namespace llmserve {
namespace {

using namespace decode;

// G query heads share a KV head; NV = head_dim / 16 vectors per row. Both are compile-time so the
// score and accumulator vectors stay in registers. A work item is one part of a sequence's keys for
// all its heads: each block's rows are read whole and in address order (faster than one head per
// item, which reads each row in kv_heads pieces). Sequence s's keys are split into
// first_item[s + 1] - first_item[s] runs of blocks (flash-decoding, so that one long sequence keeps
// every thread busy): each part writes its unnormalized sums with its max and normalizer, and a second
// pass merges the parts in order. The split depends on the sequence's own length only, never on the
// batch or the thread count, so a sequence's output is bit-identical whatever else is decoded with it
// (seeded sampling must not depend on the batch). Threads claim the items one at a time (parallel_claim).
// C: the cache's element type, T, int8_t or Fp8 (rows with scales: key scales multiply the scores, value
// scales the softmax weights; int8 keys take the item's queries quantized to int16 once, fp8 keys fp32
// queries).
template <typename T, typename C, int G, int NV>
void decode_attention_impl(T* out, const T* q, const C* k_cache, const C* v_cache, const int64_t* block_tables,
                           int64_t max_blocks, const int64_t* seq_lens, int64_t num_seqs, int64_t kv_heads,
                           const int64_t* first_item, int64_t block_size, float scale) {
  constexpr bool kInt8 = std::is_same_v<C, int8_t>, kFp8 = std::is_same_v<C, Fp8>;
#if defined(__AVX512BF16__)
  constexpr bool kWidenQuery = kFp8;
#else
  constexpr bool kWidenQuery = kFp8 || std::is_same_v<C, c10::BFloat16>;  // bf16 and fp8 keys take fp32 queries
#endif
  constexpr int64_t head_dim = NV * 16;
  constexpr int64_t head_row = cache_row_len<C>(head_dim);
  const int64_t heads = G * kv_heads, kv_row = kv_heads * head_row;
  // Per (item, head): head_dim sums, then max and normalizer (read only for split sequences).
  const int64_t partial_row = head_dim + 2, num_items = first_item[num_seqs];
  std::vector<int64_t> item_seq(num_items);
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t item = first_item[s]; item < first_item[s + 1]; ++item) item_seq[item] = s;
  std::vector<float> partials(num_items > num_seqs ? num_items * heads * partial_row : 0);
  parallel_claim(num_items, [&](ItemCounter& items) {
    std::vector<float> scores, accs(heads * head_dim), q_scales(kInt8 ? heads : 0), row_max(heads), row_sum(heads);
    std::vector<int32_t> q_pairs(kInt8 ? heads * head_dim / 2 : 0);
    std::vector<float> q_f32(kWidenQuery ? heads * head_dim : 0);
    // Item i's part of its sequence: the block table and blocks [lo, hi) of it.
    struct Part {
      const int64_t* table;
      int64_t lo, hi;
    };
    auto part_of = [&](int64_t i) {
      const int64_t s = item_seq[i], part = i - first_item[s], parts = first_item[s + 1] - first_item[s];
      const int64_t seq_blocks = (seq_lens[s] + block_size - 1) / block_size;
      return Part{block_tables + s * max_blocks, seq_blocks * part / parts, seq_blocks * (part + 1) / parts};
    };
    for (int64_t item = items.claim(), next; item < num_items; item = next) {
      next = items.after(item);  // claimed now: its first key blocks are prefetched during this item's values
      const int64_t s = item_seq[item], parts = first_item[s + 1] - first_item[s], len = seq_lens[s];
      const Part own = part_of(item);
      const int64_t* table = own.table;
      const int64_t b_lo = own.lo, b_hi = own.hi;
      FirstBlocks<C> next_keys;
      if (next < num_items) {
        const Part following = part_of(next);
        next_keys = FirstBlocks<C>(k_cache, following.table, following.lo, following.hi, block_size, kv_row);
      }
      const int64_t t_lo = b_lo * block_size, span = std::min(len, b_hi * block_size) - t_lo;  // keys of this part
      const T* qs = q + s * heads * head_dim;
      if constexpr (kInt8) prepare_query_int16(q_pairs.data(), q_scales.data(), qs, heads, head_dim);
      if constexpr (kWidenQuery) widen_query<C>(q_f32.data(), qs, heads * head_dim);
      scores.resize(heads * std::max<int64_t>(span, 1));
      std::fill(accs.begin(), accs.end(), 0.f);
      float* sc = scores.data();  // [head][span]
      // Scores, 16 tokens at a time and every head for those tokens before the next 16, so the rows
      // are read in address order; the same rows of the block kAheadBlocks on are prefetched as we go.
      const FirstBlocks<C> first_values(v_cache, table, b_lo, b_hi, block_size, kv_row);
      for_each_block(k_cache, table, b_lo, b_hi, len, block_size, kv_row, first_values, [&](const C* kb, const C* ahead, int64_t n, int64_t t0) {
        for (int64_t t = 0; t < n; t += 16) {
          const int64_t nt = std::min<int64_t>(16, n - t);
          const int64_t ahead_rows = std::min<int64_t>(16, block_size - t);
          for (int64_t kh = 0; kh < kv_heads; ++kh) {
            prefetch_share(ahead, t, ahead_rows, kh, kv_heads, kv_row);
            const C* k16 = kb + t * kv_row + kh * head_row;
            vf dot[G];
            vf key_scales = set1(kFp8 ? scale * kFp8Unshift : scale);  // per score: scale, times the key row's for int8/fp8
            if constexpr (kInt8) {
              key_scores<G, NV>(dot, q_pairs.data() + kh * G * head_dim / 2, k16, kv_row, nt);
              key_scales = mul(key_scales, row_scales16(k16, kv_row, nt, head_dim));
            } else if constexpr (kWidenQuery) {
              key_scores<G, NV>(dot, q_f32.data() + kh * G * head_dim, k16, kv_row, nt);
              if constexpr (kFp8) key_scales = mul(key_scales, row_scales16(k16, kv_row, nt, head_dim));
            } else {
              key_scores<G, NV>(dot, qs + kh * G * head_dim, k16, kv_row, nt);
            }
            float* sk = sc + kh * G * span + t0 + t;
            for (int j = 0; j < G; ++j) {
              vf sj = mul(dot[j], key_scales);
              if constexpr (kInt8) sj = mul(sj, set1(q_scales[kh * G + j]));
              store_lanes(sk + j * span, sj, nt);
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
      weighted_values<G, NV>(accs.data(), sc, span, v_cache, table, b_lo, b_hi, len, block_size, kv_heads, next_keys);
      if (parts == 1) {
        T* os = out + s * heads * head_dim;
        for (int64_t r = 0; r < heads; ++r)
          for (int v = 0; v < NV; ++v)
            store16(os + r * head_dim + v * 16,
                    mul(loadu(accs.data() + r * head_dim + v * 16), set1(1.f / row_sum[r])));
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
      vf acc[NV];
      for (int v = 0; v < NV; ++v) acc[v] = zero();
      for (int64_t p = 0; p < parts; ++p) {
        const float* pp = first + p * stride;
        const float w = std::exp(pp[head_dim] - m);
        l += w * pp[head_dim + 1];
        for (int v = 0; v < NV; ++v) acc[v] = fmadd(set1(w), loadu(pp + v * 16), acc[v]);
      }
      T* os = out + s * heads * head_dim + r * head_dim;
      for (int v = 0; v < NV; ++v) store16(os + v * 16, mul(acc[v], set1(1.f / l)));
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

}  // namespace

bool attention_supports(int64_t heads, int64_t kv_heads, int64_t head_dim) {
  return kv_heads > 0 && heads % kv_heads == 0 && heads / kv_heads <= 8 && (head_dim == 64 || head_dim == 128);
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t heads, double scale) {
  for (auto* t : {&q, &k_cache, &v_cache, &block_tables, &seq_lens}) check_cpu_contiguous(*t, "decode_attention input");
  TORCH_CHECK(k_cache.dim() == 4, "caches must be [blocks, block_size, kv_heads, head_dim (+ 4 for int8/fp8)]");
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t head_dim = cache_head_dim(k_cache);
  const int64_t num_seqs = seq_lens.numel();
  TORCH_CHECK(attention_supports(heads, kv_heads, head_dim), "decode_attention: unsupported shape: ", heads,
              " heads, ", kv_heads, " KV heads, head_dim ", head_dim);
  TORCH_CHECK(q.dim() == 2 && q.size(0) == num_seqs && q.size(1) == heads * head_dim, "q must be [num_seqs, heads * head_dim]");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "block_tables and seq_lens must be int64");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs, "block_tables must be [num_seqs, max_blocks]");
  const CacheKind kind = check_cache(k_cache, v_cache, q.scalar_type(), kv_heads, head_dim, "decode_attention");
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
    if (kind == CacheKind::kInt8) run(k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>());
    else if (kind == CacheKind::kFp8)
      run(reinterpret_cast<const Fp8*>(k_cache.data_ptr<uint8_t>()), reinterpret_cast<const Fp8*>(v_cache.data_ptr<uint8_t>()));
    else run(k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>());
  });
  return out;
}

// What this build runs for each cache dtype.
std::vector<std::string> decode_attention_paths() {
  const std::string vector_name = kVectorName;
  return {
      "decode_attention fp32 cache: fp32 FMA, keys transposed into lanes (" + vector_name + ")",
#if defined(__AVX512BF16__)
      "decode_attention bf16 cache: AVX512-BF16 dot products (vdpbf16ps), scores and values",
#else
      "decode_attention bf16 cache: bf16 widened to fp32, FMA (" + vector_name + ")",
#endif
#if defined(__AVX512VNNI__)
      "decode_attention int8 cache: int16 pairs, VNNI vpdpwssd (" + vector_name + ")",
#else
      "decode_attention int8 cache: int16 pairs, vpmaddwd (" + vector_name + ")",
#endif
      "decode_attention fp8 cache: e4m3 widened through F16C, fp32 FMA (" + vector_name + ")",
  };
}

}  // namespace llmserve

