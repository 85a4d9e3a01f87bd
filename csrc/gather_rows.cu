// gather_rows: out[n] = x[idx[n]] along dim 0 — the THD reorder a plan uses to pack
// non-contiguous token ranges into one buffer for a varlen attention call.
//
// Rows are moved as raw bytes, so every dtype shares one kernel. The copy word is the
// widest of 16/8/4/2/1 bytes that divides the row size and both base pointers; packed
// activations (h * d * 2 bytes per row) almost always take the 16-byte path.

#include "kernels.h"
#include "launch.cuh"

namespace megatron_cp_ext {
namespace {

template <typename Word>
__global__ void gather_rows_kernel(
    const Word* __restrict__ x,
    const int64_t* __restrict__ idx,
    Word* __restrict__ out,
    int64_t n_rows,
    int64_t row_words,
    int64_t src_rows) {
  const int64_t total = n_rows * row_words;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += stride) {
    const int64_t row = i / row_words;
    const int64_t src = idx[row];
    MCX_DEVICE_CHECK(src >= 0 && src < src_rows, "gather_rows: index out of range");
    out[i] = x[src * row_words + (i - row * row_words)];
  }
}

template <typename Word>
cudaError_t launch(
    const void* x,
    const int64_t* idx,
    void* out,
    int64_t n_rows,
    int64_t row_bytes,
    int64_t src_rows,
    cudaStream_t stream) {
  const int64_t row_words = row_bytes / static_cast<int64_t>(sizeof(Word));
  unsigned int blocks = 0;
  const cudaError_t err = grid_for(n_rows * row_words, &blocks);
  if (err != cudaSuccess) return err;
  gather_rows_kernel<Word><<<blocks, kThreads, 0, stream>>>(
      static_cast<const Word*>(x), idx, static_cast<Word*>(out), n_rows, row_words, src_rows);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_gather_rows(
    const void* x,
    const int64_t* idx,
    void* out,
    int64_t n_rows,
    int64_t row_bytes,
    int64_t src_rows,
    cudaStream_t stream) {
  if (n_rows == 0 || row_bytes == 0) return cudaSuccess;
  auto fits = [&](int64_t w) {
    return row_bytes % w == 0 && aligned_to(x, w) && aligned_to(out, w);
  };
  if (fits(16)) return launch<uint4>(x, idx, out, n_rows, row_bytes, src_rows, stream);
  if (fits(8)) return launch<uint2>(x, idx, out, n_rows, row_bytes, src_rows, stream);
  if (fits(4)) return launch<uint32_t>(x, idx, out, n_rows, row_bytes, src_rows, stream);
  if (fits(2)) return launch<uint16_t>(x, idx, out, n_rows, row_bytes, src_rows, stream);
  return launch<uint8_t>(x, idx, out, n_rows, row_bytes, src_rows, stream);
}

}  // namespace megatron_cp_ext
