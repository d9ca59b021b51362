// Dense r×r float64 linear algebra for the CholeskyQR2 orchestration, in plain loops on the host.
//
// The matrices are tiny (r ~ 20); plain loops avoid the per-call threading and kernel-launch
// overhead that dominated when these steps were ATen calls. All matrices are row-major r×r.
#pragma once

#include <cstdint>

namespace pullback {
namespace qr {

// Upper Cholesky factor R of a symmetric G (G = RᵀR, diag(R) > 0). Returns false when G is not
// numerically positive definite (a pivot <= 0 or not finite); R is then unspecified.
bool cholesky_upper(const double* G, int64_t r, double* R);

// M = R⁻¹ for an upper-triangular R with a nonzero diagonal (M is upper triangular too).
void invert_upper(const double* R, int64_t r, double* M);

// C = A B for upper-triangular A and B (C is upper triangular).
void multiply_upper(const double* A, const double* B, int64_t r, double* C);

// Frobenius norm.
double frobenius(const double* A, int64_t r);

// A = I.
void set_identity(double* A, int64_t r);

}  // namespace qr
}  // namespace pullback
