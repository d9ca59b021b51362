// CUDA primitives of the CholeskyQR2 block orthonormalisation: the float64 Gram matrix XᵀX of a
// tall-skinny batch and the row-wise product X·M with a small float64 matrix M (the inverse
// Cholesky factor). The front end does the r×r Cholesky work and the fallback decisions.
#include "../kernels.h"
#include "common.cuh"
#include "tall_skinny.cuh"

namespace pullback {
namespace cuda {

at::Tensor gram(const at::Tensor& X) {
  const c10::cuda::CUDAGuard guard(X.device());
  detail::check_operand(X, "X", X.device());
  const int64_t B = X.size(0), r = X.size(2);
  at::Tensor G = at::empty({B, r, r}, X.options().dtype(at::kDouble));
  if (G.numel() == 0) return G;
  PULLBACK_DISPATCH_FLOATING(X.scalar_type(), "pullback_cuda_gram", [&] {
    detail::column_products<scalar_t, double>(X, X, /*with_norms=*/false, at::Tensor(),
                                              G.view({B, r * r}));
  });
  return G;
}

at::Tensor right_multiply(const at::Tensor& X, const at::Tensor& M_in) {
  const c10::cuda::CUDAGuard guard(X.device());
  detail::check_operand(X, "X", X.device());
  // M is a small r×r factor straight out of a triangular solve, which may be column-major.
  const at::Tensor M = M_in.contiguous();
  detail::check_operand(M, "M", X.device());
  detail::check_same_dtype(M, "M", at::kDouble);
  TORCH_CHECK(M.dim() == 3 && M.size(0) == X.size(0) && M.size(1) == X.size(2) &&
                  M.size(2) == X.size(2),
              "pullback cuda backend: M must have shape [B, r, r] = [", X.size(0), ", ", X.size(2),
              ", ", X.size(2), "], got ", M.sizes());
  at::Tensor Y = at::empty(X.sizes(), X.options());
  if (Y.numel() == 0) return Y;
  PULLBACK_DISPATCH_FLOATING(X.scalar_type(), "pullback_cuda_right_multiply", [&] {
    detail::row_matmul<scalar_t, double>(X, M, at::Tensor(), 0.0, Y);
  });
  return Y;
}

}  // namespace cuda
}  // namespace pullback
