// CUDA kernel of agglomerate (the greedy agglomeration of ATC and importance_cluster,
// csrc/agglomeration.h).
//
// One block per image, the image's matrices in a global scratch tensor. The block keeps each row's
// least entry (the first one on ties), as the CPU kernel does; a step is: the closest pair (a
// block reduction over the cached row minima), the merged cluster's line computed from the rows of
// a and z into a buffer, then written to row and column a (row and column z to inf), then the
// cached minima: each thread updates its rows, rescanning a row whose minimum sat at a or z; the
// block rescans row a together. Every value is rounded as the reference rounds it, so the
// decisions are the CPU kernel's and the reference's.
#include <torch/library.h>

#include <climits>

#include "agglomeration.h"
#include "common.cuh"
#include "invariants.h"

namespace pullback {
namespace cuda {

namespace {

using namespace agglomeration;

constexpr int kThreads = 256;

// The first least (value, index) pair over the block; every thread gets it. `values` and `at` hold
// one entry per warp.
template <typename T>
__device__ void block_first_min(T& value, int& index, T* values, int* at) {
  const int lane = threadIdx.x % detail::kWarpSize, warp = threadIdx.x / detail::kWarpSize;
  const int num_warps = blockDim.x / detail::kWarpSize;
#pragma unroll
  for (int offset = detail::kWarpSize / 2; offset > 0; offset /= 2) {
    const T other = __shfl_down_sync(0xffffffffu, value, offset);
    const int other_index = __shfl_down_sync(0xffffffffu, index, offset);
    if (before_at(other, other_index, value, index)) {
      value = other;
      index = other_index;
    }
  }
  if (lane == 0) {
    values[warp] = value;
    at[warp] = index;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < num_warps; ++w) {
      if (before_at(values[w], at[w], values[0], at[0])) {
        values[0] = values[w];
        at[0] = at[w];
      }
    }
  }
  __syncthreads();
  value = values[0];
  index = at[0];
  __syncthreads();
}

// The first least entry of `row` [n] by the whole block (every thread gets it).
template <typename T>
__device__ void block_scan_row(const T* row, int n, T& least_value, int& at, T* values, int* indices) {
  least_value = infinity<T>();
  at = INT_MAX;
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    if (before_at(row[j], j, least_value, at)) {
      least_value = row[j];
      at = j;
    }
  }
  block_first_min(least_value, at, values, indices);
}

template <typename T>
struct Scratch {
  T* matrix;   // [B, n, n] the values compared
  T* second;   // [B, n, n] average: summed member distances; bound: squared centre distances
  T* size;     // [B, n]
  T* energy;   // [B, n]
  T* row_min;  // [B, n]
  T* line;     // [B, n] the merged cluster's new values
  T* line2;    // [B, n] its new entries of `second`
  int* row_arg;      // [B, n]
  uint8_t* active;   // [B, n]
};

template <typename T>
__global__ void agglomerate_kernel(const T* __restrict__ dist, const T* __restrict__ sizes,
                                   const T* __restrict__ energies, int n, int count, int linkage,
                                   Scratch<T> s, int64_t* __restrict__ owner_out) {
  __shared__ T reduce_values[detail::kWarpSize];
  __shared__ int reduce_at[detail::kWarpSize];
  __shared__ T merged[5];  // sa, sz, s, e, daz
  const int64_t b = blockIdx.x;
  const int64_t nn = static_cast<int64_t>(n) * n;
  const T* d = dist + b * nn;
  T* m = s.matrix + b * nn;
  T* v = s.second == nullptr ? nullptr : s.second + b * nn;
  T* size = s.size + b * n;
  T* energy = s.energy + b * n;
  T* row_min = s.row_min + b * n;
  T* line = s.line + b * n;
  T* line2 = s.line2 + b * n;
  int* row_arg = s.row_arg + b * n;
  uint8_t* active = s.active + b * n;
  int64_t* owner = owner_out + b * n;
  const bool bound = linkage == kBound;

  for (int t = threadIdx.x; t < n; t += blockDim.x) {
    size[t] = bound ? sizes[b * n + t] : T(1);
    energy[t] = bound ? energies[b * n + t] : T(0);
    active[t] = 1;
    owner[t] = t;
  }
  __syncthreads();
  if (count >= n) return;
  for (int64_t idx = threadIdx.x; idx < nn; idx += blockDim.x) {
    const int i = static_cast<int>(idx / n), j = static_cast<int>(idx % n);
    if (bound) {
      v[idx] = d[idx];
      m[idx] = i == j ? infinity<T>() : mul(bound_weight(energy[i], size[i], energy[j], size[j]), d[idx]);
    } else {
      m[idx] = d[idx];
      if (linkage == kAverage) v[idx] = d[idx];
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x) scan_row(m + static_cast<int64_t>(i) * n, n, row_min[i], row_arg[i]);
  __syncthreads();

  for (int step = 0; step < n - count; ++step) {
    T least_value = infinity<T>();
    int a = INT_MAX;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      if (before_at(row_min[i], i, least_value, a)) {
        least_value = row_min[i];
        a = i;
      }
    }
    block_first_min(least_value, a, reduce_values, reduce_at);
    const int z = row_arg[a];
    const int64_t ra = static_cast<int64_t>(a) * n, rz = static_cast<int64_t>(z) * n;
    if (threadIdx.x == 0) {
      if (bound) {
        merged[0] = size[a];
        merged[1] = size[z];
        merged[2] = add(size[a], size[z]);
        merged[3] = add(energy[a], energy[z]);
        merged[4] = v[ra + z];
        size[a] = merged[2];
        energy[a] = merged[3];
        active[z] = 0;
      } else if (linkage == kAverage) {
        size[a] = add(size[a], size[z]);
      }
    }
    __syncthreads();
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
      if (bound) {
        const T centre = centre_distance(merged[0], v[ra + j], merged[1], v[rz + j], merged[2], merged[4]);
        line2[j] = centre;
        line[j] = (active[j] && j != a) ? mul(bound_weight(merged[3], merged[2], energy[j], size[j]), centre)
                                        : infinity<T>();
      } else if (linkage == kAverage) {
        const T total = (j == a || j == z) ? infinity<T>() : add(v[ra + j], v[rz + j]);
        line2[j] = total;
        line[j] = total / mul(size[a], size[j]);
      } else {
        const T first = m[ra + j], second = m[rz + j];
        line[j] = (j == a || j == z) ? infinity<T>()
                                     : (linkage == kSingle ? least(first, second) : largest(first, second));
      }
    }
    __syncthreads();
    // Row and column z to inf, row and column a to the line; where they cross, both writes are inf.
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
      const int64_t rj = static_cast<int64_t>(j) * n;
      m[rz + j] = m[rj + z] = infinity<T>();
      m[ra + j] = m[rj + a] = line[j];
      if (linkage == kAverage) {
        v[rz + j] = v[rj + z] = infinity<T>();
        v[ra + j] = v[rj + a] = line2[j];
      } else if (bound) {
        v[ra + j] = v[rj + a] = line2[j];
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      if (i == z) {
        row_min[i] = infinity<T>();
        row_arg[i] = 0;
      } else if (i != a) {
        const int at = row_arg[i];
        const T* row = m + static_cast<int64_t>(i) * n;
        if (at == a || at == z || !(row_min[i] < infinity<T>())) {
          scan_row(row, n, row_min[i], row_arg[i]);
        } else if (before_at(row[a], a, row_min[i], at)) {
          row_min[i] = row[a];
          row_arg[i] = a;
        }
      }
      if (owner[i] == z) owner[i] = a;
    }
    __syncthreads();
    T row_least;
    int row_at;
    block_scan_row(m + ra, n, row_least, row_at, reduce_values, reduce_at);
    if (threadIdx.x == 0) {
      row_min[a] = row_least;
      row_arg[a] = row_at;
    }
    __syncthreads();
  }
}

