// The two tall-skinny primitives behind the low-rank metric ops and CholeskyQR2:
//
//   column products  out[b] = Aᵀ C          A[B,P,a], C[B,P,c]  (optionally also ‖C_{:,c}‖²)
//   row matmul       Y[b]   = alpha·V + A M  A[B,P,a], M[B,a,c], V[B,P,c]
//
// Both stream the long P dimension once, staging tiles of whole rows (contiguous in memory)
// into shared memory with 16-byte loads. Column products reduce in two deterministic stages:
// every block writes the partial sums of its chunk of rows, a second kernel adds the chunks in a
// fixed order. Shapes beyond the kernels' shared-memory envelope (thousands of columns, far
// outside this project's r <= ~128) are computed with ATen matmul instead.
#pragma once

#include "common.cuh"
#include "single_column.cuh"

#include <algorithm>

namespace pullback {
namespace cuda {
namespace detail {

constexpr int kProductThreads = 256;
// Each thread accumulates a kTile x kTile block of Aᵀ C plus kTile squared norms of C.
constexpr int kTile = 4;
constexpr int kTileValues = kTile * kTile + kTile;
constexpr int64_t kProductStageBytes = 40 * 1024;
constexpr int kMaxTileRows = 128;

constexpr int kMatmulThreads = 256;
constexpr int64_t kMatmulStageBytes = 16 * 1024;
constexpr int64_t kMatmulSharedMatrixBytes = 32 * 1024;

// Rows per shared-memory tile: at most kMaxTileRows, a multiple of 16 when possible so that tile
// starts stay 16-byte aligned; 0 when not even one row fits.
inline int tile_rows_for(int64_t row_bytes, int64_t budget) {
  int64_t rows = std::min<int64_t>(kMaxTileRows, budget / std::max<int64_t>(row_bytes, 1));
  if (rows >= 16) rows = rows / 16 * 16;
  return static_cast<int>(rows);
}

template <typename T, typename Acc, bool kNorms>
__global__ void __launch_bounds__(kProductThreads)
    column_products_partial_kernel(const T* __restrict__ A, const T* __restrict__ C,
                                   Acc* __restrict__ partial, int64_t P, int a, int c, bool same,
                                   int64_t rows_per_chunk, int chunks_per_batch, int tile_rows,
                                   int n_out) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int64_t b = blockIdx.x / chunks_per_batch;
  const int64_t chunk = blockIdx.x % chunks_per_batch;
  const int64_t p_begin = chunk * rows_per_chunk;
  const int64_t p_end = min64(P, p_begin + rows_per_chunk);

  T* As = reinterpret_cast<T*>(smem);
  T* Cs = same ? As : reinterpret_cast<T*>(smem + round_up(int64_t(tile_rows) * a * sizeof(T), 16));

  // Thread tiles of this block (blockIdx.y selects a group of at most blockDim.x tiles); the
  // threads are split into G row groups that each see every G-th row of a staged tile.
  const int tiles_c = static_cast<int>(ceil_div(c, kTile));
  const int tiles_total = static_cast<int>(ceil_div(a, kTile)) * tiles_c;
  const int tile_base = blockIdx.y * blockDim.x;
  const int tiles_here = min(tiles_total - tile_base, static_cast<int>(blockDim.x));
  const int groups = blockDim.x / tiles_here;
  const int local_tile = threadIdx.x % tiles_here;
  const int group = threadIdx.x / tiles_here;
  const bool active = group < groups;
  const int tile = tile_base + local_tile;
  const int j0 = (tile / tiles_c) * kTile;
  const int c0 = (tile % tiles_c) * kTile;
  const int na = min(kTile, a - j0);
  const int nc = min(kTile, c - c0);

  Acc acc[kTile][kTile];
  Acc norm[kTile];
#pragma unroll
  for (int m = 0; m < kTile; ++m) {
    norm[m] = Acc(0);
#pragma unroll
    for (int i = 0; i < kTile; ++i) acc[i][m] = Acc(0);
  }

