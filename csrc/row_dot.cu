// row_dot: out[r] = sum_d a[r, d] * b[r, d] in fp32 for 16-bit a and b, [rows, d] each.
//
// The a2a backward moves each row's dout . out instead of the output (schedules/delta.py).
// In torch that is a widened copy of one operand, an in-place multiply and a sum: five
// passes over fp32 rows for what needs one read of each 16-bit operand. Here one warp owns
// one row: 16-byte loads where d and the pointers allow, each product exact in fp32 (two
// 16-bit significands fit in fp32's) and accumulated with fmaf, then a warp reduction.
// The sum's order differs from torch.sum's, so results agree with the fallback to fp32
// rounding, not to the bit (tests/gpu/test_ops_compile.py bounds it against fp64).

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels.h"
#include "launch.cuh"

namespace megatron_cp_ext {
namespace {

constexpr int kWarp = 32;

__device__ __forceinline__ float widen(__half v) { return __half2float(v); }
__device__ __forceinline__ float widen(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T, int kVec>
__global__ void row_dot_kernel(
    float* __restrict__ out, const T* __restrict__ a, const T* __restrict__ b, int64_t rows, int64_t d) {
  const int lane = threadIdx.x % kWarp;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int64_t n_warps = static_cast<int64_t>(gridDim.x) * blockDim.x / kWarp;
  // Loop bounds are uniform across a warp, so the shuffles below see all 32 lanes.
  for (int64_t row = first; row < rows; row += n_warps) {
    const T* x = a + row * d;
    const T* y = b + row * d;
    float s = 0.0f;
    for (int64_t c = static_cast<int64_t>(lane) * kVec; c < d; c += kWarp * kVec) {
      const Pack<T, kVec> xv = *reinterpret_cast<const Pack<T, kVec>*>(x + c);
      const Pack<T, kVec> yv = *reinterpret_cast<const Pack<T, kVec>*>(y + c);
#pragma unroll
      for (int i = 0; i < kVec; ++i) s = __fmaf_rn(widen(xv.v[i]), widen(yv.v[i]), s);
    }
#pragma unroll
    for (int off = kWarp / 2; off > 0; off /= 2) s += __shfl_down_sync(0xffffffffu, s, off);
    if (lane == 0) out[row] = s;
  }
}

template <typename T>
cudaError_t launch_typed(float* out, const void* a, const void* b, int64_t rows, int64_t d, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  unsigned int blocks = 0;
  const cudaError_t err = grid_for(rows * kWarp, &blocks);
  if (err != cudaSuccess) return err;
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  constexpr int kVec = 16 / sizeof(T);
  if (d % kVec == 0 && aligned_to(x, 16) && aligned_to(y, 16)) {
    row_dot_kernel<T, kVec><<<blocks, kThreads, 0, stream>>>(out, x, y, rows, d);
  } else {
    row_dot_kernel<T, 1><<<blocks, kThreads, 0, stream>>>(out, x, y, rows, d);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_row_dot(
    float* out, const void* a, const void* b, Dtype dtype, int64_t rows, int64_t d, cudaStream_t stream) {
  switch (dtype) {
    case Dtype::kFloat16:
      return launch_typed<__half>(out, a, b, rows, d, stream);
    case Dtype::kBFloat16:
      return launch_typed<__nv_bfloat16>(out, a, b, rows, d, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace megatron_cp_ext
