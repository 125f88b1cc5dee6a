// The ops each kernel file defines, bound by bindings.cpp. Every op has a torch reference in
// shared/engine (the same maths, unfused) and is tested against it at every ISA level.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

namespace llmserve {

at::Tensor rms_norm(at::Tensor x, const at::Tensor& weight, double eps, const c10::optional<at::Tensor>& residual);
void rope_and_cache(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                    at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping, int64_t heads,
                    int64_t kv_heads, int64_t head_dim);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor argmax_rows(const at::Tensor& x);

bool attention_supports(int64_t heads, int64_t kv_heads, int64_t head_dim);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t heads, double scale);
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& block_tables, const at::Tensor& query_start, const at::Tensor& seq_lens,
                             int64_t heads, double scale);

at::Tensor pack_linear_bf16(const at::Tensor& w);
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t out_features, const c10::optional<at::Tensor>& bias);
at::Tensor pack_linear_int8(const at::Tensor& q);
at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& colsum,
                       const c10::optional<at::Tensor>& smooth, const c10::optional<at::Tensor>& bias);
at::Tensor linear_gguf(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& mins, c10::string_view format, int64_t out_features,
                       const c10::optional<at::Tensor>& bias);

// "op: instructions" for each op whose instructions depend on the level (kernels/cpu/__main__ prints them).
std::vector<std::string> decode_attention_paths();
std::vector<std::string> prefill_attention_paths();
std::string linear_bf16_path();
std::string linear_int8_path();
std::string linear_gguf_path();

}  // namespace llmserve
