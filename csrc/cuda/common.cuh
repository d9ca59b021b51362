// Shared device helpers of the CUDA backend: type conversion, staging copies into shared memory,
// block reductions and launch sizing.
#pragma once

// Only c10's CUDA headers: ATen/cuda/CUDAContext.h would also need the cuBLAS and cuSPARSE
// headers, which a compile-only toolkit may lack.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>

namespace pullback {
namespace cuda {
namespace detail {

constexpr int kWarpSize = 32;
// Dynamic shared memory one block may use without the opt-in attribute.
constexpr int64_t kMaxDynamicSmem = 48 * 1024;

// Converts a stored element to an accumulator type (Half/BFloat16 go through float, which also
// avoids ambiguous conversions from the reduced types straight to double).
template <typename Acc, typename T>
__device__ __forceinline__ Acc to_acc(T x) {
  return static_cast<Acc>(static_cast<at::opmath_type<T>>(x));
}

// Converts an accumulator back to the stored type (through the type's own opmath type).
template <typename T, typename Acc>
__device__ __forceinline__ T from_acc(Acc x) {
  return static_cast<T>(static_cast<at::opmath_type<T>>(x));
}

template <typename Acc>
__device__ __forceinline__ Acc warp_sum(Acc v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v += __shfl_down_sync(0xffffffffu, v, offset);
  }
  return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); the result is valid in
// thread 0. `scratch` holds at least 32 values. Fixed reduction order: deterministic.
template <typename Acc>
__device__ __forceinline__ Acc block_sum(Acc v, Acc* scratch) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = (threadIdx.x < num_warps) ? scratch[lane] : Acc(0);
  if (warp == 0) v = warp_sum(v);
  return v;
}

// Copies n contiguous elements from global memory into 16-byte-aligned shared memory with the
// whole block, in 16-byte vectors when the source is 16-byte aligned.
template <typename T>
__device__ __forceinline__ void stage_to_shared(T* __restrict__ dst, const T* __restrict__ src,
                                                int n) {
  constexpr int kVec = 16 / sizeof(T);
  int start = 0;
  if (reinterpret_cast<uintptr_t>(src) % 16 == 0) {
    const int num_vec = n / kVec;
    const uint4* src4 = reinterpret_cast<const uint4*>(src);
    uint4* dst4 = reinterpret_cast<uint4*>(dst);
#pragma unroll 4
    for (int i = threadIdx.x; i < num_vec; i += blockDim.x) dst4[i] = __ldg(src4 + i);
    start = num_vec * kVec;
  }
  for (int i = start + threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

__host__ __device__ constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

__host__ __device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

__host__ __device__ constexpr int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

inline int num_sms() {
  int count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount,
                                        c10::cuda::current_device()));
  return count;
}

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// Upper bound on the partial-sum workspace of the chunked reductions, in accumulator elements.
constexpr int64_t kMaxPartialElements = int64_t(1) << 24;

// How many blocks of `kernel` (`threads` threads, `smem` bytes of dynamic shared memory) one
// multiprocessor of the current device holds at once, as limited by registers, shared memory and
// threads (at least 1). The answer only depends on those four, so it is computed once for each.
template <typename Kernel>
int resident_blocks_per_sm(Kernel kernel, int threads, int64_t smem) {
  static std::mutex mutex;
  static std::map<std::tuple<Kernel, int, int, int64_t>, int> cache;
  const auto key = std::make_tuple(kernel, static_cast<int>(c10::cuda::current_device()), threads, smem);
  const std::lock_guard<std::mutex> lock(mutex);
  const auto found = cache.find(key);
  if (found != cache.end()) return found->second;
  int blocks = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads,
                                                               static_cast<size_t>(smem)));
  return cache[key] = blocks > 0 ? blocks : 1;
}

// Splits `rows` rows of each of `batch` grid entries into equal chunks (a multiple of `tile`
// rows each) so that the grid is at most one wave of `blocks_per_sm` blocks per multiprocessor
// (resident_blocks_per_sm of the kernel), or one chunk per entry when there are more entries.
// A grid of more blocks than fit at once ends in a partial wave that leaves most
// multiprocessors idle. At most `max_chunks` chunks per entry (a cap on the partial sums of the
// reductions).
inline int64_t rows_per_chunk(int64_t rows, int64_t batch, int64_t tile, int blocks_per_sm,
                              int64_t max_chunks = INT64_MAX) {
  const int64_t target_blocks = static_cast<int64_t>(num_sms()) * blocks_per_sm;
  const int64_t chunks_per_batch =
      std::max<int64_t>(1, std::min(max_chunks, target_blocks / batch));
  return round_up(std::max<int64_t>(1, ceil_div(rows, chunks_per_batch)), tile);
}

}  // namespace detail
}  // namespace cuda
}  // namespace pullback

#define PULLBACK_DISPATCH_FLOATING(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16, TYPE, NAME, __VA_ARGS__)
