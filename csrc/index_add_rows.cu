// index_add_rows: acc[idx[n]] += src[n] along dim 0, in place — accumulating gradient
// rows back to their tokens. Indices may repeat (several partial results feed one token),
// so every element is an atomic add; the order of adds to one element is unspecified.
//
// acc is fp32 with src fp32/fp16/bf16 (the usual fp32 gradient accumulator), or acc and src
// share one of fp16/bf16/fp64. Native bf16 atomics need sm_80, the floor of this package.

#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels.h"
#include "launch.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "megatron_cp_ext kernels need sm_80 or newer (bf16 atomics)"
#endif

namespace megatron_cp_ext {
namespace {

__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename Acc, typename Src>
__device__ __forceinline__ Acc to_acc(Src v) {
  if constexpr (std::is_same_v<Acc, Src>) {
    return v;
  } else {
    static_assert(std::is_same_v<Acc, float>, "mixed dtypes only accumulate into fp32");
    return to_float(v);
  }
}

template <typename Acc, typename Src>
__global__ void index_add_rows_kernel(
    Acc* __restrict__ acc,
    const int64_t* __restrict__ idx,
    const Src* __restrict__ src,
    int64_t n_rows,
    int64_t row_numel,
    int64_t acc_rows) {
  const int64_t total = n_rows * row_numel;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += stride) {
    const int64_t row = i / row_numel;
    const int64_t dst = idx[row];
    MCX_DEVICE_CHECK(dst >= 0 && dst < acc_rows, "index_add_rows: index out of range");
    atomicAdd(acc + dst * row_numel + (i - row * row_numel), to_acc<Acc>(src[i]));
  }
}

template <typename Acc, typename Src>
cudaError_t launch(
    void* acc,
    const int64_t* idx,
    const void* src,
    int64_t n_rows,
    int64_t row_numel,
    int64_t acc_rows,
    cudaStream_t stream) {
  unsigned int blocks = 0;
  const cudaError_t err = grid_for(n_rows * row_numel, &blocks);
  if (err != cudaSuccess) return err;
  index_add_rows_kernel<Acc, Src><<<blocks, kThreads, 0, stream>>>(
      static_cast<Acc*>(acc), idx, static_cast<const Src*>(src), n_rows, row_numel, acc_rows);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_index_add_rows(
    void* acc,
    Dtype acc_dtype,
    const int64_t* idx,
    const void* src,
    Dtype src_dtype,
    int64_t n_rows,
    int64_t row_numel,
    int64_t acc_rows,
    cudaStream_t stream) {
  if (n_rows == 0 || row_numel == 0) return cudaSuccess;
#define MCX_LAUNCH(ACC, SRC) launch<ACC, SRC>(acc, idx, src, n_rows, row_numel, acc_rows, stream)
  if (acc_dtype == Dtype::kFloat32) {
    switch (src_dtype) {
      case Dtype::kFloat32: return MCX_LAUNCH(float, float);
      case Dtype::kFloat16: return MCX_LAUNCH(float, __half);
      case Dtype::kBFloat16: return MCX_LAUNCH(float, __nv_bfloat16);
      default: return cudaErrorInvalidValue;
    }
  }
  if (acc_dtype != src_dtype) return cudaErrorInvalidValue;
  switch (acc_dtype) {
    case Dtype::kFloat16: return MCX_LAUNCH(__half, __half);
    case Dtype::kBFloat16: return MCX_LAUNCH(__nv_bfloat16, __nv_bfloat16);
    case Dtype::kFloat64: return MCX_LAUNCH(double, double);
    default: return cudaErrorInvalidValue;
  }
#undef MCX_LAUNCH
}

}  // namespace megatron_cp_ext