  for (int64_t p0 = p_begin; p0 < p_end; p0 += tile_rows) {
    const int rows = static_cast<int>(min64(tile_rows, p_end - p0));
    stage_to_shared(As, A + (b * P + p0) * a, rows * a);
    if (!same) stage_to_shared(Cs, C + (b * P + p0) * c, rows * c);
    __syncthreads();
    if (active) {
      for (int row = group; row < rows; row += groups) {
        const T* a_row = As + row * a + j0;
        const T* c_row = Cs + row * c + c0;
        Acc av[kTile];
        Acc cv[kTile];
#pragma unroll
        for (int i = 0; i < kTile; ++i) av[i] = i < na ? to_acc<Acc>(a_row[i]) : Acc(0);
#pragma unroll
        for (int m = 0; m < kTile; ++m) cv[m] = m < nc ? to_acc<Acc>(c_row[m]) : Acc(0);
#pragma unroll
        for (int i = 0; i < kTile; ++i) {
#pragma unroll
          for (int m = 0; m < kTile; ++m) acc[i][m] += av[i] * cv[m];
        }
        if (kNorms) {
#pragma unroll
          for (int m = 0; m < kTile; ++m) norm[m] += cv[m] * cv[m];
        }
      }
    }
    __syncthreads();
  }

  // Sum the row groups in a fixed order, reusing the staging memory.
  Acc* red = reinterpret_cast<Acc*>(smem);
  if (active) {
    Acc* mine = red + (group * tiles_here + local_tile) * kTileValues;
#pragma unroll
    for (int i = 0; i < kTile; ++i) {
#pragma unroll
      for (int m = 0; m < kTile; ++m) mine[i * kTile + m] = acc[i][m];
    }
#pragma unroll
    for (int m = 0; m < kTile; ++m) mine[kTile * kTile + m] = norm[m];
  }
  __syncthreads();
  Acc* out = partial + static_cast<int64_t>(blockIdx.x) * n_out;
  for (int idx = threadIdx.x; idx < tiles_here * kTileValues; idx += blockDim.x) {
    const int lt = idx / kTileValues;
    const int v = idx % kTileValues;
    Acc s = Acc(0);
    for (int g = 0; g < groups; ++g) s += red[(g * tiles_here + lt) * kTileValues + v];
    const int t = tile_base + lt;
    const int ta = t / tiles_c;
    const int tc = t % tiles_c;
    if (v < kTile * kTile) {
      const int j = ta * kTile + v / kTile;
      const int cc = tc * kTile + v % kTile;
      if (j < a && cc < c) out[j * c + cc] = s;
    } else if (kNorms && ta == 0) {
      const int cc = tc * kTile + (v - kTile * kTile);
      if (cc < c) out[a * c + cc] = s;
    }
  }
}

// out[b, o] = Σ_chunk partial[b, chunk, o], chunks added in a fixed order; for o < a*c the sum is
// multiplied by row_scale[b, o / c] when row_scale is given. Block (32, 8).
template <typename T, typename Acc>
__global__ void reduce_chunks_kernel(const Acc* __restrict__ partial, const T* __restrict__ row_scale,
                                     Acc* __restrict__ out, int chunks, int n_out, int a, int c,
                                     int out_tiles) {
  __shared__ Acc red[8][32];
  const int64_t b = blockIdx.x / out_tiles;
  const int o = (blockIdx.x % out_tiles) * 32 + threadIdx.x;
  Acc s = Acc(0);
  if (o < n_out) {
    for (int ch = threadIdx.y; ch < chunks; ch += 8) s += partial[(b * chunks + ch) * n_out + o];
  }
  red[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && o < n_out) {
    Acc total = Acc(0);
#pragma unroll
    for (int y = 0; y < 8; ++y) total += red[y][threadIdx.x];
    if (row_scale != nullptr && o < a * c) total *= to_acc<Acc>(row_scale[b * a + o / c]);
    out[b * n_out + o] = total;
  }
}

// out[B, a*c (+c)] in Acc's dtype: out[b, j*c + k] = Σ_p A[b,p,j] C[b,p,k] (times row_scale[b,j]
// when row_scale is defined); with norms, out[b, a*c + k] = Σ_p C[b,p,k]². A and C may be the
// same tensor (the Gram matrix), which is then read once.
template <typename T, typename Acc>
void column_products(const at::Tensor& A, const at::Tensor& C, bool with_norms,
                     const at::Tensor& row_scale, const at::Tensor& out) {
  const int64_t B = A.size(0), P = A.size(1), a = A.size(2), c = C.size(2);
  const int64_t n_out = a * c + (with_norms ? c : 0);
  if (B == 0 || n_out == 0) return;
  if (P == 0) {
    out.zero_();
    return;
  }
  const bool same = A.data_ptr() == C.data_ptr() && A.sizes() == C.sizes();
  const int64_t row_bytes = (a + (same ? 0 : c)) * static_cast<int64_t>(sizeof(T));
  const int tile_rows = tile_rows_for(row_bytes, kProductStageBytes);
  const int64_t tile_groups = ceil_div(ceil_div(a, kTile) * ceil_div(c, kTile), kProductThreads);

  if (a == 0 || tile_rows == 0 || n_out > (int64_t(1) << 20) || tile_groups > 65535) {
    const auto acc_type = c10::CppTypeToScalarType<Acc>::value;
    const at::Tensor A2 = A.to(acc_type);
    const at::Tensor C2 = same ? A2 : C.to(acc_type);
    at::Tensor W = at::matmul(A2.transpose(1, 2), C2);
    if (row_scale.defined()) W.mul_(row_scale.to(acc_type).unsqueeze(-1));
    out.narrow(1, 0, a * c).copy_(W.reshape({B, a * c}));
    if (with_norms) out.narrow(1, a * c, c).copy_(C2.square().sum(1));
    return;
  }

  const cudaStream_t stream = current_stream();
  at::Tensor partial;
  int64_t chunks = 0;
  if (same || !single_column_products<T, Acc>(A, C, with_norms, partial, chunks)) {
    const int64_t stage_bytes = round_up(int64_t(tile_rows) * a * sizeof(T), 16) +
                                (same ? 0 : int64_t(tile_rows) * c * sizeof(T));
    const int64_t red_bytes = int64_t(kProductThreads) * kTileValues * sizeof(Acc);
    const int64_t smem = std::max(stage_bytes, red_bytes);
    TORCH_INTERNAL_ASSERT(smem <= kMaxDynamicSmem);
    const auto kernel = with_norms ? column_products_partial_kernel<T, Acc, true>
                                   : column_products_partial_kernel<T, Acc, false>;

    const int resident = resident_blocks_per_sm(kernel, kProductThreads, smem);
    const int64_t chunk_rows = rows_per_chunk(P, B * tile_groups, tile_rows, resident,
                                              kMaxPartialElements / (B * n_out));
    chunks = ceil_div(P, chunk_rows);

    partial = at::empty({B, chunks, n_out}, out.options());
    const dim3 grid(static_cast<unsigned>(B * chunks), static_cast<unsigned>(tile_groups));
    kernel<<<grid, kProductThreads, smem, stream>>>(
        A.data_ptr<T>(), C.data_ptr<T>(), partial.data_ptr<Acc>(), P, static_cast<int>(a),
        static_cast<int>(c), same, chunk_rows, static_cast<int>(chunks), tile_rows,
        static_cast<int>(n_out));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  const int64_t out_tiles = ceil_div(n_out, 32);
  reduce_chunks_kernel<T, Acc><<<static_cast<unsigned>(B * out_tiles), dim3(32, 8), 0, stream>>>(
      partial.data_ptr<Acc>(), row_scale.defined() ? row_scale.data_ptr<T>() : nullptr,
      out.data_ptr<Acc>(), static_cast<int>(chunks), static_cast<int>(n_out), static_cast<int>(a),
      static_cast<int>(c), static_cast<int>(out_tiles));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Y[b,p,:] = alpha * V[b,p,:] + A[b,p,:] @ M[b]; each thread computes kTile consecutive outputs
// of one row. M sits in shared memory when it fits (always for r <= 64), else it is read
// through the cache.
template <typename T, typename Acc>
__global__ void __launch_bounds__(kMatmulThreads)
    row_matmul_kernel(const T* __restrict__ A, const Acc* __restrict__ M, const T* __restrict__ V,
                      T* __restrict__ Y, int64_t P, int a, int c, Acc alpha, int64_t rows_per_block,
                      int blocks_per_batch, int tile_rows, bool m_shared) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int64_t b = blockIdx.x / blocks_per_batch;
  const int64_t p_begin = (blockIdx.x % blocks_per_batch) * rows_per_block;
  const int64_t p_end = min64(P, p_begin + rows_per_block);

  const Acc* Mb = M + b * a * c;
  Acc* Ms = reinterpret_cast<Acc*>(smem);
  T* As = reinterpret_cast<T*>(smem + (m_shared ? round_up(int64_t(a) * c * sizeof(Acc), 16) : 0));
  if (m_shared) {
    for (int e = threadIdx.x; e < a * c; e += blockDim.x) Ms[e] = Mb[e];
  }
  const Acc* Mp = m_shared ? Ms : Mb;
  const int col_groups = static_cast<int>(ceil_div(c, kTile));

  for (int64_t p0 = p_begin; p0 < p_end; p0 += tile_rows) {
    const int rows = static_cast<int>(min64(tile_rows, p_end - p0));
    stage_to_shared(As, A + (b * P + p0) * a, rows * a);
    __syncthreads();
    for (int q = threadIdx.x; q < rows * col_groups; q += blockDim.x) {
      const int row = q / col_groups;
      const int c0 = (q % col_groups) * kTile;
      const int nc = min(kTile, c - c0);
      Acc acc[kTile];
#pragma unroll
      for (int m = 0; m < kTile; ++m) acc[m] = Acc(0);
      const T* a_row = As + row * a;
      for (int j = 0; j < a; ++j) {
        const Acc av = to_acc<Acc>(a_row[j]);
        const Acc* m_row = Mp + j * c + c0;
#pragma unroll
        for (int m = 0; m < kTile; ++m) {
          if (m < nc) acc[m] += av * m_row[m];
        }
      }
      const int64_t offset = (b * P + p0 + row) * c + c0;
#pragma unroll
      for (int m = 0; m < kTile; ++m) {
        if (m < nc) {
          Acc y = acc[m];
          if (V != nullptr) y += alpha * to_acc<Acc>(V[offset + m]);
          Y[offset + m] = from_acc<T>(y);
        }
      }
    }
    __syncthreads();
  }
}

// Y = alpha * V + A @ M (V undefined: no V term); A[B,P,a] and V, Y[B,P,c] of type T, M[B,a,c]
// of Acc's dtype.
template <typename T, typename Acc>
void row_matmul(const at::Tensor& A, const at::Tensor& M, const at::Tensor& V, Acc alpha,
                const at::Tensor& Y) {
  const int64_t B = A.size(0), P = A.size(1), a = A.size(2), c = M.size(2);
  if (B == 0 || P == 0 || c == 0) return;
  if (a > 0 && single_column_row_dot<T, Acc>(A, M, V, alpha, Y)) return;
  const int tile_rows = tile_rows_for(a * static_cast<int64_t>(sizeof(T)), kMatmulStageBytes);
  if (a == 0 || tile_rows == 0) {
    const auto acc_type = c10::CppTypeToScalarType<Acc>::value;
    at::Tensor y = at::matmul(A.to(acc_type), M);
    if (V.defined()) y.add_(V.to(acc_type), alpha);
    Y.copy_(y);
    return;
  }
  const int64_t m_bytes = a * c * static_cast<int64_t>(sizeof(Acc));
  const bool m_shared = m_bytes <= kMatmulSharedMatrixBytes;
  const int64_t smem = (m_shared ? round_up(m_bytes, 16) : 0) + int64_t(tile_rows) * a * sizeof(T);
  TORCH_INTERNAL_ASSERT(smem <= kMaxDynamicSmem);

  const int resident = resident_blocks_per_sm(row_matmul_kernel<T, Acc>, kMatmulThreads, smem);
  const int64_t block_rows = rows_per_chunk(P, B, tile_rows, resident);
  const int64_t blocks_per_batch = ceil_div(P, block_rows);
  row_matmul_kernel<T, Acc><<<static_cast<unsigned>(B * blocks_per_batch), kMatmulThreads, smem,
                              current_stream()>>>(
      A.data_ptr<T>(), M.data_ptr<Acc>(), V.defined() ? V.data_ptr<T>() : nullptr,
      Y.data_ptr<T>(), P, static_cast<int>(a), static_cast<int>(c), alpha, block_rows,
      static_cast<int>(blocks_per_batch), tile_rows, m_shared);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace detail
}  // namespace cuda
}  // namespace pullback
