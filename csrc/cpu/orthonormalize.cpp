// CPU kernel of block_orthonormalize (the fused CholeskyQR2 of csrc/qr/cholesky_qr2.h, Q1 never
// stored), its schema and its CPU registration.
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "cpu/qr_primitives.h"
#include "qr/cholesky_qr2.h"

namespace pullback {
namespace cpu {

namespace {

std::tuple<at::Tensor, at::Tensor> block_orthonormalize(const at::Tensor& X_in) {
  const at::Tensor X = qr::tall_skinny_operand(X_in);
  std::vector<bool> bad(X.size(0), false);
  const auto [R1, M1] = qr::cholesky_step(gram(X), /*check_condition=*/true, bad);
  const auto [R2, M2] = qr::cholesky_step(product_gram(X, M1), /*check_condition=*/false, bad);
  at::Tensor Q = X.scalar_type() == at::kDouble ? right_multiply(X, M1, M2)
                                                : right_multiply(X, qr::upper_products(M1, M2));
  return qr::finish(X, Q, R1, R2, bad);
}

}  // namespace

}  // namespace cpu
}  // namespace pullback

TORCH_LIBRARY_FRAGMENT(pullback_ext, m) {
  m.set_python_module("pullback_ext.ops");
  m.def("block_orthonormalize(Tensor X) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pullback_ext, CPU, m) {
  m.impl("block_orthonormalize", &pullback::cpu::block_orthonormalize);
}
