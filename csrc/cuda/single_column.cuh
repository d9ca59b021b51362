// Single-column (c = 1) versions of the two tall-skinny primitives, for the memory-bound
// products with one vector (lowrank_metric_apply / quadform with k = 1):
//
//   column products  out[b, j] = Σ_p A[b,p,j] C[b,p]     (and optionally Σ_p C[b,p]²)
//   row dot          Y[b, p]   = alpha·V[b,p] + Σ_j A[b,p,j] M[b,j]
//
// A is read straight from global memory as vectors of kBytes bytes (16, 8 or 4), without the
// shared-memory staging of the general kernels, so that several independent loads per thread
// are in flight. This needs every row of A to start on a kBytes boundary: A's base aligned and
// a·sizeof(T) a multiple of kBytes (pick_vector_bytes); other shapes take the general kernels.
#pragma once

#include "common.cuh"

#include <climits>
#include <type_traits>

namespace pullback {
namespace cuda {
namespace detail {

constexpr int kSingleColumnThreads = 256;

template <int kBytes>
struct VectorOf;
template <>
struct VectorOf<16> {
  using type = uint4;
};
template <>
struct VectorOf<8> {
  using type = uint2;
};
template <>
struct VectorOf<4> {
  using type = unsigned int;
};

// The widest of 16, 8, 4 bytes that divides the row length a·sizeof(T) and the base address
// and holds whole elements; 0 when none does (then the general kernels apply).
template <typename T>
int pick_vector_bytes(const at::Tensor& A) {
  const int64_t row_bytes = A.size(2) * static_cast<int64_t>(sizeof(T));
  const auto base = reinterpret_cast<uintptr_t>(A.data_ptr());
  for (int bytes : {16, 8, 4}) {
    if (bytes % static_cast<int>(sizeof(T)) == 0 && row_bytes % bytes == 0 && base % bytes == 0) {
      return bytes;
    }
  }
  return 0;
}

// Calls f(std::integral_constant<int, B>()) for B = bytes (16, 8 or 4), instantiating only the
// widths that hold whole elements of T (pick_vector_bytes never returns another).
template <typename T, typename F>
void with_vector_bytes(int bytes, F&& f) {
  const auto call = [&](auto tag) {
    if constexpr (decltype(tag)::value % sizeof(T) == 0) f(tag);
  };
  if (bytes == 16) {
    call(std::integral_constant<int, 16>());
  } else if (bytes == 8) {
    call(std::integral_constant<int, 8>());
  } else {
    call(std::integral_constant<int, 4>());
  }
}

// One block per (batch entry, chunk of rows). Thread t reads vector t % V of rows
// t / V, t / V + S, ... (V vectors per row, S = blockDim.x / V rows per sweep), so a warp reads
// consecutive 16-byte pieces and every thread always meets the same kVec columns.
// With n_out = a + 1 the squared norm of C is written after the a column sums.
template <typename T, typename Acc, int kBytes>
__global__ void __launch_bounds__(kSingleColumnThreads)
    single_column_products_kernel(const T* __restrict__ A, const T* __restrict__ C,
                                  Acc* __restrict__ partial, int64_t P, int a,
                                  int64_t rows_per_chunk, int chunks_per_batch, int n_out) {
  using Vec = typename VectorOf<kBytes>::type;
  constexpr int kVec = kBytes / static_cast<int>(sizeof(T));
  constexpr int kValues = kVec + 1;  // kVec column sums and the squared norm of C
  extern __shared__ __align__(16) unsigned char smem[];
  Acc* red = reinterpret_cast<Acc*>(smem);  // [blockDim.x, kValues]

  const int64_t b = blockIdx.x / chunks_per_batch;
  const int64_t p_begin = (blockIdx.x % chunks_per_batch) * rows_per_chunk;
  const int64_t p_end = min64(P, p_begin + rows_per_chunk);
  const int vecs_per_row = a / kVec;
  const int rows_per_sweep = blockDim.x / vecs_per_row;
  const int g = threadIdx.x % vecs_per_row;
  const int lane_row = threadIdx.x / vecs_per_row;

  Acc acc[kVec];
#pragma unroll
  for (int i = 0; i < kVec; ++i) acc[i] = Acc(0);
  Acc norm = Acc(0);
  if (lane_row < rows_per_sweep) {
    const Vec* Ab = reinterpret_cast<const Vec*>(A + b * P * a) + g;
    const T* Cb = C + b * P;
#pragma unroll 4
    for (int64_t p = p_begin + lane_row; p < p_end; p += rows_per_sweep) {
      const Vec raw = __ldg(Ab + p * vecs_per_row);
      const Acc c = to_acc<Acc>(Cb[p]);
      const T* vals = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc[i] += to_acc<Acc>(vals[i]) * c;
      norm += c * c;
    }
  }
  Acc* mine = red + threadIdx.x * kValues;
#pragma unroll
  for (int i = 0; i < kVec; ++i) mine[i] = acc[i];
  mine[kVec] = norm;
  __syncthreads();

  // Fixed summation order over the row lanes: deterministic. Every thread of a row sees the
  // same C value, so the norm is taken from column group 0 only.
  Acc* out = partial + static_cast<int64_t>(blockIdx.x) * n_out;
  for (int o = threadIdx.x; o < n_out; o += blockDim.x) {
    const bool is_norm = o >= a;
    const int group = is_norm ? 0 : o / kVec;
    const int value = is_norm ? kVec : o % kVec;
    Acc s = Acc(0);
    for (int lr = 0; lr < rows_per_sweep; ++lr) s += red[(lr * vecs_per_row + group) * kValues + value];
    out[o] = s;
  }
}

// out[B, a (+1)] as in column_products for C[B,P,1]; partial workspace reduced by
// reduce_chunks_kernel. Returns false (nothing launched) when the shape does not qualify.
template <typename T, typename Acc>
bool single_column_products(const at::Tensor& A, const at::Tensor& C, bool with_norms,
                            at::Tensor& partial, int64_t& chunks) {
  const int64_t B = A.size(0), P = A.size(1), a = A.size(2);
  const int bytes = pick_vector_bytes<T>(A);
  if (bytes == 0 || C.size(2) != 1) return false;
  const int64_t vecs_per_row = a * static_cast<int64_t>(sizeof(T)) / bytes;
  if (vecs_per_row > kSingleColumnThreads) return false;
  const int64_t n_out = a + (with_norms ? 1 : 0);
  const int64_t rows_per_sweep = kSingleColumnThreads / vecs_per_row;
  const int values = bytes / static_cast<int>(sizeof(T)) + 1;
  const int64_t smem = int64_t(kSingleColumnThreads) * values * sizeof(Acc);
  if (smem > kMaxDynamicSmem) return false;

  bool launched = false;
  with_vector_bytes<T>(bytes, [&](auto bytes_tag) {
    const auto kernel = single_column_products_kernel<T, Acc, decltype(bytes_tag)::value>;
    const int resident = resident_blocks_per_sm(kernel, kSingleColumnThreads, smem);
    const int64_t chunk_rows = rows_per_chunk(P, B, rows_per_sweep, resident,
                                              kMaxPartialElements / (B * n_out));
    chunks = ceil_div(P, chunk_rows);
    if (B * chunks > INT_MAX) return;

    partial = at::empty({B, chunks, n_out}, A.options().dtype(c10::CppTypeToScalarType<Acc>::value));
    kernel<<<static_cast<unsigned>(B * chunks), kSingleColumnThreads, smem, current_stream()>>>(
        A.data_ptr<T>(), C.data_ptr<T>(), partial.data_ptr<Acc>(), P, static_cast<int>(a), chunk_rows,
        static_cast<int>(chunks), static_cast<int>(n_out));
    launched = true;
  });
  if (!launched) return false;
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

// One thread per row: the row's vectors are loaded back to back (independent loads in flight),
// dotted with M[b] from shared memory (every thread reads the same element: a broadcast).
template <typename T, typename Acc, int kBytes>
__global__ void __launch_bounds__(kSingleColumnThreads)
    single_column_row_dot_kernel(const T* __restrict__ A, const Acc* __restrict__ M,
                                 const T* __restrict__ V, T* __restrict__ Y, int64_t P, int a,
                                 Acc alpha) {
  using Vec = typename VectorOf<kBytes>::type;
  constexpr int kVec = kBytes / static_cast<int>(sizeof(T));
  extern __shared__ __align__(16) unsigned char smem[];
  Acc* Ms = reinterpret_cast<Acc*>(smem);
  const int64_t b = blockIdx.y;
  for (int j = threadIdx.x; j < a; j += blockDim.x) Ms[j] = M[b * a + j];
  __syncthreads();
  const int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (p >= P) return;
  const int vecs_per_row = a / kVec;
  const Vec* row = reinterpret_cast<const Vec*>(A + (b * P + p) * a);
  Acc s = Acc(0);
#pragma unroll 8
  for (int q = 0; q < vecs_per_row; ++q) {
    const Vec raw = __ldg(row + q);
    const T* vals = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < kVec; ++i) s += to_acc<Acc>(vals[i]) * Ms[q * kVec + i];
  }
  if (V != nullptr) s += alpha * to_acc<Acc>(V[b * P + p]);
  Y[b * P + p] = from_acc<T>(s);
}

// Y[B,P,1] = alpha·V + A·M for M[B,a,1]; false (nothing launched) when the shape does not qualify.
template <typename T, typename Acc>
bool single_column_row_dot(const at::Tensor& A, const at::Tensor& M, const at::Tensor& V, Acc alpha,
                           const at::Tensor& Y) {
  const int64_t B = A.size(0), P = A.size(1), a = A.size(2);
  const int bytes = pick_vector_bytes<T>(A);
  if (bytes == 0 || M.size(2) != 1 || B > 65535) return false;
  const int64_t smem = a * static_cast<int64_t>(sizeof(Acc));
  const int64_t blocks = ceil_div(P, kSingleColumnThreads);
  if (smem > kMaxDynamicSmem || blocks > INT_MAX) return false;
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(B));
  const cudaStream_t stream = current_stream();
  const T* v_ptr = V.defined() ? V.data_ptr<T>() : nullptr;
  with_vector_bytes<T>(bytes, [&](auto bytes_tag) {
    single_column_row_dot_kernel<T, Acc, decltype(bytes_tag)::value>
        <<<grid, kSingleColumnThreads, smem, stream>>>(A.data_ptr<T>(), M.data_ptr<Acc>(), v_ptr,
                                                       Y.data_ptr<T>(), P, static_cast<int>(a), alpha);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

}  // namespace detail
}  // namespace cuda
}  // namespace pullback
