// CUDA kernel of select_with_partners (the greedy choice of merge sources that spares the partner
// of every source it takes, csrc/partner_selection.h).
//
// One block per image: the block stages the image's order and partners into shared memory (as
// 32-bit indices, an index out of range becoming -1), then one thread runs the sequential greedy
// there, so each of its dependent steps is a shared-memory access instead of a global one. Rows
// too long for shared memory run on the operands in global memory with a scratch tensor.
#include <torch/library.h>

#include <climits>

#include "common.cuh"
#include "invariants.h"
#include "partner_selection.h"

namespace pullback {
namespace cuda {

namespace {

constexpr int kStageThreads = 128;
// Shared bytes per token: order and partner as int32, and the two flags of the greedy.
constexpr int64_t kSharedBytesPerToken = 2 * sizeof(int32_t) + 2;

__device__ __forceinline__ int32_t narrow_index(int64_t t, int64_t n) {
  return t >= 0 && t < n ? static_cast<int32_t>(t) : -1;
}

// scratch == nullptr: the row fits in shared memory; else 2·n bytes of scratch per image.
__global__ void select_with_partners_kernel(const int64_t* __restrict__ order,
                                            const int64_t* __restrict__ partner, int64_t n,
                                            int64_t count, int64_t* __restrict__ out,
                                            uint8_t* __restrict__ scratch) {
  extern __shared__ __align__(16) unsigned char shared[];
  const int64_t b = blockIdx.x;
  const int64_t* row_order = order + b * n;
  const int64_t* row_partner = partner + b * n;
  int64_t* row_out = out + b * count;
  if (scratch != nullptr) {
    if (threadIdx.x == 0) {
      uint8_t* flags = scratch + 2 * b * n;
      select_with_partners_row(row_order, row_partner, n, count, flags, flags + n, row_out);
    }
    return;
  }
  int32_t* staged_order = reinterpret_cast<int32_t*>(shared);
  int32_t* staged_partner = staged_order + n;
  uint8_t* flags = reinterpret_cast<uint8_t*>(staged_partner + n);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    staged_order[i] = narrow_index(row_order[i], n);
    staged_partner[i] = narrow_index(row_partner[i], n);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    select_with_partners_row(staged_order, staged_partner, n, count, flags, flags + n, row_out);
  }
}

at::Tensor select_with_partners(const at::Tensor& order_in, const at::Tensor& partner_in,
                                int64_t count) {
  expect_selection_operands(order_in, partner_in, count);
  const c10::cuda::CUDAGuard guard(order_in.device());
  const at::Tensor order = order_in.contiguous(), partner = partner_in.contiguous();
  const int64_t B = order.size(0), n = order.size(1);
  at::Tensor out = at::empty({B, count}, order.options());
  if (out.numel() == 0) return out;
  const int64_t smem = n * kSharedBytesPerToken;
  const bool staged = smem <= detail::kMaxDynamicSmem;
  at::Tensor scratch;
  if (!staged) scratch = at::empty({B, 2 * n}, order.options().dtype(at::kByte));
  select_with_partners_kernel<<<static_cast<unsigned>(B), kStageThreads, staged ? smem : 0,
                                detail::current_stream()>>>(
      order.data_ptr<int64_t>(), partner.data_ptr<int64_t>(), n, count, out.data_ptr<int64_t>(),
      staged ? nullptr : scratch.data_ptr<uint8_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

}  // namespace cuda
}  // namespace pullback

TORCH_LIBRARY_IMPL(pullback_ext, CUDA, m) {
  m.impl("select_with_partners", &pullback::cuda::select_with_partners);
}
