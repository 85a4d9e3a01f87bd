// Raw-pointer launchers of the CUDA kernels.
//
// The .cu files see no torch headers at all: the torch-facing side (input checks, device
// guard, stream, allocation, op registration) lives in ops.cpp. That split keeps each kernel
// file a few seconds to compile and lets it be checked without a torch CUDA build.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace megatron_cp_ext {

enum class Dtype : int { kFloat32, kFloat16, kBFloat16, kFloat64 };

// out[n, :] = x[idx[n], :] over rows of `row_bytes` bytes; any dtype.
cudaError_t launch_gather_rows(
    const void* x,
    const int64_t* idx,
    void* out,
    int64_t n_rows,
    int64_t row_bytes,
    int64_t src_rows,
    cudaStream_t stream);

// acc[idx[n], :] += src[n, :] with atomics; acc is fp32 (src fp32/fp16/bf16) or src's dtype.
cudaError_t launch_index_add_rows(
    void* acc,
    Dtype acc_dtype,
    const int64_t* idx,
    const void* src,
    Dtype src_dtype,
    int64_t n_rows,
    int64_t row_numel,
    int64_t acc_rows,
    cudaStream_t stream);

// Online-softmax merge of part_out [n_rows, heads, head_dim] / part_lse [n_rows, heads] into
// out / lse at rows idx (nullptr: rows 0..n_rows-1). Distinct rows; fp32 math.
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
    cudaStream_t stream);

// out[r] = sum_d a[r, d] * b[r, d] in fp32 over rows of d 16-bit (fp16/bf16) values.
cudaError_t launch_row_dot(
    float* out, const void* a, const void* b, Dtype dtype, int64_t rows, int64_t d, cudaStream_t stream);

// out[r, :] = zeros but at the two largest |dout[r, :]| entries, which carry delta[r] (fp32)
// as dout's row dot (schedules/delta.py's stand-in); 16-bit dout, d >= 2.
cudaError_t launch_stand_in(
    void* out, const void* dout, const float* delta, Dtype dtype, int64_t rows, int64_t d, cudaStream_t stream);

}  // namespace megatron_cp_ext
