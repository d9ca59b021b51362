// Device-generic front ends of pullback_ext's ops: validate, make contiguous, dispatch to the
// backend of the input's device (pullback::cpu or pullback::cuda, csrc/kernels.h).
//
// Every bad argument raises a Python ValueError / TypeError / IndexError naming the argument with
// the expected and actual shape, dtype, device or value. `check_finite` additionally rejects NaN
// or infinite values in the floating inputs (one reduction per input; off by default).
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace pullback {
namespace ops {

// U[B,P,r], lam[B,r] >= 0, v[B,P,k], eps >= 0 -> y[B,P,k] = eps v + U (lam ⊙ Uᵀ v).
at::Tensor lowrank_metric_apply(const at::Tensor& U, const at::Tensor& lam, const at::Tensor& v,
                                double eps, bool check_finite);

// Same arguments -> q[B,k] = eps ||v||² + Σ_j lam_j <u_j, v>².
at::Tensor lowrank_metric_quadform(const at::Tensor& U, const at::Tensor& lam, const at::Tensor& v,
                                   double eps, bool check_finite);

// U[B,P,r], lam[B,r] >= 0, P divisible by num_tokens -> imp[B,N] = sqrt(Σ_j lam_j ||u_j^(t)||²).
at::Tensor token_importance(const at::Tensor& U, const at::Tensor& lam, int64_t num_tokens,
                            bool check_finite);

// X[B,P,r], r <= P -> (Q[B,P,r], R[B,r,r]) with X = Q R, QᵀQ = I, R upper triangular and
// diag(R) >= 0. CholeskyQR2 with a per-image Householder fallback (csrc/ops/block_orthonormalize.cpp).
std::tuple<at::Tensor, at::Tensor> block_orthonormalize(const at::Tensor& X, bool check_finite);

// x[B,N,D], idx[B,K] int64 in [0,N) -> out[B,K,D] = x[b, idx[b,i]].
at::Tensor gather_tokens(const at::Tensor& x, const at::Tensor& idx, bool check_finite);

// x[B,N,D], w[B,N] >= 0, src_idx[B,R] distinct, dst_idx[B,R] outside src_idx ->
// (x'[B,N-R,D], w'[B,N-R]); see pullback::cpu::merge_tokens for the formula.
std::tuple<at::Tensor, at::Tensor> merge_tokens(const at::Tensor& x, const at::Tensor& w,
                                                const at::Tensor& src_idx, const at::Tensor& dst_idx,
                                                bool check_finite);

// kept[B,K,D], kept_idx[B,K], pruned[B,R,D], pruned_idx[B,R]; the two index sets together a
// permutation of 0..K+R-1 -> out[B,K+R,D] with every token at its original position.
at::Tensor reinsert_tokens(const at::Tensor& kept, const at::Tensor& kept_idx,
                           const at::Tensor& pruned, const at::Tensor& pruned_idx,
                           bool check_finite);

// Whether this build contains the CUDA backend.
bool cuda_built();

}  // namespace ops
}  // namespace pullback
