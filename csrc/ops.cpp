// torch-facing side of the CUDA kernels: input checks, device guard, current stream,
// allocation, and registration as torch.library ops in namespace megatron_cp_ext.
//
// Schemas are defined here; their fake (meta) impls live in megatron_cp_ext/runtime/ops.py, which
// set_python_module points torch at. Only CUDA impls are registered: the Python wrappers
// send CPU tensors to the pure-torch fallbacks before they reach the dispatcher.

#include <Python.h>

#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "kernels.h"

namespace megatron_cp_ext {
namespace {

// Numbers and shapes in error messages go through std::to_string, never an ostream: on one
// H100 image, an extension whose messages streamed an int64 (``ss << long``, also what
// c10's ``operator<<(IntArrayRef)`` does) segfaulted in that stream call when its check
// failed, inside torch's own process and libstdc++. Strings stream safely there.
std::string dims(at::IntArrayRef s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

void check_cuda_contiguous(const at::Tensor& t, const at::Tensor& ref, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got device ", t.device());
  TORCH_CHECK(
      t.device() == ref.device(), name, " is on ", t.device(), " but expected ", ref.device());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// 1-D contiguous int64 index on ref's device with `rows` entries (rows < 0: any number).
void check_index(const at::Tensor& idx, const at::Tensor& ref, int64_t rows) {
  check_cuda_contiguous(idx, ref, "idx");
  TORCH_CHECK(idx.scalar_type() == at::kLong, "idx must be int64, got ", idx.scalar_type());
  TORCH_CHECK(idx.dim() == 1, "idx must be 1-D, got ", std::to_string(idx.dim()), " dims");
  TORCH_CHECK(
      rows < 0 || idx.size(0) == rows, "idx has ", std::to_string(idx.size(0)), " entries, expected ", std::to_string(rows));
}

// Elements in one dim-0 row; defined from the sizes so it also holds for zero rows.
int64_t row_numel(const at::Tensor& t) {
  int64_t n = 1;
  for (int64_t d = 1; d < t.dim(); ++d) n *= t.size(d);
  return n;
}

Dtype to_dtype(at::ScalarType s, const char* name) {
  switch (s) {
    case at::kFloat: return Dtype::kFloat32;
    case at::kHalf: return Dtype::kFloat16;
    case at::kBFloat16: return Dtype::kBFloat16;
    case at::kDouble: return Dtype::kFloat64;
    default: TORCH_CHECK(false, name, " has unsupported dtype ", s);
  }
}

cudaStream_t stream_of(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

}  // namespace

at::Tensor gather_rows_cuda(const at::Tensor& x, const at::Tensor& idx) {
  TORCH_CHECK(x.dim() >= 1, "x must have a row dimension (dim >= 1)");
  check_cuda_contiguous(x, x, "x");
  check_index(idx, x, /*rows=*/-1);
  std::vector<int64_t> shape = x.sizes().vec();
  shape[0] = idx.size(0);
  at::Tensor out = at::empty(shape, x.options());
  const c10::cuda::CUDAGuard guard(x.device());
  C10_CUDA_CHECK(launch_gather_rows(
      x.const_data_ptr(),
      idx.const_data_ptr<int64_t>(),
      out.mutable_data_ptr(),
      idx.size(0),
      row_numel(x) * static_cast<int64_t>(x.element_size()),
      x.size(0),
      stream_of(x)));
  return out;
}

void index_add_rows_cuda(at::Tensor& acc, const at::Tensor& idx, const at::Tensor& src) {
  TORCH_CHECK(acc.dim() >= 1, "acc must have a row dimension (dim >= 1)");
  check_cuda_contiguous(acc, acc, "acc");
  check_cuda_contiguous(src, acc, "src");
  TORCH_CHECK(
      src.dim() == acc.dim() && src.sizes().slice(1) == acc.sizes().slice(1),
      "src rows must match acc rows: src ", dims(src.sizes()), ", acc ", dims(acc.sizes()));
  check_index(idx, acc, src.size(0));
  const bool mixed_ok = acc.scalar_type() == at::kFloat &&
      (src.scalar_type() == at::kHalf || src.scalar_type() == at::kBFloat16);
  TORCH_CHECK(
      src.scalar_type() == acc.scalar_type() || mixed_ok,
      "index_add_rows_ accumulates into fp32 or src's own dtype; got acc ", acc.scalar_type(),
      ", src ", src.scalar_type());
  const c10::cuda::CUDAGuard guard(acc.device());
  C10_CUDA_CHECK(launch_index_add_rows(
      acc.mutable_data_ptr(),
      to_dtype(acc.scalar_type(), "acc"),
      idx.const_data_ptr<int64_t>(),
      src.const_data_ptr(),
      to_dtype(src.scalar_type(), "src"),
      src.size(0),
      row_numel(src),
      acc.size(0),
      stream_of(acc)));
}

void merge_partial_cuda(
    at::Tensor& out,
    at::Tensor& lse,
    const at::Tensor& part_out,
    const at::Tensor& part_lse,
    const std::optional<at::Tensor>& idx) {
  check_cuda_contiguous(out, out, "out");
  check_cuda_contiguous(lse, out, "lse");
  check_cuda_contiguous(part_out, out, "part_out");
  check_cuda_contiguous(part_lse, out, "part_lse");
  TORCH_CHECK(out.dim() == 3, "out must be [T, H, D], got ", dims(out.sizes()));
  TORCH_CHECK(part_out.dim() == 3, "part_out must be [N, H, D], got ", dims(part_out.sizes()));
  const int64_t n = part_out.size(0), h = out.size(1), d = out.size(2);
  TORCH_CHECK(
      part_out.size(1) == h && part_out.size(2) == d,
      "part_out ", dims(part_out.sizes()), " does not match out ", dims(out.sizes()));
  TORCH_CHECK(
      lse.sizes() == at::IntArrayRef({out.size(0), h}),
      "lse must be [T, H] = [", std::to_string(out.size(0)), ", ", std::to_string(h), "], got ", dims(lse.sizes()));
  TORCH_CHECK(
      part_lse.sizes() == at::IntArrayRef({n, h}),
      "part_lse must be [N, H] = [", std::to_string(n), ", ", std::to_string(h), "], got ", dims(part_lse.sizes()));
  TORCH_CHECK(
      out.scalar_type() == at::kFloat && lse.scalar_type() == at::kFloat &&
          part_lse.scalar_type() == at::kFloat,
      "out, lse and part_lse must be fp32; got ", out.scalar_type(), ", ", lse.scalar_type(),
      ", ", part_lse.scalar_type());
  const at::ScalarType pt = part_out.scalar_type();
  TORCH_CHECK(
      pt == at::kFloat || pt == at::kHalf || pt == at::kBFloat16,
      "part_out must be fp32, fp16 or bf16, got ", pt);
  if (idx.has_value()) {
    check_index(*idx, out, n);
  } else {
    TORCH_CHECK(n == out.size(0), "without idx, part_out must cover all ", std::to_string(out.size(0)), " rows");
  }
  const c10::cuda::CUDAGuard guard(out.device());
  C10_CUDA_CHECK(launch_merge_partial(
      out.mutable_data_ptr<float>(),
      lse.mutable_data_ptr<float>(),
      part_out.const_data_ptr(),
      to_dtype(pt, "part_out"),
      part_lse.const_data_ptr<float>(),
      idx.has_value() ? idx->const_data_ptr<int64_t>() : nullptr,
      n,
      h,
      d,
      out.size(0),
      stream_of(out)));
}

at::Tensor row_dot_cuda(const at::Tensor& a, const at::Tensor& b) {
  check_cuda_contiguous(a, a, "a");
  check_cuda_contiguous(b, a, "b");
  TORCH_CHECK(a.dim() >= 1, "a must have a last dim");
  TORCH_CHECK(a.sizes() == b.sizes(), "a ", dims(a.sizes()), " and b ", dims(b.sizes()), " differ");
  TORCH_CHECK(
      a.scalar_type() == b.scalar_type() && (a.scalar_type() == at::kHalf || a.scalar_type() == at::kBFloat16),
      "a and b must both be fp16 or bf16; got ", a.scalar_type(), ", ", b.scalar_type());
  const int64_t d = a.size(-1);
  const int64_t rows = d == 0 ? 0 : a.numel() / d;
  const c10::cuda::CUDAGuard guard(a.device());
  const auto shape = a.sizes().slice(0, a.dim() - 1);
  const auto opts = a.options().dtype(at::kFloat);
  at::Tensor out = d == 0 ? at::zeros(shape, opts) : at::empty(shape, opts);  // a sum over no terms is 0
  C10_CUDA_CHECK(launch_row_dot(
      out.mutable_data_ptr<float>(), a.const_data_ptr(), b.const_data_ptr(), to_dtype(a.scalar_type(), "a"), rows, d,
      stream_of(a)));
  return out;
}

at::Tensor stand_in_cuda(const at::Tensor& dout, const at::Tensor& delta) {
  check_cuda_contiguous(dout, dout, "dout");
  check_cuda_contiguous(delta, dout, "delta");
  TORCH_CHECK(dout.dim() >= 1 && dout.size(-1) >= 2, "dout must have a last dim of at least 2, got ", dims(dout.sizes()));
  TORCH_CHECK(
      delta.sizes() == dout.sizes().slice(0, dout.dim() - 1),
      "delta ", dims(delta.sizes()), " must be dout ", dims(dout.sizes()), " without its last dim");
  TORCH_CHECK(
      dout.scalar_type() == at::kHalf || dout.scalar_type() == at::kBFloat16,
      "dout must be fp16 or bf16, got ", dout.scalar_type());
  TORCH_CHECK(delta.scalar_type() == at::kFloat, "delta must be fp32, got ", delta.scalar_type());
  const int64_t d = dout.size(-1);
  at::Tensor out = at::empty(dout.sizes(), dout.options());
  const c10::cuda::CUDAGuard guard(dout.device());
  C10_CUDA_CHECK(launch_stand_in(
      out.mutable_data_ptr(), dout.const_data_ptr(), delta.const_data_ptr<float>(),
      to_dtype(dout.scalar_type(), "dout"), dout.numel() / d, d, stream_of(dout)));
  return out;
}

TORCH_LIBRARY(megatron_cp_ext, m) {
  m.set_python_module("megatron_cp_ext.runtime.ops");
  m.def("gather_rows(Tensor x, Tensor idx) -> Tensor");
  m.def("index_add_rows_(Tensor(a!) acc, Tensor idx, Tensor src) -> ()");
  m.def(
      "merge_partial_(Tensor(a!) out, Tensor(b!) lse, Tensor part_out, Tensor part_lse, "
      "Tensor? idx) -> ()");
  m.def("row_dot(Tensor a, Tensor b) -> Tensor");
  m.def("stand_in(Tensor dout, Tensor delta) -> Tensor");
}

TORCH_LIBRARY_IMPL(megatron_cp_ext, CUDA, m) {
  m.impl("gather_rows", &gather_rows_cuda);
  m.impl("index_add_rows_", &index_add_rows_cuda);
  m.impl("merge_partial_", &merge_partial_cuda);
  m.impl("row_dot", &row_dot_cuda);
  m.impl("stand_in", &stand_in_cuda);
}

}  // namespace megatron_cp_ext

// Importing megatron_cp_ext._C only has to run the static registrations above; the module
// itself is empty (no pybind11, which also keeps this file quicker to build).
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      "megatron_cp_ext._C",
      "megatron_cp_ext CUDA kernels, registered as torch.ops.megatron_cp_ext.*",
      -1,
      nullptr,  // m_methods
      nullptr,  // m_slots
      nullptr,  // m_traverse
      nullptr,  // m_clear
      nullptr};  // m_free
  return PyModule_Create(&module_def);
}
