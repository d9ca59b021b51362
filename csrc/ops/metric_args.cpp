#include "ops/metric_args.h"

#include <c10/util/Exception.h>

#include <cmath>

#include "ops/checks.h"

namespace pullback {
namespace ops {

void check_factor_args(const at::Tensor& U, const at::Tensor& lam, bool check_finite) {
  check_tall_skinny(U, "U");
  const int64_t B = U.size(0), r = U.size(2);
  check_shape(lam, "lam", {B, r}, "[B, r]");
  check_same_device(lam, "lam", U, "U");
  check_same_dtype(lam, "lam", U, "U");
  if (check_finite) {
    check_all_finite(U, "U");
    check_all_finite(lam, "lam");
  }
  check_nonnegative(lam, "lam");
}

void check_metric_args(const at::Tensor& U, const at::Tensor& lam, const at::Tensor& v, double eps,
                       bool check_finite) {
  check_factor_args(U, lam, check_finite);
  check_shape(v, "v", {U.size(0), U.size(1), -1}, "[B, P, k]");
  TORCH_CHECK_VALUE(v.size(2) >= 1, "v must hold k >= 1 vectors (shape [B, P, k]), got shape ",
                    shape_str(v));
  check_same_device(v, "v", U, "U");
  check_same_dtype(v, "v", U, "U");
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0.0, "eps must be a finite value >= 0, got ", eps);
  if (check_finite) check_all_finite(v, "v");
}

}  // namespace ops
}  // namespace pullback
