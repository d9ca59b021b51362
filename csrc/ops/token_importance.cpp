#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "ops/dispatch.h"
#include "ops/metric_args.h"
#include "ops/ops.h"

namespace pullback {
namespace ops {

at::Tensor token_importance(const at::Tensor& U, const at::Tensor& lam, int64_t num_tokens,
                            bool check_finite) {
  check_factor_args(U, lam, check_finite);
  const int64_t P = U.size(1);
  TORCH_CHECK_VALUE(num_tokens >= 1, "num_tokens must be >= 1, got ", num_tokens);
  TORCH_CHECK_VALUE(P % num_tokens == 0, "num_tokens must divide P = ", P,
                    " (U has shape [B, N*D, r]), got num_tokens = ", num_tokens);
  const at::Tensor Uc = U.contiguous(), lc = lam.contiguous();
  return PULLBACK_BACKEND_CALL(Uc, token_importance, Uc, lc, num_tokens);
}

}  // namespace ops
}  // namespace pullback
