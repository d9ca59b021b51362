// CUDA kernels of the token operations: gather, weighted merge (ToMe-style scatter-average with
// weight tracking) and the reinsertion of pruned tokens at their original positions.
//
// Gather and reinsert are row copies (one warp per token row, 16-byte vectors when aligned).
// Merge is deterministic without floating-point atomics: a planning kernel builds, per batch
// row, the kept-token order (exclusive scan over N) and for every kept token the list of the
// sources merged into it (sorted by their position in src_idx); a second kernel then computes
// every output row once as a gather.
//
// Unchecked calls (check_values=False) may pass invalid indices; the kernels never address memory
// outside their operands then (results unspecified): see GatherRows, ReinsertRows and
// merge_plan_kernel.
#include <torch/library.h>

#include <climits>

#include "common.cuh"
#include "invariants.h"

namespace pullback {
namespace cuda {

namespace {

constexpr int kCopyThreads = 256;
constexpr int kCopyUnroll = 8;
constexpr int kPlanThreads = 256;
constexpr int kMergeThreads = 256;

// Where row q of a gather comes from and goes to. An index out of range (unchecked input) gives
// src = nullptr (the row is filled with NaN) instead of an out-of-bounds read.
template <typename T>
struct GatherRows {
  const T* x;
  const int64_t* idx;
  T* out;
  int64_t K, N, D;
  __device__ void operator()(int64_t q, const T*& src, T*& dst) const {
    const int64_t b = q / K;
    const int64_t t = idx[q];
    src = (t >= 0 && t < N) ? x + (b * N + t) * D : nullptr;
    dst = out + q * D;
  }
};

// Rows 0..K-1 of each batch entry come from `kept`, rows K..K+R-1 from `pruned`; a position
// out of range (unchecked input) gives dst = nullptr and the row is skipped.
template <typename T>
struct ReinsertRows {
  const T* kept;
  const int64_t* kept_idx;
  const T* pruned;
  const int64_t* pruned_idx;
  T* out;
  int64_t K, R, D;
  __device__ void operator()(int64_t q, const T*& src, T*& dst) const {
    const int64_t total = K + R;
    const int64_t b = q / total;
    const int64_t i = q % total;
    const int64_t t = i < K ? kept_idx[b * K + i] : pruned_idx[b * R + i - K];
    src = i < K ? kept + (b * K + i) * D : pruned + (b * R + i - K) * D;
    dst = (t >= 0 && t < total) ? out + (b * total + t) * D : nullptr;
  }
};

// One warp per row; kVector: rows are 16-byte aligned and a whole number of 16-byte vectors.
template <typename T, bool kVector, typename RowMap>
__global__ void __launch_bounds__(kCopyThreads)
    copy_rows_kernel(RowMap map, int64_t num_rows, int64_t row_len) {
  const int lane = threadIdx.x % detail::kWarpSize;
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / detail::kWarpSize;
  for (int64_t q = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / detail::kWarpSize;
       q < num_rows; q += warps) {
    const T* src;
    T* dst;
    map(q, src, dst);
    if (dst == nullptr) continue;
    if (src == nullptr) {
      const T nan = detail::from_acc<T>(__int_as_float(0x7fc00000));
      for (int64_t i = lane; i < row_len; i += detail::kWarpSize) dst[i] = nan;
      continue;
    }
    if (kVector) {
      // All of a lane's loads (up to kCopyUnroll) are issued before its first store: one row's
      // copy is then a single memory round trip rather than one per 512 bytes.
      const int64_t num_vec = row_len * int64_t(sizeof(T)) / 16;
      const uint4* src4 = reinterpret_cast<const uint4*>(src);
      uint4* dst4 = reinterpret_cast<uint4*>(dst);
      for (int64_t i0 = lane; i0 < num_vec; i0 += kCopyUnroll * detail::kWarpSize) {
        uint4 buf[kCopyUnroll];
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) {
          const int64_t i = i0 + u * detail::kWarpSize;
          if (i < num_vec) buf[u] = __ldg(src4 + i);
        }
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) {
          const int64_t i = i0 + u * detail::kWarpSize;
          if (i < num_vec) dst4[i] = buf[u];
        }
      }
    } else {
      for (int64_t i = lane; i < row_len; i += detail::kWarpSize) dst[i] = src[i];
    }
  }
}

template <typename T, typename RowMap>
void launch_copy_rows(const RowMap& map, int64_t num_rows, int64_t row_len, bool aligned) {
  if (num_rows == 0 || row_len == 0) return;
  const int64_t warps_per_block = kCopyThreads / detail::kWarpSize;
  const int64_t blocks = std::min<int64_t>(detail::ceil_div(num_rows, warps_per_block),
                                           int64_t(detail::num_sms()) * 32);
  const bool vector = aligned && (row_len * int64_t(sizeof(T))) % 16 == 0;
  const cudaStream_t stream = detail::current_stream();
  if (vector) {
    copy_rows_kernel<T, true, RowMap><<<static_cast<unsigned>(blocks), kCopyThreads, 0, stream>>>(
        map, num_rows, row_len);
  } else {
    copy_rows_kernel<T, false, RowMap><<<static_cast<unsigned>(blocks), kCopyThreads, 0, stream>>>(
        map, num_rows, row_len);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

bool aligned16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

// Exclusive prefix sum over one block-sized tile (blockDim.x a multiple of 32); `tile_total`
// receives the sum of the whole tile. Every thread of the block must call it.
__device__ int block_exclusive_scan(int value, int* warp_sums, int& tile_total) {
  const int lane = threadIdx.x % detail::kWarpSize;
  const int warp = threadIdx.x / detail::kWarpSize;
  const int num_warps = blockDim.x / detail::kWarpSize;
  int inclusive = value;
#pragma unroll
  for (int offset = 1; offset < detail::kWarpSize; offset *= 2) {
    const int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  if (lane == detail::kWarpSize - 1) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    const int mine = lane < num_warps ? warp_sums[lane] : 0;
    int scanned = mine;
#pragma unroll
    for (int offset = 1; offset < detail::kWarpSize; offset *= 2) {
      const int other = __shfl_up_sync(0xffffffffu, scanned, offset);
      if (lane >= offset) scanned += other;
    }
    warp_sums[lane] = scanned;
  }
  __syncthreads();
  const int exclusive = (warp > 0 ? warp_sums[warp - 1] : 0) + inclusive - value;
  tile_total = warp_sums[num_warps - 1];
  __syncthreads();
  return exclusive;
}

// Per-row merge plan in the int32 workspace (see MergePlanLayout). One block per batch row.
struct MergePlanLayout {
  int64_t N, R;
  __host__ __device__ int64_t kept() const { return N - R; }
  // pos[N]: new index of each kept token | kept_src[N-R]: original index of each kept token |
  // offsets[N-R+1]: start of each kept token's source list | dst_pos[R] | sources[R]
  __host__ __device__ int64_t stride() const { return N + kept() + kept() + 1 + R + R; }
};

__global__ void __launch_bounds__(kPlanThreads)
    merge_plan_kernel(const int64_t* __restrict__ src_idx, const int64_t* __restrict__ dst_idx,
                      int* __restrict__ workspace, MergePlanLayout layout) {
  __shared__ int warp_sums[detail::kWarpSize];
  const int N = static_cast<int>(layout.N);
  const int R = static_cast<int>(layout.R);
  const int M = static_cast<int>(layout.kept());
  const int64_t b = blockIdx.x;
  int* pos = workspace + b * layout.stride();
  int* kept_src = pos + N;
  int* offsets = kept_src + M;
  int* dst_pos = offsets + M + 1;
  int* sources = dst_pos + R;
  const int64_t* src = src_idx + b * R;
  const int64_t* dst = dst_idx + b * R;

  for (int n = threadIdx.x; n < N; n += blockDim.x) pos[n] = 0;
  for (int j = threadIdx.x; j <= M; j += blockDim.x) offsets[j] = 0;
  __syncthreads();
  // Indices out of range (possible only in unchecked calls) are dropped wherever they occur, so
  // that no access leaves the arrays.
  for (int i = threadIdx.x; i < R; i += blockDim.x) {
    const int64_t s = src[i];
    if (s >= 0 && s < N) pos[s] = 1;
  }
  __syncthreads();

  // Kept tokens in their original order: pos[n] = number of kept tokens before n, -1 for a
  // merged token. (A repeated source leaves more than M kept tokens; those past M are dropped.)
  int carry = 0;
  for (int base = 0; base < N; base += blockDim.x) {
    const int n = base + threadIdx.x;
    const int keep = n < N ? 1 - pos[n] : 0;
    int tile_total;
    const int before = carry + block_exclusive_scan(keep, warp_sums, tile_total);
    if (n < N) {
      pos[n] = keep ? before : -1;
      if (keep && before < M) kept_src[before] = n;
    }
    carry += tile_total;
  }
  __syncthreads();

  for (int i = threadIdx.x; i < R; i += blockDim.x) {
    const int64_t s = src[i], d = dst[i];
    int j = (d >= 0 && d < N) ? pos[d] : -1;
    if (j >= M || s < 0 || s >= N) j = -1;
    dst_pos[i] = j;
    if (j >= 0) atomicAdd(offsets + j, 1);
  }
  __syncthreads();

  carry = 0;
  for (int base = 0; base < M; base += blockDim.x) {
    const int j = base + threadIdx.x;
    const int count = j < M ? offsets[j] : 0;
    int tile_total;
    const int before = carry + block_exclusive_scan(count, warp_sums, tile_total);
    if (j < M) offsets[j] = before;
    carry += tile_total;
  }
  if (threadIdx.x == 0) offsets[M] = carry;  // R when every index is valid
  __syncthreads();

  // Source i goes after the earlier sources of the same destination: lists sorted by i, so the
  // summation order below does not depend on scheduling.
  for (int i = threadIdx.x; i < R; i += blockDim.x) {
    const int j = dst_pos[i];
    if (j < 0) continue;
    int rank = 0;
    for (int earlier = 0; earlier < i; ++earlier) rank += dst_pos[earlier] == j;
    sources[offsets[j] + rank] = i;
  }
}

// One warp per kept token: x'_j = (w_d x_d + Σ_s w_s x_s) / (w_d + Σ_s w_s), w'_j = w_d + Σ_s w_s;
// a token without sources (or with zero total weight) keeps its features unchanged.
template <typename T>
__global__ void __launch_bounds__(kMergeThreads)
    merge_apply_kernel(const T* __restrict__ x, const T* __restrict__ w,
                       const int64_t* __restrict__ src_idx, const int* __restrict__ workspace,
                       T* __restrict__ x_out, T* __restrict__ w_out, int64_t B, int64_t D,
                       MergePlanLayout layout) {
  using Acc = at::opmath_type<T>;
  const int lane = threadIdx.x % detail::kWarpSize;
  const int64_t N = layout.N, R = layout.R, M = layout.kept();
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / detail::kWarpSize;
  for (int64_t q = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / detail::kWarpSize;
       q < B * M; q += warps) {
    const int64_t b = q / M;
    const int64_t j = q % M;
    const int* plan = workspace + b * layout.stride();
    const int* kept_src = plan + N;
    const int* offsets = kept_src + M;
    const int* sources = offsets + M + 1 + R;
    const int64_t* src = src_idx + b * R;
    const T* xb = x + b * N * D;
    const T* wb = w + b * N;

    const int64_t n = kept_src[j];
    const int begin = offsets[j];
    const int end = offsets[j + 1];
    const Acc w_dst = detail::to_acc<Acc>(wb[n]);
    Acc total = w_dst;
    for (int s = begin; s < end; ++s) total += detail::to_acc<Acc>(wb[src[sources[s]]]);
    if (lane == 0) w_out[q] = detail::from_acc<T>(total);

    const T* x_dst = xb + n * D;
    T* out = x_out + q * D;
    if (begin == end || !(total > Acc(0))) {
      for (int64_t d = lane; d < D; d += detail::kWarpSize) out[d] = x_dst[d];
      continue;
    }
    const Acc inv_total = Acc(1) / total;
    for (int64_t d = lane; d < D; d += detail::kWarpSize) {
      Acc acc = w_dst * detail::to_acc<Acc>(x_dst[d]);
      for (int s = begin; s < end; ++s) {
        const int64_t token = src[sources[s]];
        acc += detail::to_acc<Acc>(wb[token]) * detail::to_acc<Acc>(xb[token * D + d]);
      }
      out[d] = detail::from_acc<T>(acc * inv_total);
    }
  }
}

at::Tensor gather_tokens(const at::Tensor& x_in, const at::Tensor& idx_in) {
  expect_tensor("gather_tokens", x_in, "x", {-1, -1, -1}, x_in.device(), x_in.scalar_type());
  expect_tensor("gather_tokens", idx_in, "idx", {x_in.size(0), -1}, x_in.device(), at::kLong);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), idx = idx_in.contiguous();
  const int64_t B = x.size(0), N = x.size(1), D = x.size(2), K = idx.size(1);
  at::Tensor out = at::empty({B, K, D}, x.options());
  if (out.numel() == 0) return out;
  PULLBACK_DISPATCH_FLOATING(x.scalar_type(), "pullback_cuda_gather_tokens", [&] {
    const GatherRows<scalar_t> map{x.data_ptr<scalar_t>(), idx.data_ptr<int64_t>(),
                                   out.data_ptr<scalar_t>(), K, N, D};
    launch_copy_rows<scalar_t>(map, B * K, D, aligned16(x) && aligned16(out));
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> merge_tokens(const at::Tensor& x_in, const at::Tensor& w_in,
                                                const at::Tensor& src_in,
                                                const at::Tensor& dst_in) {
  expect_merge_operands(x_in, w_in, src_in, dst_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const at::Tensor src_idx = src_in.contiguous(), dst_idx = dst_in.contiguous();
  const int64_t B = x.size(0), N = x.size(1), D = x.size(2), R = src_idx.size(1);
  const MergePlanLayout layout{N, R};
  at::Tensor x_out = at::empty({B, N - R, D}, x.options());
  at::Tensor w_out = at::empty({B, N - R}, x.options());
  if (B == 0 || N == R) return {x_out, w_out};

  const at::Tensor workspace = at::empty({B, layout.stride()}, x.options().dtype(at::kInt));
  const cudaStream_t stream = detail::current_stream();
  merge_plan_kernel<<<static_cast<unsigned>(B), kPlanThreads, 0, stream>>>(
      src_idx.data_ptr<int64_t>(), dst_idx.data_ptr<int64_t>(), workspace.data_ptr<int>(), layout);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  const int64_t warps_per_block = kMergeThreads / detail::kWarpSize;
  const int64_t blocks = std::min<int64_t>(detail::ceil_div(B * (N - R), warps_per_block),
                                           int64_t(detail::num_sms()) * 32);
  PULLBACK_DISPATCH_FLOATING(x.scalar_type(), "pullback_cuda_merge_tokens", [&] {
    merge_apply_kernel<scalar_t><<<static_cast<unsigned>(blocks), kMergeThreads, 0, stream>>>(
        x.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), src_idx.data_ptr<int64_t>(),
        workspace.data_ptr<int>(), x_out.data_ptr<scalar_t>(), w_out.data_ptr<scalar_t>(), B, D,
        layout);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {x_out, w_out};
}

at::Tensor reinsert_tokens(const at::Tensor& kept_in, const at::Tensor& kept_idx_in,
                           const at::Tensor& pruned_in, const at::Tensor& pruned_idx_in) {
  expect_reinsert_operands(kept_in, kept_idx_in, pruned_in, pruned_idx_in);
  const c10::cuda::CUDAGuard guard(kept_in.device());
  const at::Tensor kept = kept_in.contiguous(), pruned = pruned_in.contiguous();
  const at::Tensor kept_idx = kept_idx_in.contiguous(), pruned_idx = pruned_idx_in.contiguous();
  const int64_t B = kept.size(0), K = kept.size(1), D = kept.size(2), R = pruned.size(1);
  at::Tensor out = at::empty({B, K + R, D}, kept.options());
  if (out.numel() == 0) return out;
  PULLBACK_DISPATCH_FLOATING(kept.scalar_type(), "pullback_cuda_reinsert_tokens", [&] {
    const ReinsertRows<scalar_t> map{kept.data_ptr<scalar_t>(), kept_idx.data_ptr<int64_t>(),
                                     pruned.data_ptr<scalar_t>(), pruned_idx.data_ptr<int64_t>(),
                                     out.data_ptr<scalar_t>(), K, R, D};
    launch_copy_rows<scalar_t>(map, B * (K + R), D,
                               aligned16(kept) && aligned16(pruned) && aligned16(out));
  });
  return out;
}

}  // namespace

}  // namespace cuda
}  // namespace pullback

TORCH_LIBRARY_IMPL(pullback_ext, CUDA, m) {
  m.impl("gather_tokens", &pullback::cuda::gather_tokens);
  m.impl("merge_tokens", &pullback::cuda::merge_tokens);
  m.impl("reinsert_tokens", &pullback::cuda::reinsert_tokens);
}
