// Internal invariants of the registered kernels (csrc/cpu/*.cpp, csrc/cuda/*.cu).
//
// Argument validation lives in Python (pullback_ext/_op_checks.py): pullback_ext.ops validates
// every argument, with messages that name it, before it calls an op. The kernels only check the
// metadata they address memory with (ranks, sizes, devices, dtypes), so that a direct call of
// torch.ops.pullback_ext.* with inconsistent arguments raises a RuntimeError instead of reading or
// writing out of bounds. Index values are never read here: the kernels themselves are safe on
// out-of-range or repeated indices (results unspecified).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <climits>
#include <initializer_list>
#include <optional>
#include <sstream>
#include <string_view>

#include "agglomeration.h"

namespace pullback {

// `t` has sizes.size() dimensions with t.size(d) == sizes[d] wherever sizes[d] >= 0, lives on
// `device` and has `dtype`. `op` and `name` go into the message.
inline void expect_tensor(const char* op, const at::Tensor& t, const char* name,
                          std::initializer_list<int64_t> sizes, const at::Device& device,
                          at::ScalarType dtype) {
  bool ok = t.dim() == static_cast<int64_t>(sizes.size());
  int64_t d = 0;
  for (const int64_t s : sizes) {
    ok = ok && (s < 0 || t.size(d) == s);
    ++d;
  }
  if (ok && t.device() == device && t.scalar_type() == dtype) return;
  std::ostringstream want;
  const char* sep = "[";
  for (const int64_t s : sizes) {
    want << sep;
    sep = ", ";
    if (s < 0)
      want << "*";
    else
      want << s;
  }
  want << "]";
  TORCH_CHECK(false, "pullback_ext::", op,
              ": internal invariant violated: ", name, " is ", t.sizes(), " ", t.scalar_type(),
              " on ", t.device(), ", the kernel needs ", want.str(), " ", dtype, " on ", device,
              " (pullback_ext.ops validates its arguments before it calls the op)");
}

// Any other internal invariant: `ok`, or a RuntimeError naming `op`.
template <typename... Args>
inline void expect_that(bool ok, const char* op, const Args&... what) {
  TORCH_CHECK(ok, "pullback_ext::", op, ": internal invariant violated: ", what...);
}

// The invariants that the CPU and CUDA kernels of an op family share.

// lowrank_metric_apply, lowrank_metric_quadform, token_importance: U[B,P,r], lam[B,r] and (unless
// undefined) v[B,P,k], one dtype and device.
inline void expect_metric_operands(const char* op, const at::Tensor& U, const at::Tensor& lam,
                                   const at::Tensor& v) {
  expect_tensor(op, U, "U", {-1, -1, -1}, U.device(), U.scalar_type());
  expect_tensor(op, lam, "lam", {U.size(0), U.size(2)}, U.device(), U.scalar_type());
  if (v.defined()) expect_tensor(op, v, "v", {U.size(0), U.size(1), -1}, U.device(), U.scalar_type());
}

// merge_tokens: x[B,N,D], w[B,N] of x's dtype, src_idx and dst_idx [B,R] int64 with R <= N < 2^31,
// all on x's device.
inline void expect_merge_operands(const at::Tensor& x, const at::Tensor& w, const at::Tensor& src_idx,
                                  const at::Tensor& dst_idx) {
  constexpr const char* op = "merge_tokens";
  expect_tensor(op, x, "x", {-1, -1, -1}, x.device(), x.scalar_type());
  const int64_t B = x.size(0), N = x.size(1);
  expect_tensor(op, w, "w", {B, N}, x.device(), x.scalar_type());
  expect_tensor(op, src_idx, "src_idx", {B, -1}, x.device(), at::kLong);
  expect_tensor(op, dst_idx, "dst_idx", {B, src_idx.size(1)}, x.device(), at::kLong);
  expect_that(src_idx.size(1) <= N && N <= INT_MAX, op, "the kernels need R <= N <= 2^31-1, got R = ",
              src_idx.size(1), ", N = ", N);
}

// reinsert_tokens: kept[B,K,D], pruned[B,R,D] of kept's dtype, kept_idx[B,K] and pruned_idx[B,R]
// int64, all on kept's device.
inline void expect_reinsert_operands(const at::Tensor& kept, const at::Tensor& kept_idx,
                                     const at::Tensor& pruned, const at::Tensor& pruned_idx) {
  constexpr const char* op = "reinsert_tokens";
  expect_tensor(op, kept, "kept", {-1, -1, -1}, kept.device(), kept.scalar_type());
  const int64_t B = kept.size(0);
  expect_tensor(op, pruned, "pruned", {B, -1, kept.size(2)}, kept.device(), kept.scalar_type());
  expect_tensor(op, kept_idx, "kept_idx", {B, kept.size(1)}, kept.device(), at::kLong);
  expect_tensor(op, pruned_idx, "pruned_idx", {B, pruned.size(1)}, kept.device(), at::kLong);
}

// select_with_partners: order and partner [B,n] int64 on one device, 0 <= count <= n <= 2^31-1.
inline void expect_selection_operands(const at::Tensor& order, const at::Tensor& partner, int64_t count) {
  constexpr const char* op = "select_with_partners";
  expect_tensor(op, order, "order", {-1, -1}, order.device(), at::kLong);
  expect_tensor(op, partner, "partner", {order.size(0), order.size(1)}, order.device(), at::kLong);
  expect_that(count >= 0 && count <= order.size(1) && order.size(1) <= INT_MAX, op,
              "the kernels need 0 <= count <= n <= 2^31-1, got count = ", count, ", n = ", order.size(1));
}

// agglomerate: dist [B,n,n] float or double; sizes and energy [B,n] of dist's dtype and device with
// the bound linkage, else absent; 0 <= count <= n; linkage one of agglomeration::kLinkageNames.
// Returns the linkage's code.
inline int expect_agglomeration_operands(const at::Tensor& dist, const std::optional<at::Tensor>& sizes,
                                         const std::optional<at::Tensor>& energy, int64_t count,
                                         std::string_view linkage) {
  constexpr const char* op = "agglomerate";
  int code = -1;
  for (int k = 0; k < agglomeration::kNumLinkages; ++k) {
    if (linkage == agglomeration::kLinkageNames[k]) code = k;
  }
  expect_that(code >= 0, op, "linkage must be average, single, complete or bound, got ", std::string(linkage));
  expect_that(dist.scalar_type() == at::kFloat || dist.scalar_type() == at::kDouble, op,
              "the kernels take float or double distances, got ", dist.scalar_type());
  expect_tensor(op, dist, "dist", {-1, -1, dist.dim() == 3 ? dist.size(1) : -1}, dist.device(), dist.scalar_type());
  const int64_t B = dist.size(0), n = dist.size(1);
  const bool bound = code == agglomeration::kBound;
  expect_that(sizes.has_value() == bound && energy.has_value() == bound, op,
              "sizes and energy are given with the bound linkage and only then");
  if (bound) {
    expect_tensor(op, *sizes, "sizes", {B, n}, dist.device(), dist.scalar_type());
    expect_tensor(op, *energy, "energy", {B, n}, dist.device(), dist.scalar_type());
  }
  expect_that(count >= 0 && count <= n && n <= INT_MAX, op, "the kernels need 0 <= count <= n <= 2^31-1, got count = ",
              count, ", n = ", n);
  return code;
}

}  // namespace pullback