at::Tensor agglomerate(const at::Tensor& dist_in, const std::optional<at::Tensor>& sizes_in,
                       const std::optional<at::Tensor>& energy_in, int64_t count, c10::string_view linkage_name) {
  const int linkage = expect_agglomeration_operands(dist_in, sizes_in, energy_in, count, linkage_name);
  const c10::cuda::CUDAGuard guard(dist_in.device());
  const at::Tensor dist = dist_in.contiguous();
  const int64_t B = dist.size(0), n = dist.size(1);
  at::Tensor owner = at::empty({B, n}, dist.options().dtype(at::kLong));
  if (owner.numel() == 0) return owner;
  const bool bound = linkage == kBound, with_second = bound || linkage == kAverage;
  const at::Tensor sizes = bound ? sizes_in->contiguous() : at::Tensor();
  const at::Tensor energy = bound ? energy_in->contiguous() : at::Tensor();
  at::Tensor matrices = at::empty({with_second ? 2 : 1, B, n, n}, dist.options());
  at::Tensor rows = at::empty({5, B, n}, dist.options());
  at::Tensor row_arg = at::empty({B, n}, dist.options().dtype(at::kInt));
  at::Tensor active = at::empty({B, n}, dist.options().dtype(at::kByte));
  AT_DISPATCH_FLOATING_TYPES(dist.scalar_type(), "pullback_ext::agglomerate", [&] {
    scalar_t* mat = matrices.data_ptr<scalar_t>();
    scalar_t* row = rows.data_ptr<scalar_t>();
    const int64_t per_row = B * n;
    Scratch<scalar_t> s{mat, with_second ? mat + B * n * n : nullptr, row, row + per_row, row + 2 * per_row,
                        row + 3 * per_row, row + 4 * per_row, row_arg.data_ptr<int>(), active.data_ptr<uint8_t>()};
    agglomerate_kernel<scalar_t><<<static_cast<unsigned>(B), kThreads, 0, detail::current_stream()>>>(
        dist.data_ptr<scalar_t>(), bound ? sizes.data_ptr<scalar_t>() : nullptr,
        bound ? energy.data_ptr<scalar_t>() : nullptr, static_cast<int>(n), static_cast<int>(count), linkage, s,
        owner.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return owner;
}

}  // namespace

}  // namespace cuda
}  // namespace pullback

TORCH_LIBRARY_IMPL(pullback_ext, CUDA, m) {
  m.impl("agglomerate", &pullback::cuda::agglomerate);
}
