#include <ATen/ATen.h>

#include "ops/dispatch.h"
#include "ops/metric_args.h"
#include "ops/ops.h"

namespace pullback {
namespace ops {

at::Tensor lowrank_metric_apply(const at::Tensor& U, const at::Tensor& lam, const at::Tensor& v,
                                double eps, bool check_finite) {
  check_metric_args(U, lam, v, eps, check_finite);
  const at::Tensor Uc = U.contiguous(), lc = lam.contiguous(), vc = v.contiguous();
  return PULLBACK_BACKEND_CALL(Uc, lowrank_metric_apply, Uc, lc, vc, eps);
}

}  // namespace ops
}  // namespace pullback
