#include "qr/small_linalg.h"

#include <cmath>

namespace pullback {
namespace qr {

bool cholesky_upper(const double* G, int64_t r, double* R) {
  for (int64_t e = 0; e < r * r; ++e) R[e] = 0.0;
  for (int64_t i = 0; i < r; ++i) {
    double d = G[i * r + i];
    for (int64_t m = 0; m < i; ++m) d -= R[m * r + i] * R[m * r + i];
    if (!(d > 0.0) || !std::isfinite(d)) return false;
    const double rii = std::sqrt(d);
    R[i * r + i] = rii;
    for (int64_t j = i + 1; j < r; ++j) {
      double s = G[i * r + j];
      for (int64_t m = 0; m < i; ++m) s -= R[m * r + i] * R[m * r + j];
      R[i * r + j] = s / rii;
    }
  }
  return true;
}

void invert_upper(const double* R, int64_t r, double* M) {
  for (int64_t e = 0; e < r * r; ++e) M[e] = 0.0;
  // Column j of M solves R m = e_j by back substitution; only rows <= j are nonzero.
  for (int64_t j = 0; j < r; ++j) {
    M[j * r + j] = 1.0 / R[j * r + j];
    for (int64_t i = j - 1; i >= 0; --i) {
      double s = 0.0;
      for (int64_t m = i + 1; m <= j; ++m) s += R[i * r + m] * M[m * r + j];
      M[i * r + j] = -s / R[i * r + i];
    }
  }
}

void multiply_upper(const double* A, const double* B, int64_t r, double* C) {
  for (int64_t i = 0; i < r; ++i) {
    for (int64_t j = 0; j < r; ++j) {
      double s = 0.0;
      for (int64_t m = i; m <= j; ++m) s += A[i * r + m] * B[m * r + j];
      C[i * r + j] = j >= i ? s : 0.0;
    }
  }
}

double frobenius(const double* A, int64_t r) {
  double s = 0.0;
  for (int64_t e = 0; e < r * r; ++e) s += A[e] * A[e];
  return std::sqrt(s);
}

void set_identity(double* A, int64_t r) {
  for (int64_t e = 0; e < r * r; ++e) A[e] = 0.0;
  for (int64_t i = 0; i < r; ++i) A[i * r + i] = 1.0;
}

}  // namespace qr
}  // namespace pullback
