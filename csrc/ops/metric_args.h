// Validation shared by lowrank_metric_apply and lowrank_metric_quadform.
#pragma once

#include <ATen/ATen.h>

namespace pullback {
namespace ops {

// U[B,P,r] with 1 <= r <= P, lam[B,r] >= 0, v[B,P,k] with k >= 1, eps >= 0; same dtype/device.
void check_metric_args(const at::Tensor& U, const at::Tensor& lam, const at::Tensor& v, double eps,
                       bool check_finite);

// U[B,P,r] with 1 <= r <= P and lam[B,r] >= 0 of U's dtype and device.
void check_factor_args(const at::Tensor& U, const at::Tensor& lam, bool check_finite);

}  // namespace ops
}  // namespace pullback
