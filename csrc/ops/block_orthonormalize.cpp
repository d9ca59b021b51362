// Orchestration of the batched tall-skinny QR, shared by every device backend.
//
// CholeskyQR2: R1 = chol(XᵀX), Q1 = X R1⁻¹, R2 = chol(Q1ᵀQ1), Q = Q1 R2⁻¹, R = R2 R1. The Gram
// matrices are accumulated in float64 by the backend, the r×r factorisations run in float64 on the
// host (csrc/ops/small_linalg.h), and every tall pass over X is memory-bound, instead of
// Householder's r dependent passes.
//
// On CUDA, Q1 is stored (`cuda::right_multiply`, `cuda::gram`, `cuda::right_multiply`: four passes).
// On the CPU it is never stored (csrc/cpu/qr_primitives.h): the second Gram matrix comes from X R1⁻¹
// formed in float64 chunk by chunk, and Q = (X R1⁻¹) R2⁻¹ is formed the same way in the last pass.
// Three reads of X and one fresh output instead of two, and Q1 is not rounded to X's dtype; for
// float64 X the result is that of a stored Q1. For float32 X the last pass is the single product
// X (R1⁻¹ R2⁻¹): it differs from (X R1⁻¹) R2⁻¹ by O(κ u_64) <= 1e-10 (κ <= kMaxCondition), far
// below float32 rounding, at half the flops of the two-product pass.
//
// CholeskyQR2 loses orthogonality once κ(X)² times the float64 unit roundoff is no longer small.
// An image is therefore refactorised by Householder QR (at::linalg_qr in float64, then cast) when
//  - the Cholesky factorisation of its first or second Gram matrix fails (X rank-deficient to
//    working precision, or not finite), or
//  - the Frobenius-norm condition estimate ‖R1‖_F ‖R1⁻¹‖_F exceeds kMaxCondition (badly scaled or
//    nearly dependent columns).
// Rank-deficient X: Householder still returns r orthonormal columns; the columns beyond the rank
// complete the basis of the column space to an orthonormal set, and the matching diagonal
// entries of R are (numerically) zero. Signs are fixed on every path so that diag(R) >= 0.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <tuple>
#include <vector>

#include "cpu/qr_primitives.h"
#include "ops/checks.h"
#include "ops/dispatch.h"
#include "ops/ops.h"
#include "ops/small_linalg.h"

namespace pullback {
namespace ops {

namespace {

// κ_F(R1) above which an image goes to Householder: κ² u_64 ~ 1e-4 still leaves the second
// CholeskyQR pass well inside its convergence region.
constexpr double kMaxCondition = 1e6;

// Householder QR of one image X[P,r] in float64 with diag(R) >= 0; returns (Q, R) in float64.
std::tuple<at::Tensor, at::Tensor> householder_qr(const at::Tensor& X) {
  auto [Q, R] = at::linalg_qr(X.to(at::kDouble), "reduced");
  const at::Tensor sign = at::where(R.diagonal() < 0, -1.0, 1.0);
  return {Q * sign.unsqueeze(0), R * sign.unsqueeze(1)};
}

// One CholeskyQR step on the host: from the Gram matrices G[B,r,r] (any device) computes the
// factors R[B,r,r] and their inverses M[B,r,r] (host, float64). Images whose factorisation fails,
// or (when check_condition) whose ‖R‖_F ‖R⁻¹‖_F exceeds kMaxCondition, are flagged in `bad` and
// get R = M = I so that the tall products stay finite; they are refactorised afterwards.
std::tuple<at::Tensor, at::Tensor> cholesky_step(const at::Tensor& G, bool check_condition,
                                                 std::vector<bool>& bad) {
  const at::Tensor Gh = G.to(at::kCPU).contiguous();
  const int64_t B = Gh.size(0), r = Gh.size(1);
  at::Tensor R = at::empty({B, r, r}, Gh.options());
  at::Tensor M = at::empty({B, r, r}, Gh.options());
  const double* g = Gh.const_data_ptr<double>();
  double* rp = R.mutable_data_ptr<double>();
  double* mp = M.mutable_data_ptr<double>();
  for (int64_t b = 0; b < B; ++b) {
    double* Rb = rp + b * r * r;
    double* Mb = mp + b * r * r;
    bool ok = !bad[b] && cholesky_upper(g + b * r * r, r, Rb);
    if (ok) {
      invert_upper(Rb, r, Mb);
      ok = !check_condition || frobenius(Rb, r) * frobenius(Mb, r) <= kMaxCondition;
    }
    if (!ok) {
      bad[b] = true;
      set_identity(Rb, r);
      set_identity(Mb, r);
    }
  }
  return {R, M};
}

// C[b] = A[b] B[b] for upper-triangular A, B[B,r,r] (host, float64).
at::Tensor upper_products(const at::Tensor& A, const at::Tensor& B) {
  const int64_t batch = A.size(0), r = A.size(1);
  at::Tensor C = at::empty_like(A);
  for (int64_t b = 0; b < batch; ++b) {
    multiply_upper(A.const_data_ptr<double>() + b * r * r, B.const_data_ptr<double>() + b * r * r, r,
                   C.mutable_data_ptr<double>() + b * r * r);
  }
  return C;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> block_orthonormalize(const at::Tensor& X_in, bool check_finite) {
  check_tall_skinny(X_in, "X");
  const int64_t B = X_in.size(0);
  if (check_finite) check_all_finite(X_in, "X");
  const at::Tensor X = X_in.contiguous();
  const auto on_device = [&](const at::Tensor& t) { return t.to(X.device()); };

  std::vector<bool> bad(B, false);
  auto [R1, M1] = cholesky_step(PULLBACK_BACKEND_CALL(X, gram, X), /*check_condition=*/true, bad);
  at::Tensor Q, R2, M2;
  if (X.is_cpu()) {
    std::tie(R2, M2) = cholesky_step(cpu::product_gram(X, M1), /*check_condition=*/false, bad);
    Q = X.scalar_type() == at::kDouble ? cpu::right_multiply(X, M1, M2)
                                       : cpu::right_multiply(X, upper_products(M1, M2));
  } else {
#ifdef WITH_CUDA
    const at::Tensor Q1 = cuda::right_multiply(X, on_device(M1));
    std::tie(R2, M2) = cholesky_step(cuda::gram(Q1), /*check_condition=*/false, bad);
    Q = cuda::right_multiply(Q1, on_device(M2));
#else
    TORCH_CHECK(false, "block_orthonormalize: no compiled backend for device ", X.device());
#endif
  }

  at::Tensor R = on_device(upper_products(R2, R1));
  for (int64_t b = 0; b < B; ++b) {
    if (!bad[b]) continue;
    auto [Qb, Rb] = householder_qr(X[b]);
    Q[b].copy_(Qb);
    R[b].copy_(Rb);
  }
  return {Q, R.to(X.scalar_type())};
}

}  // namespace ops
}  // namespace pullback
