// Registers this level's ops as torch.ops.<LLMSERVE_NAMESPACE>.* (llmserve_cpu_avx2, ..._avx512, ...):
// one namespace per ISA level, so a process can load several levels side by side (the tests compare
// each with the torch reference) and kernels/cpu picks one at run time.
#include <torch/library.h>

#include "ops.h"
#include "vec.h"

#ifndef LLMSERVE_NAMESPACE
#error "build with -DLLMSERVE_NAMESPACE=llmserve_cpu_<level> (kernels/cpu/build.py does)"
#endif

namespace {

// Compiled-in paths of every op, for `python -m kernels.cpu`.
std::vector<std::string> paths() {
  std::vector<std::string> out;
  for (const char* op : {"rms_norm", "rope_and_cache", "silu_mul", "argmax_rows"})
    out.push_back(std::string(op) + ": " + vec::kVectorName);
  for (const auto& p : llmserve::decode_attention_paths()) out.push_back(p);
  for (const auto& p : llmserve::prefill_attention_paths()) out.push_back(p);
  out.push_back(llmserve::linear_bf16_path());
  out.push_back(llmserve::linear_int8_path());
  out.push_back(llmserve::linear_gguf_path());
  return out;
}

}  // namespace

// The namespace is a macro: expand it before TORCH_LIBRARY pastes it into identifiers.
#define LLMSERVE_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define LLMSERVE_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

LLMSERVE_LIBRARY(LLMSERVE_NAMESPACE, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!)? residual=None) -> Tensor");
  m.def("rope_and_cache(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache, "
        "Tensor slot_mapping, int heads, int kv_heads, int head_dim) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("pack_linear_bf16(Tensor weight) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("pack_linear_int8(Tensor weight) -> Tensor");
  m.def("linear_int8(Tensor x, Tensor packed, Tensor scale, Tensor colsum, Tensor? smooth, Tensor? bias) -> Tensor");
  m.def("linear_gguf(Tensor x, Tensor qs, Tensor scales, Tensor? mins, str format, int out_features, Tensor? bias) -> Tensor");
  m.def("attention_supports(int heads, int kv_heads, int head_dim) -> bool", llmserve::attention_supports);
  m.def("prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor query_start, Tensor seq_lens, int heads, float scale) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, int heads, float scale) -> Tensor");
  m.def("paths() -> str[]", paths);
}

LLMSERVE_LIBRARY_IMPL(LLMSERVE_NAMESPACE, CPU, m) {
  m.impl("rms_norm", llmserve::rms_norm);
  m.impl("rope_and_cache", llmserve::rope_and_cache);
  m.impl("silu_mul", llmserve::silu_mul);
  m.impl("argmax_rows", llmserve::argmax_rows);
  m.impl("pack_linear_bf16", llmserve::pack_linear_bf16);
  m.impl("linear_bf16", llmserve::linear_bf16);
  m.impl("pack_linear_int8", llmserve::pack_linear_int8);
  m.impl("linear_int8", llmserve::linear_int8);
  m.impl("linear_gguf", llmserve::linear_gguf);
  m.impl("decode_attention", llmserve::decode_attention);
  m.impl("prefill_attention", llmserve::prefill_attention);
}
