// stand_in: the output a flash backward reads, made from dout (schedules/delta.py).
//
// For each row r of 16-bit dout [rows, d] and its fp32 delta[r], x[r] is zero except at the
// row's two largest |dout| entries k and l: x_k = round(delta / dout_k) and
// x_l = round((delta - dout_k * x_k) / dout_l), so sum_d dout_d * x_d carries delta to about
// twice the 16-bit precision. The torch form takes an abs, two argmax passes, a gather, a
// zero fill and a scatter: six passes over the row. Here one warp owns one row: one read of
// dout, one write of x. (A row whose delta / dout_k overflows the 16-bit type spreads the
// term over every entry, below.) The choice of k and l, and every rounding, is the torch form's:
// the largest magnitude first, NaN above every number, the lower index on ties; IEEE
// division and products with no contraction into an fma; round-to-nearest-even to 16 bits.
// So the result is the fallback's to the bit (tests/gpu/test_ops_compile.py), but for rows
// spread because their term overflows the type (their share: a rounding apart, see below).

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels.h"
#include "launch.cuh"

namespace megatron_cp_ext {
namespace {

constexpr int kWarp = 32;

__device__ __forceinline__ float widen(__half v) { return __half2float(v); }
__device__ __forceinline__ float widen(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ void narrow(float v, __half* out) { *out = __float2half_rn(v); }
__device__ __forceinline__ void narrow(float v, __nv_bfloat16* out) { *out = __float2bfloat16_rn(v); }

// The type's largest finite value, as torch.finfo(dtype).max.
__device__ __forceinline__ float max_of(__half) { return 65504.0f; }
__device__ __forceinline__ float max_of(__nv_bfloat16) { return 3.38953139e38f; }

// torch.sign of a finite value: -1, 0 (either zero) or 1.
__device__ __forceinline__ float sign_of(float v) { return v > 0.0f ? 1.0f : (v < 0.0f ? -1.0f : 0.0f); }

// Whether entry (m, i) comes before (n, j) in argmax order over |dout|: NaN first, then the
// larger magnitude, then the lower index. An empty slot has index -1 and comes last.
__device__ __forceinline__ bool before(float m, int64_t i, float n, int64_t j) {
  if (j < 0) return i >= 0;
  if (i < 0) return false;
  const bool mn = isnan(m), nn = isnan(n);
  if (mn != nn) return mn;
  if (!mn && m != n) return m > n;
  return i < j;
}

struct Top2 {
  float m1, m2;
  int64_t i1, i2;

  __device__ __forceinline__ void offer(float m, int64_t i) {
    if (before(m, i, m1, i1)) {
      m2 = m1;
      i2 = i1;
      m1 = m;
      i1 = i;
    } else if (before(m, i, m2, i2)) {
      m2 = m;
      i2 = i;
    }
  }
};

template <typename T>
__global__ void stand_in_kernel(
    T* __restrict__ out, const T* __restrict__ dout, const float* __restrict__ delta, int64_t rows, int64_t d) {
  const int lane = threadIdx.x % kWarp;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int64_t n_warps = static_cast<int64_t>(gridDim.x) * blockDim.x / kWarp;
  // Loop bounds are uniform across a warp, so the shuffles below see all 32 lanes.
  for (int64_t row = first; row < rows; row += n_warps) {
    const T* x = dout + row * d;
    Top2 top{0.0f, 0.0f, -1, -1};
    for (int64_t c = lane; c < d; c += kWarp) top.offer(fabsf(widen(x[c])), c);
#pragma unroll
    for (int off = kWarp / 2; off > 0; off /= 2) {
      const float m1 = __shfl_xor_sync(0xffffffffu, top.m1, off);
      const float m2 = __shfl_xor_sync(0xffffffffu, top.m2, off);
      const int64_t i1 = __shfl_xor_sync(0xffffffffu, static_cast<long long>(top.i1), off);
      const int64_t i2 = __shfl_xor_sync(0xffffffffu, static_cast<long long>(top.i2), off);
      top.offer(m1, i1);
      top.offer(m2, i2);
    }
    float at1 = widen(x[top.i1]);
    float at2 = widen(x[top.i2]);
    at1 += at1 == 0.0f ? 1.0f : 0.0f;  // the torch form's `at += at == 0`
    at2 += at2 == 0.0f ? 1.0f : 0.0f;
    const float dl = delta[row];
    T hi, lo, share;
    narrow(__fdiv_rn(dl, at1), &hi);
    narrow(0.0f, &share);
    // Uniform across the warp (every lane holds the row's top two and delta): delta / dout_k
    // overflows the 16-bit type (fp16 outputs whose magnitudes sum past 65504). Every entry
    // then carries sign(dout_c) * share, share = round(delta / sum |dout|) (at most the row's
    // largest |out|), and the top two add what that misses, the second what the first's
    // rounding misses. The torch form sums |dout| in another order: these rows match it to a
    // rounding of share, not to the bit.
    const bool spread = isinf(widen(hi)) && isfinite(dl);
    if (spread) {
      float s_all = 0.0f;
      for (int64_t c = lane; c < d; c += kWarp) s_all = __fadd_rn(s_all, fabsf(widen(x[c])));
#pragma unroll
      for (int off = kWarp / 2; off > 0; off /= 2) s_all = __fadd_rn(s_all, __shfl_xor_sync(0xffffffffu, s_all, off));
      narrow(__fdiv_rn(dl, s_all), &share);
      const float sh = widen(share);
      const float b1 = __fmul_rn(sign_of(widen(x[top.i1])), sh);
      const float b2 = __fmul_rn(sign_of(widen(x[top.i2])), sh);
      const float big = max_of(share);  // near it, a share rounded down leaves more than one entry takes
      float r = __fsub_rn(dl, __fmul_rn(sh, s_all));
      narrow(fminf(fmaxf(__fadd_rn(b1, __fdiv_rn(r, at1)), -big), big), &hi);
      r = __fsub_rn(r, __fmul_rn(at1, __fsub_rn(widen(hi), b1)));
      narrow(fminf(fmaxf(__fadd_rn(b2, __fdiv_rn(r, at2)), -big), big), &lo);
    } else {
      const float rest = __fsub_rn(dl, __fmul_rn(at1, widen(hi)));
      narrow(__fdiv_rn(rest, at2), &lo);
    }
    T zero;
    narrow(0.0f, &zero);
    T* y = out + row * d;
    for (int64_t c = lane; c < d; c += kWarp) {
      T other = zero;
      if (spread) narrow(__fmul_rn(sign_of(widen(x[c])), widen(share)), &other);
      y[c] = c == top.i1 ? hi : (c == top.i2 ? lo : other);
    }
  }
}

template <typename T>
cudaError_t launch_typed(void* out, const void* dout, const float* delta, int64_t rows, int64_t d, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  unsigned int blocks = 0;
  const cudaError_t err = grid_for(rows * kWarp, &blocks);
  if (err != cudaSuccess) return err;
  stand_in_kernel<T><<<blocks, kThreads, 0, stream>>>(
      static_cast<T*>(out), static_cast<const T*>(dout), delta, rows, d);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_stand_in(
    void* out, const void* dout, const float* delta, Dtype dtype, int64_t rows, int64_t d, cudaStream_t stream) {
  if (d < 2) return cudaErrorInvalidValue;  // two entries per row: the caller's torch form covers d < 2
  switch (dtype) {
    case Dtype::kFloat16:
      return launch_typed<__half>(out, dout, delta, rows, d, stream);
    case Dtype::kBFloat16:
      return launch_typed<__nv_bfloat16>(out, dout, delta, rows, d, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace megatron_cp_ext
