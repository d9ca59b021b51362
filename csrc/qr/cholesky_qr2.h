// Host side of the batched tall-skinny QR behind block_orthonormalize, shared by its CPU and CUDA
// kernels (csrc/cpu/orthonormalize.cpp, csrc/cuda/orthonormalize.cu).
//
// CholeskyQR2: R1 = chol(XᵀX), Q1 = X R1⁻¹, R2 = chol(Q1ᵀQ1), Q = Q1 R2⁻¹, R = R2 R1. The Gram
// matrices are accumulated in float64 by the device kernels, the r×r factorisations run in float64
// on the host (csrc/qr/small_linalg.h), and every tall pass over X is memory-bound, instead of
// Householder's r dependent passes.
//
// On CUDA, Q1 is stored (right multiply, Gram, right multiply: four passes). On the CPU it is
// never stored (csrc/cpu/qr_primitives.h): the second Gram matrix comes from X R1⁻¹ formed in
// float64 chunk by chunk, and Q = (X R1⁻¹) R2⁻¹ is formed the same way in the last pass. Three
// reads of X and one fresh output instead of two, and Q1 is not rounded to X's dtype; for float64
// X the result is that of a stored Q1. For float32 X the last pass is the single product
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
#pragma once

#include <ATen/ATen.h>

#include <tuple>
#include <vector>

namespace pullback {
namespace qr {

// κ_F(R1) above which an image goes to Householder: κ² u_64 ~ 1e-4 still leaves the second
// CholeskyQR pass well inside its convergence region.
constexpr double kMaxCondition = 1e6;

// X[B,P,r] with 1 <= r <= P (the kernels' invariant, csrc/invariants.h), made contiguous.
at::Tensor tall_skinny_operand(const at::Tensor& X);

// One CholeskyQR step on the host: from the Gram matrices G[B,r,r] (float64, any device) computes
// the factors R[B,r,r] and their inverses M[B,r,r] (host, float64). Images whose factorisation
// fails, or (when check_condition) whose ‖R‖_F ‖R⁻¹‖_F exceeds kMaxCondition, are flagged in `bad`
// and get R = M = I so that the tall products stay finite; finish() refactorises them.
std::tuple<at::Tensor, at::Tensor> cholesky_step(const at::Tensor& G, bool check_condition,
                                                 std::vector<bool>& bad);

// C[b] = A[b] B[b] for upper-triangular A, B[B,r,r] (host, float64).
at::Tensor upper_products(const at::Tensor& A, const at::Tensor& B);

// (Q, R = R2 R1) in X's dtype on X's device, with every image flagged in `bad` replaced by its
// Householder QR (diag(R) >= 0). Q[B,P,r] is updated in place.
std::tuple<at::Tensor, at::Tensor> finish(const at::Tensor& X, at::Tensor Q, const at::Tensor& R1,
                                          const at::Tensor& R2, const std::vector<bool>& bad);

}  // namespace qr
}  // namespace pullback
