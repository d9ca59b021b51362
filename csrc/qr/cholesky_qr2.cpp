#include "qr/cholesky_qr2.h"

#include "invariants.h"
#include "qr/small_linalg.h"

namespace pullback {
namespace qr {

namespace {

// Householder QR of one image X[P,r] in float64 with diag(R) >= 0; returns (Q, R) in float64.
std::tuple<at::Tensor, at::Tensor> householder_qr(const at::Tensor& X) {
  auto [Q, R] = at::linalg_qr(X.to(at::kDouble), "reduced");
  const at::Tensor sign = at::where(R.diagonal() < 0, -1.0, 1.0);
  return {Q * sign.unsqueeze(0), R * sign.unsqueeze(1)};
}

}  // namespace

at::Tensor tall_skinny_operand(const at::Tensor& X) {
  expect_tensor("block_orthonormalize", X, "X", {-1, -1, -1}, X.device(), X.scalar_type());
  expect_that(X.size(2) >= 1 && X.size(2) <= X.size(1), "block_orthonormalize", "X is ", X.sizes(),
              ", the kernels need 1 <= r <= P");
  return X.contiguous();
}

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

at::Tensor upper_products(const at::Tensor& A, const at::Tensor& B) {
  const int64_t batch = A.size(0), r = A.size(1);
  at::Tensor C = at::empty_like(A);
  for (int64_t b = 0; b < batch; ++b) {
    multiply_upper(A.const_data_ptr<double>() + b * r * r, B.const_data_ptr<double>() + b * r * r, r,
                   C.mutable_data_ptr<double>() + b * r * r);
  }
  return C;
}

std::tuple<at::Tensor, at::Tensor> finish(const at::Tensor& X, at::Tensor Q, const at::Tensor& R1,
                                          const at::Tensor& R2, const std::vector<bool>& bad) {
  at::Tensor R = upper_products(R2, R1).to(X.device());
  for (int64_t b = 0; b < X.size(0); ++b) {
    if (!bad[b]) continue;
    auto [Qb, Rb] = householder_qr(X[b]);
    Q[b].copy_(Qb);
    R[b].copy_(Rb);
  }
  return {Q, R.to(X.scalar_type())};
}

}  // namespace qr
}  // namespace pullback
