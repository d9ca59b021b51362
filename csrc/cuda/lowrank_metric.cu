// CUDA kernels of the low-rank pullback metric g = εI + U diag(λ) Uᵀ: the product g·v, the
// quadratic form vᵀ g v and the per-token importance sqrt(Σ_j λ_j ‖u_j^(t)‖²).
//
// Memory traffic: quadform and importance read U once; apply reads it twice (Uᵀv, then U(λ⊙·)).
#include <torch/library.h>

#include <climits>

#include "common.cuh"
#include "invariants.h"
#include "tall_skinny.cuh"

namespace pullback {
namespace cuda {

namespace {

constexpr int kImportanceThreads = 256;
constexpr int kEpilogueThreads = 256;

// One block per (batch, token). The token's block of U, U[b, t*D:(t+1)*D, :], is D*r contiguous
// elements in which element e belongs to column e % r, so it is read as one coalesced stream of
// 16-byte vectors (after a short scalar head that reaches 16-byte alignment).
template <typename T, typename Acc>
__global__ void __launch_bounds__(kImportanceThreads)
    token_importance_kernel(const T* __restrict__ U, const T* __restrict__ lam, T* __restrict__ out,
                            int64_t num_tokens, int block_len, int r) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ Acc scratch[detail::kWarpSize];
  constexpr int kVec = 16 / sizeof(T);

  const int64_t bt = blockIdx.x;
  const int64_t b = bt / num_tokens;
  Acc* lam_s = reinterpret_cast<Acc*>(smem);
  for (int j = threadIdx.x; j < r; j += blockDim.x) lam_s[j] = detail::to_acc<Acc>(lam[b * r + j]);
  __syncthreads();

