// Device-side helpers shared by the kernels: grid sizing, an always-on index check, and
// the small vector type used for wide loads and stores.
#pragma once

#include <algorithm>
#include <cassert>
#include <cstdint>

#include <cuda_runtime.h>

namespace megatron_cp_ext {

constexpr int kThreads = 256;

// Out-of-range plan indices are a caller bug; report them like torch's device asserts do
// (also when NDEBUG is set, since a silent out-of-bounds read would corrupt results).
#define MCX_DEVICE_CHECK(cond, msg)                                          \
  do {                                                                       \
    if (!(cond)) {                                                           \
      __assert_fail(msg, __FILE__, static_cast<unsigned>(__LINE__), __func__); \
    }                                                                        \
  } while (0)

// Kernels use grid-stride loops: enough blocks to fill the device, never more than the work.
inline cudaError_t grid_for(int64_t work_items, unsigned int* blocks) {
  int device = 0;
  int sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  }
  const int64_t needed = (work_items + kThreads - 1) / kThreads;
  *blocks = static_cast<unsigned int>(
      std::max<int64_t>(1, std::min<int64_t>(needed, int64_t{std::max(sms, 1)} * 16)));
  return err;
}

inline bool aligned_to(const void* p, int64_t bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % static_cast<std::uintptr_t>(bytes) == 0;
}

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

}  // namespace megatron_cp_ext
