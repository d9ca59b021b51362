// CPU primitives of the fused CholeskyQR2 (csrc/qr/cholesky_qr2.h): the float64 Gram matrix, the
// second Gram matrix and the final product without storing the intermediate Q1 = X M1.
#pragma once

#include <ATen/ATen.h>

namespace pullback {
namespace cpu {

// G[B,r,r] = Xᵀ X accumulated and returned in float64; X[B,P,r] (float or double), contiguous.
at::Tensor gram(const at::Tensor& X);

// G[B,r,r] = (X M)ᵀ (X M) in float64, X M formed in float64 row block by row block and never
// stored; X[B,P,r] (float or double), M[B,r,r] float64, both contiguous on the CPU.
at::Tensor product_gram(const at::Tensor& X, const at::Tensor& M);

// Y[B,P,r] = X M, the product in float64.
at::Tensor right_multiply(const at::Tensor& X, const at::Tensor& M);

// Y[B,P,r] = (X M1) M2 with every product in float64 (X M1 never rounded to X's dtype).
at::Tensor right_multiply(const at::Tensor& X, const at::Tensor& M1, const at::Tensor& M2);

}  // namespace cpu
}  // namespace pullback
