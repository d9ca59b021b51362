#include <ATen/ATen.h>

#include "ops/checks.h"
#include "ops/dispatch.h"
#include "ops/ops.h"

namespace pullback {
namespace ops {

at::Tensor gather_tokens(const at::Tensor& x, const at::Tensor& idx, bool check_finite) {
  check_rank(x, "x", 3, "[B, N, D]");
  check_batch(x, "x");
  check_float_input(x, "x");
  check_index_tensor(idx, "idx", x, "x", x.size(0));
  if (value_checks(idx)) check_index_range(host_indices(idx), "idx", x.size(1));
  if (check_finite) check_all_finite(x, "x");
  const at::Tensor xc = x.contiguous(), ic = idx.contiguous();
  return PULLBACK_BACKEND_CALL(xc, gather_tokens, xc, ic);
}

}  // namespace ops
}  // namespace pullback
