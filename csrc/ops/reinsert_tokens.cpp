#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <sstream>
#include <vector>

#include "ops/checks.h"
#include "ops/dispatch.h"
#include "ops/ops.h"

namespace pullback {
namespace ops {

namespace {

// In range and no position used twice: with K + R indices in [0, K+R) that makes every image's
// two index sets together a permutation of 0..K+R-1.
void check_permutation(const at::Tensor& kept_idx, const at::Tensor& pruned_idx) {
  const int64_t B = kept_idx.size(0), K = kept_idx.size(1), R = pruned_idx.size(1), N = K + R;
  check_index_range(kept_idx, "kept_idx", N);
  check_index_range(pruned_idx, "pruned_idx", N);
  const int64_t* ki = kept_idx.const_data_ptr<int64_t>();
  const int64_t* pi = pruned_idx.const_data_ptr<int64_t>();
  std::vector<int64_t> owner(N);  // position i of the concatenation [kept_idx, pruned_idx]
  auto describe = [&](int64_t b, int64_t i) {
    std::ostringstream s;
    if (i < K)
      s << "kept_idx[" << b << ", " << i << "]";
    else
      s << "pruned_idx[" << b << ", " << i - K << "]";
    return s.str();
  };
  for (int64_t b = 0; b < B; ++b) {
    std::fill(owner.begin(), owner.end(), -1);
    for (int64_t i = 0; i < N; ++i) {
      const int64_t t = i < K ? ki[b * K + i] : pi[b * R + i - K];
      TORCH_CHECK_VALUE(owner[t] < 0, "kept_idx and pruned_idx must together cover 0..", N - 1,
                        " exactly once per image: ", describe(b, owner[t]), " and ", describe(b, i),
                        " are both ", t);
      owner[t] = i;
    }
  }
}

}  // namespace

at::Tensor reinsert_tokens(const at::Tensor& kept, const at::Tensor& kept_idx,
                           const at::Tensor& pruned, const at::Tensor& pruned_idx,
                           bool check_finite) {
  check_rank(kept, "kept", 3, "[B, K, D]");
  check_batch(kept, "kept");
  check_float_input(kept, "kept");
  const int64_t B = kept.size(0), D = kept.size(2);
  check_shape(pruned, "pruned", {B, -1, D}, "[B, R, D] (B and D of kept)");
  check_same_device(pruned, "pruned", kept, "kept");
  check_same_dtype(pruned, "pruned", kept, "kept");
  check_index_tensor(kept_idx, "kept_idx", kept, "kept", B);
  check_shape(kept_idx, "kept_idx", {B, kept.size(1)}, "[B, K] (B and K of kept)");
  check_index_tensor(pruned_idx, "pruned_idx", kept, "kept", B);
  check_shape(pruned_idx, "pruned_idx", {B, pruned.size(1)}, "[B, R] (B and R of pruned)");
  TORCH_CHECK_VALUE(kept.size(1) + pruned.size(1) >= 1,
                    "kept and pruned together must hold at least one token, got K = R = 0");
  if (value_checks(kept_idx)) check_permutation(host_indices(kept_idx), host_indices(pruned_idx));
  if (check_finite) {
    check_all_finite(kept, "kept");
    check_all_finite(pruned, "pruned");
  }
  const at::Tensor kc = kept.contiguous(), pc = pruned.contiguous();
  const at::Tensor kic = kept_idx.contiguous(), pic = pruned_idx.contiguous();
  return PULLBACK_BACKEND_CALL(kc, reinsert_tokens, kc, kic, pc, pic);
}

}  // namespace ops
}  // namespace pullback