  const T* base = U + bt * block_len;
  const int misalignment = static_cast<int>(reinterpret_cast<uintptr_t>(base) % 16);
  const int head = min(block_len, static_cast<int>(((16 - misalignment) % 16) / sizeof(T)));
  Acc s = Acc(0);
  if (threadIdx.x < head) {
    const Acc x = detail::to_acc<Acc>(base[threadIdx.x]);
    s += lam_s[threadIdx.x % r] * x * x;
  }
  const int num_vec = (block_len - head) / kVec;
  const uint4* vec = reinterpret_cast<const uint4*>(base + head);
#pragma unroll 4
  for (int i = threadIdx.x; i < num_vec; i += blockDim.x) {
    const uint4 raw = __ldg(vec + i);
    const T* vals = reinterpret_cast<const T*>(&raw);
    int j = (head + i * kVec) % r;
#pragma unroll
    for (int q = 0; q < kVec; ++q) {
      const Acc x = detail::to_acc<Acc>(vals[q]);
      s += lam_s[j] * x * x;
      j = (j + 1 == r) ? 0 : j + 1;
    }
  }
  for (int e = head + num_vec * kVec + threadIdx.x; e < block_len; e += blockDim.x) {
    const Acc x = detail::to_acc<Acc>(base[e]);
    s += lam_s[e % r] * x * x;
  }
  s = detail::block_sum(s, scratch);
  if (threadIdx.x == 0) out[bt] = detail::from_acc<T>(sqrt(s > Acc(0) ? s : Acc(0)));
}

// q[b, c] = eps * W[b, r*k + c] + Σ_j lam[b, j] * W[b, j*k + c]²  (W: the column products of U
// and v followed by the squared norms of v).
template <typename T, typename Acc>
__global__ void quadform_epilogue_kernel(const Acc* __restrict__ W, const T* __restrict__ lam,
                                         T* __restrict__ q, int64_t total, int r, int k, Acc eps) {
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = idx / k;
    const int c = static_cast<int>(idx % k);
    const Acc* Wb = W + b * (int64_t(r) * k + k);
    Acc s = eps * Wb[int64_t(r) * k + c];
    for (int j = 0; j < r; ++j) {
      const Acc w = Wb[int64_t(j) * k + c];
      s += detail::to_acc<Acc>(lam[b * r + j]) * w * w;
    }
    q[idx] = detail::from_acc<T>(s);
  }
}

// The k = 1 quadform from the single-column partial sums, in one block per batch entry:
// partial[b, chunk, 0..r) are chunk sums of Uᵀv, partial[b, chunk, r] of ‖v‖². Thread group g
// adds chunks g, g + G, ...; the groups and then the r + 1 terms are added in a fixed order
// (deterministic). Needs r + 1 <= blockDim.x.
template <typename T, typename Acc>
__global__ void __launch_bounds__(kEpilogueThreads)
    quadform_from_chunks_kernel(const Acc* __restrict__ partial, const T* __restrict__ lam,
                                T* __restrict__ q, int chunks, int r, Acc eps) {
  __shared__ Acc red[kEpilogueThreads];
  __shared__ Acc scratch[detail::kWarpSize];
  const int64_t b = blockIdx.x;
  const int n_out = r + 1;
  const int groups = blockDim.x / n_out;
  const int o = threadIdx.x % n_out;
  const int g = threadIdx.x / n_out;
  Acc s = Acc(0);
  if (g < groups) {
    const Acc* Pb = partial + b * chunks * int64_t(n_out) + o;
    for (int ch = g; ch < chunks; ch += groups) s += Pb[int64_t(ch) * n_out];
  }
  red[threadIdx.x] = s;
  __syncthreads();
  Acc term = Acc(0);
  if (threadIdx.x < n_out) {
    Acc total = Acc(0);
    for (int gg = 0; gg < groups; ++gg) total += red[gg * n_out + threadIdx.x];
    term = threadIdx.x < r ? detail::to_acc<Acc>(lam[b * r + threadIdx.x]) * total * total : eps * total;
  }
  term = detail::block_sum(term, scratch);
  if (threadIdx.x == 0) q[b] = detail::from_acc<T>(term);
}

at::Tensor lowrank_metric_apply(const at::Tensor& U_in, const at::Tensor& lam_in,
                                const at::Tensor& v_in, double eps) {
  expect_metric_operands("lowrank_metric_apply", U_in, lam_in, v_in);
  const c10::cuda::CUDAGuard guard(U_in.device());
  const at::Tensor U = U_in.contiguous(), lam = lam_in.contiguous(), v = v_in.contiguous();
  const int64_t B = U.size(0), r = U.size(2), k = v.size(2);
  at::Tensor y = at::empty(v.sizes(), v.options());
  if (y.numel() == 0) return y;
  PULLBACK_DISPATCH_FLOATING(U.scalar_type(), "pullback_cuda_lowrank_metric_apply", [&] {
    using Acc = at::opmath_type<scalar_t>;
    const at::Tensor W =
        at::empty({B, r * k}, U.options().dtype(c10::CppTypeToScalarType<Acc>::value));
    detail::column_products<scalar_t, Acc>(U, v, /*with_norms=*/false, lam, W);
    detail::row_matmul<scalar_t, Acc>(U, W.view({B, r, k}), v, static_cast<Acc>(eps), y);
  });
  return y;
}

at::Tensor lowrank_metric_quadform(const at::Tensor& U_in, const at::Tensor& lam_in,
                                   const at::Tensor& v_in, double eps) {
  expect_metric_operands("lowrank_metric_quadform", U_in, lam_in, v_in);
  const c10::cuda::CUDAGuard guard(U_in.device());
  const at::Tensor U = U_in.contiguous(), lam = lam_in.contiguous(), v = v_in.contiguous();
  const int64_t B = U.size(0), r = U.size(2), k = v.size(2);
  at::Tensor q = at::empty({B, k}, U.options());
  if (q.numel() == 0) return q;
  PULLBACK_DISPATCH_FLOATING(U.scalar_type(), "pullback_cuda_lowrank_metric_quadform", [&] {
    using Acc = at::opmath_type<scalar_t>;
    at::Tensor partial;
    int64_t chunks = 0;
    // k = 1: column sums and their reduction + epilogue in two launches instead of three.
    if (k == 1 && r + 1 <= kEpilogueThreads && U.size(1) > 0 &&
        detail::single_column_products<scalar_t, Acc>(U, v, /*with_norms=*/true, partial, chunks)) {
      quadform_from_chunks_kernel<scalar_t, Acc>
          <<<static_cast<unsigned>(B), kEpilogueThreads, 0, detail::current_stream()>>>(
              partial.data_ptr<Acc>(), lam.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(),
              static_cast<int>(chunks), static_cast<int>(r), static_cast<Acc>(eps));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return;
    }
    const at::Tensor W =
        at::empty({B, r * k + k}, U.options().dtype(c10::CppTypeToScalarType<Acc>::value));
    detail::column_products<scalar_t, Acc>(U, v, /*with_norms=*/true, at::Tensor(), W);
    const int64_t total = B * k;
    const int blocks = static_cast<int>(
        std::min<int64_t>(detail::ceil_div(total, kEpilogueThreads), 4 * detail::num_sms()));
    quadform_epilogue_kernel<scalar_t, Acc>
        <<<blocks, kEpilogueThreads, 0, detail::current_stream()>>>(
            W.data_ptr<Acc>(), lam.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), total,
            static_cast<int>(r), static_cast<int>(k), static_cast<Acc>(eps));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return q;
}

at::Tensor token_importance(const at::Tensor& U_in, const at::Tensor& lam_in, int64_t num_tokens) {
  expect_metric_operands("token_importance", U_in, lam_in, at::Tensor());
  const c10::cuda::CUDAGuard guard(U_in.device());
  const at::Tensor U = U_in.contiguous(), lam = lam_in.contiguous();
  expect_that(num_tokens >= 1 && U.size(1) % num_tokens == 0, "token_importance", "num_tokens = ",
              num_tokens, " does not divide P = ", U.size(1));
  const int64_t B = U.size(0), P = U.size(1), r = U.size(2);
  const int64_t D = P / num_tokens;
  at::Tensor out = at::empty({B, num_tokens}, U.options());
  if (out.numel() == 0) return out;
  if (D * r == 0) return out.zero_();
  PULLBACK_DISPATCH_FLOATING(U.scalar_type(), "pullback_cuda_token_importance", [&] {
    using Acc = at::opmath_type<scalar_t>;
    const int64_t lam_bytes = r * static_cast<int64_t>(sizeof(Acc));
    if (D * r > INT_MAX || lam_bytes > detail::kMaxDynamicSmem / 2) {
      // Far outside the kernel's design (a token block of 2^31 elements or r in the thousands).
      const auto acc_type = c10::CppTypeToScalarType<Acc>::value;
      const at::Tensor per_token =
          (U.to(acc_type).view({B, num_tokens, D, r}).square().sum(2) *
           lam.to(acc_type).unsqueeze(1))
              .sum(2);
      out.copy_(per_token.clamp_min(0).sqrt());
      return;
    }
    token_importance_kernel<scalar_t, Acc>
        <<<static_cast<unsigned>(B * num_tokens), kImportanceThreads, lam_bytes,
           detail::current_stream()>>>(U.data_ptr<scalar_t>(), lam.data_ptr<scalar_t>(),
                                               out.data_ptr<scalar_t>(), num_tokens,
                                               static_cast<int>(D * r), static_cast<int>(r));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace

}  // namespace cuda
}  // namespace pullback

TORCH_LIBRARY_IMPL(pullback_ext, CUDA, m) {
  m.impl("lowrank_metric_apply", &pullback::cuda::lowrank_metric_apply);
  m.impl("lowrank_metric_quadform", &pullback::cuda::lowrank_metric_quadform);
  m.impl("token_importance", &pullback::cuda::token_importance);
}
