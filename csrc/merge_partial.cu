// merge_partial: fold one partial attention result into the fp32 accumulators, in place:
//   w       = sigmoid(part_lse - lse)            (= exp(part_lse - new_lse))
//   out     = lerp(out, part_out, w)
//   new_lse = logaddexp(lse, part_lse)
// Rows where both sides are -inf (no visible key yet) get w = 0: out and lse stay; a NaN lse
// on either side makes the row NaN.
//
// The arithmetic mirrors the torch fallback (ops.merge_partial_torch: sub, sigmoid_,
// the both-empty fill, lerp_, logaddexp) op for op, with PyTorch's own CUDA formulas for sigmoid,
// lerp and logaddexp, so the two agree to the last bit (tests/gpu/test_ops_compile.py).
// One warp owns one (row, head): it reads the old lse, updates the head_dim values with
// 16-byte accesses when head_dim and the pointers allow, then lane 0 writes the new lse.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels.h"
#include "launch.cuh"

namespace megatron_cp_ext {
namespace {

constexpr int kWarp = 32;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

// Same formula as torch.logaddexp on CUDA, so merged lse values match the fallback exactly.
__device__ __forceinline__ float logaddexp(float a, float b) {
  if (isinf(a) && a == b) return a;
  const float m = fmaxf(a, b);
  return m + log1pf(expf(-fabsf(a - b)));
}

// torch.sigmoid on CUDA (1 / (1 + exp(-x)) in fp32) of the rounded difference; weight 0 where
// both sides are -inf (nothing visible yet, keep the accumulator). A NaN lse on either side
// stays NaN and reaches the output, as in the fallback: bad input is never hidden.
__device__ __forceinline__ float sigmoid_weight(float a, float b) {
  const float x = __fsub_rn(b, a);
  const float w = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-x)));
  return (isinf(a) && a < 0.0f && isinf(b) && b < 0.0f) ? 0.0f : w;
}

// torch.lerp on CUDA (ATen's Lerp.h): two formulas split at |w| < 0.5, each a fused
// multiply-add as nvcc contracts them in PyTorch's build.
__device__ __forceinline__ float lerp(float self, float end, float w) {
  const float diff = __fsub_rn(end, self);
  return fabsf(w) < 0.5f ? __fmaf_rn(w, diff, self) : __fmaf_rn(-diff, __fsub_rn(1.0f, w), end);
}

template <typename Part, int kVec>
__global__ void merge_partial_kernel(
    float* __restrict__ out,
    float* __restrict__ lse,
    const Part* __restrict__ part_out,
    const float* __restrict__ part_lse,
    const int64_t* __restrict__ idx,
    int64_t n_rows,
    int64_t heads,
    int64_t head_dim,
    int64_t acc_rows) {
  const int lane = threadIdx.x % kWarp;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int64_t n_warps = static_cast<int64_t>(gridDim.x) * blockDim.x / kWarp;
  // Loop bounds are uniform across a warp, so __syncwarp below sees all 32 lanes.
  for (int64_t row = first; row < n_rows * heads; row += n_warps) {
    const int64_t n = row / heads;
    const int64_t t = idx == nullptr ? n : idx[n];
    MCX_DEVICE_CHECK(t >= 0 && t < acc_rows, "merge_partial: index out of range");
    const int64_t acc_row = t * heads + (row - n * heads);

    const float a = lse[acc_row];
    const float b = part_lse[row];
    const float merged = logaddexp(a, b);
    const float w = sigmoid_weight(a, b);

    float* o = out + acc_row * head_dim;
    const Part* p = part_out + row * head_dim;
    for (int64_t d = static_cast<int64_t>(lane) * kVec; d < head_dim; d += kWarp * kVec) {
      Pack<float, kVec> acc = *reinterpret_cast<const Pack<float, kVec>*>(o + d);
      const Pack<Part, kVec> part = *reinterpret_cast<const Pack<Part, kVec>*>(p + d);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        acc.v[j] = lerp(acc.v[j], to_float(part.v[j]), w);
      }
      *reinterpret_cast<Pack<float, kVec>*>(o + d) = acc;
    }
    __syncwarp();  // every lane has read the old lse before it is overwritten
    if (lane == 0) lse[acc_row] = merged;
  }
}

template <typename Part>
cudaError_t launch(
    float* out,
    float* lse,
    const void* part_out,
    const float* part_lse,
    const int64_t* idx,
    int64_t n_rows,
    int64_t heads,
    int64_t head_dim,
    int64_t acc_rows,
    cudaStream_t stream) {
  unsigned int blocks = 0;
  const cudaError_t err = grid_for(n_rows * heads * kWarp, &blocks);
  if (err != cudaSuccess) return err;
  const Part* part = static_cast<const Part*>(part_out);
  constexpr int kVec = 4;
  const bool wide = head_dim % kVec == 0 && aligned_to(out, sizeof(float) * kVec) &&
                    aligned_to(part, sizeof(Part) * kVec);
  if (wide) {
    merge_partial_kernel<Part, kVec><<<blocks, kThreads, 0, stream>>>(
        out, lse, part, part_lse, idx, n_rows, heads, head_dim, acc_rows);
  } else {
    merge_partial_kernel<Part, 1><<<blocks, kThreads, 0, stream>>>(
        out, lse, part, part_lse, idx, n_rows, heads, head_dim, acc_rows);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_merge_partial(
    float* out,
    float* lse,
    const void* part_out,
    Dtype part_dtype,
    const float* part_lse,
    const int64_t* idx,
    int64_t n_rows,
    int64_t heads,
    int64_t head_dim,
    int64_t acc_rows,
    cudaStream_t stream) {
  if (n_rows == 0 || heads == 0) return cudaSuccess;
  switch (part_dtype) {
    case Dtype::kFloat32:
      return launch<float>(
          out, lse, part_out, part_lse, idx, n_rows, heads, head_dim, acc_rows, stream);
    case Dtype::kFloat16:
      return launch<__half>(
          out, lse, part_out, part_lse, idx, n_rows, heads, head_dim, acc_rows, stream);
    case Dtype::kBFloat16:
      return launch<__nv_bfloat16>(
          out, lse, part_out, part_lse, idx, n_rows, heads, head_dim, acc_rows, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace megatron_cp_ext
