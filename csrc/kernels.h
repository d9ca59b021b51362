// Backend kernels of pullback_ext, one set per device (namespace cpu, namespace cuda).
//
// Contract: the device-generic front ends (csrc/ops/*.cpp) validate every argument before calling
// a backend, so a backend may assume that all tensors are contiguous, live on its device, share
// one floating dtype (indices: int64, in range, as documented per op), and have consistent shapes.
// Backends allocate and return their outputs. Reduced-precision inputs (half, bfloat16) accumulate
// in float32; float32 and float64 accumulate in their own type unless stated otherwise.
//
// Shapes: B batch, P = N*D ambient dimension, r rank, k number of vectors, N tokens, D channels.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace pullback {

#define PULLBACK_DECLARE_BACKEND(NS)                                                              \
  namespace NS {                                                                                  \
  /* y[B,P,k] = eps * v + U (lam ⊙ (Uᵀ v)); U[B,P,r], lam[B,r], v[B,P,k]. */                     \
  at::Tensor lowrank_metric_apply(const at::Tensor& U, const at::Tensor& lam, const at::Tensor& v, \
                                  double eps);                                                    \
  /* q[B,k] = eps * ||v||² + Σ_j lam_j <u_j, v>², reading U once. */                              \
  at::Tensor lowrank_metric_quadform(const at::Tensor& U, const at::Tensor& lam,                  \
                                     const at::Tensor& v, double eps);                            \
  /* imp[B,N] = sqrt(Σ_j lam_j Σ_{d<D} U[b, t*D + d, j]²), D = P / num_tokens. */                 \
  at::Tensor token_importance(const at::Tensor& U, const at::Tensor& lam, int64_t num_tokens);    \
  /* G[B,r,r] = Xᵀ X accumulated and returned in float64; X[B,P,r]. */                            \
  at::Tensor gram(const at::Tensor& X);                                                           \
  /* out[B,K,D] = x[b, idx[b,i], :]; x[B,N,D], idx[B,K] int64 in [0,N). */                         \
  at::Tensor gather_tokens(const at::Tensor& x, const at::Tensor& idx);                           \
  /* x[B,N,D], w[B,N] (>= 0), src_idx[B,R] distinct, dst_idx[B,R] not in src_idx of its row.     \
     Returns (x'[B,N-R,D], w'[B,N-R]): the tokens not in src_idx, in their original order; each    \
     dst d becomes (w_d x_d + Σ_{s->d} w_s x_s) / (w_d + Σ_{s->d} w_s) (x_d unchanged when that    \
     denominator is 0) and w'_d = w_d + Σ_{s->d} w_s. */                                          \
  std::tuple<at::Tensor, at::Tensor> merge_tokens(const at::Tensor& x, const at::Tensor& w,       \
                                                  const at::Tensor& src_idx,                      \
                                                  const at::Tensor& dst_idx);                     \
  /* out[B,K+R,D]: out[b, kept_idx[b,i]] = kept[b,i], out[b, pruned_idx[b,j]] = pruned[b,j];       \
     the two index sets together are a permutation of 0..K+R-1. */                                \
  at::Tensor reinsert_tokens(const at::Tensor& kept, const at::Tensor& kept_idx,                  \
                             const at::Tensor& pruned, const at::Tensor& pruned_idx);             \
  }

PULLBACK_DECLARE_BACKEND(cpu)
#ifdef WITH_CUDA
PULLBACK_DECLARE_BACKEND(cuda)
namespace cuda {
// Y[B,P,r] = X[B,P,r] @ M[B,r,r]; M is float64 (an inverse triangular factor), Y has X's dtype,
// products accumulated in float64. (The CPU backend's QR primitives are in cpu/qr_primitives.h.)
at::Tensor right_multiply(const at::Tensor& X, const at::Tensor& M);
}  // namespace cuda
#endif

#undef PULLBACK_DECLARE_BACKEND

}  // namespace pullback
