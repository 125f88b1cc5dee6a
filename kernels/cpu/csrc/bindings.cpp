// Binds this level's ops as a Python module (kernels/cpu/build.py names it llmserve_cpu_<level>_<digest>
// and loads it; its `name` attribute is llmserve_cpu_<level>), so a process can load several levels side
// by side (the tests compare each with the torch reference) and kernels/cpu picks one at run time.
//
// Why pybind11 and not TORCH_LIBRARY/torch.ops: a boxed torch.ops call releases the GIL for the whole
// call and drops its tensor arguments inside it; dropping the last C++ reference to a tensor Python also
// holds takes the GIL back (TensorImpl::decref_pyobject), so every call waits for the GIL a second time,
// after its kernel has run, whenever another thread (the executor's event loop) holds it. Here each op
// releases the GIL around its kernel only (call_guard); the argument casters drop their references
// after the call, with the GIL held.
#include <torch/extension.h>

#include "ops.h"
#include "vec.h"

#ifndef LLMSERVE_NAMESPACE
#error "build with -DLLMSERVE_NAMESPACE=llmserve_cpu_<level> (kernels/cpu/build.py does)"
#endif

#define LLMSERVE_STR2(x) #x
#define LLMSERVE_STR(x) LLMSERVE_STR2(x)

namespace {

namespace py = pybind11;

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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.attr("name") = LLMSERVE_STR(LLMSERVE_NAMESPACE);
  m.def("rms_norm", &llmserve::rms_norm, no_gil, py::arg("x"), py::arg("weight"), py::arg("eps"),
        py::arg("residual") = py::none());
  m.def("rope_and_cache", &llmserve::rope_and_cache, no_gil, py::arg("qkv"), py::arg("positions"), py::arg("cos"),
        py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"), py::arg("heads"),
        py::arg("kv_heads"), py::arg("head_dim"));
  m.def("silu_mul", &llmserve::silu_mul, no_gil, py::arg("gate_up"));
  m.def("argmax_rows", &llmserve::argmax_rows, no_gil, py::arg("x"));
  m.def("pack_linear_bf16", &llmserve::pack_linear_bf16, no_gil, py::arg("weight"));
  m.def("linear_bf16", &llmserve::linear_bf16, no_gil, py::arg("x"), py::arg("packed"), py::arg("out_features"),
        py::arg("bias"));
  m.def("pack_linear_int8", &llmserve::pack_linear_int8, no_gil, py::arg("weight"));
  m.def("linear_int8", &llmserve::linear_int8, no_gil, py::arg("x"), py::arg("packed"), py::arg("scale"),
        py::arg("colsum"), py::arg("smooth"), py::arg("bias"));
  m.def("linear_gguf", &llmserve::linear_gguf, no_gil, py::arg("x"), py::arg("qs"), py::arg("scales"), py::arg("mins"),
        py::arg("format"), py::arg("out_features"), py::arg("bias"));
  m.def("attention_supports", &llmserve::attention_supports, py::arg("heads"), py::arg("kv_heads"),
        py::arg("head_dim"));
  m.def("prefill_attention", &llmserve::prefill_attention, no_gil, py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_tables"), py::arg("query_start"), py::arg("seq_lens"), py::arg("heads"),
        py::arg("scale"));
  m.def("decode_attention", &llmserve::decode_attention, no_gil, py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("heads"), py::arg("scale"));
  m.def("paths", &paths);
}
