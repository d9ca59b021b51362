// CUDA kernel of block_orthonormalize (the CholeskyQR2 of csrc/qr/cholesky_qr2.h with Q1 stored)
// and its CUDA registration. The device work is the float64 Gram matrix XᵀX of a tall-skinny batch
// and the row-wise product X·M with a small float64 matrix M (an inverse Cholesky factor); the r×r
// factorisations and the fallback decisions run on the host.
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "common.cuh"
#include "qr/cholesky_qr2.h"
#include "tall_skinny.cuh"

namespace pullback {
namespace cuda {

namespace {

// G[B,r,r] = Xᵀ X accumulated and returned in float64; X[B,P,r] contiguous on the current device.
at::Tensor gram(const at::Tensor& X) {
  const int64_t B = X.size(0), r = X.size(2);
  at::Tensor G = at::empty({B, r, r}, X.options().dtype(at::kDouble));
  if (G.numel() == 0) return G;
  PULLBACK_DISPATCH_FLOATING(X.scalar_type(), "pullback_cuda_gram", [&] {
    detail::column_products<scalar_t, double>(X, X, /*with_norms=*/false, at::Tensor(),
                                              G.view({B, r * r}));
  });
  return G;
}

// Y[B,P,r] = X[B,P,r] @ M[B,r,r]: M is float64 on the host (an inverse triangular factor), Y has
// X's dtype, the products accumulate in float64.
at::Tensor right_multiply(const at::Tensor& X, const at::Tensor& M_host) {
  const at::Tensor M = M_host.to(X.device()).contiguous();
  at::Tensor Y = at::empty(X.sizes(), X.options());
  if (Y.numel() == 0) return Y;
  PULLBACK_DISPATCH_FLOATING(X.scalar_type(), "pullback_cuda_right_multiply", [&] {
    detail::row_matmul<scalar_t, double>(X, M, at::Tensor(), 0.0, Y);
  });
  return Y;
}

std::tuple<at::Tensor, at::Tensor> block_orthonormalize(const at::Tensor& X_in) {
  const c10::cuda::CUDAGuard guard(X_in.device());
  const at::Tensor X = qr::tall_skinny_operand(X_in);
  std::vector<bool> bad(X.size(0), false);
  const auto [R1, M1] = qr::cholesky_step(gram(X), /*check_condition=*/true, bad);
  const at::Tensor Q1 = right_multiply(X, M1);
  const auto [R2, M2] = qr::cholesky_step(gram(Q1), /*check_condition=*/false, bad);
  return qr::finish(X, right_multiply(Q1, M2), R1, R2, bad);
}

}  // namespace

}  // namespace cuda
}  // namespace pullback

TORCH_LIBRARY_IMPL(pullback_ext, CUDA, m) {
  m.impl("block_orthonormalize", &pullback::cuda::block_orthonormalize);
}
