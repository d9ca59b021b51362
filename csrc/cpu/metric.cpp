// CPU kernels of the low-rank metric ops (product, quadratic form, token importance), their
// schemas and their CPU registrations.
//
// All three are memory-bound: rows of U are streamed in blocks of kRowBlock rows, each block's
// partial projections are kept per block and summed in float64 in a fixed order, so results do
// not depend on the number of threads.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "cpu/simd.h"
#include "invariants.h"

namespace pullback {
namespace cpu {

namespace {

constexpr int64_t kRowBlock = 2048;
// Bytes of U per group of images in lowrank_metric_apply: about a last-level cache.
constexpr int64_t kCacheBytes = int64_t(16) << 20;

int64_t num_blocks(int64_t rows) { return (rows + kRowBlock - 1) / kRowBlock; }

at::Tensor lowrank_metric_apply(const at::Tensor& U_in, const at::Tensor& lam_in,
                                const at::Tensor& v_in, double eps) {
  expect_metric_operands("lowrank_metric_apply", U_in, lam_in, v_in);
  const at::Tensor U = U_in.contiguous(), lam = lam_in.contiguous(), v = v_in.contiguous();
  const int64_t B = U.size(0), P = U.size(1), r = U.size(2), k = v.size(2);
  at::Tensor y = at::empty_like(v);
  AT_DISPATCH_FLOATING_TYPES(U.scalar_type(), "lowrank_metric_apply_cpu", [&] {
    const int64_t nblk = num_blocks(P);
    // Images are processed in groups whose U fits in kCacheBytes, both passes back to back, so
    // the second pass over U[b] reads it from the last-level cache rather than from memory.
    const int64_t image_bytes = P * r * static_cast<int64_t>(sizeof(scalar_t));
    const int64_t group = std::max<int64_t>(1, std::min<int64_t>(B, kCacheBytes / std::max<int64_t>(1, image_bytes)));
    std::vector<double> partial(group * nblk * k * r);
    std::vector<scalar_t> c(group * r * k);  // per image of the group: lam ⊙ Uᵀv as [r, k]
    const scalar_t* u_all = U.const_data_ptr<scalar_t>();
    const scalar_t* v_all = v.const_data_ptr<scalar_t>();
    const scalar_t* lam_all = lam.const_data_ptr<scalar_t>();
    scalar_t* y_all = y.mutable_data_ptr<scalar_t>();
    for (int64_t b0 = 0; b0 < B; b0 += group) {
      const int64_t nb = std::min(group, B - b0);
      at::parallel_for(0, nb * nblk, 1, [&](int64_t first, int64_t last) {
        std::vector<scalar_t> scratch(
            PULLBACK_ROW_KERNEL(project_scratch_elems, static_cast<const scalar_t*>(nullptr), r, k));
        for (int64_t task = first; task < last; ++task) {
          const int64_t b = b0 + task / nblk, blk = task % nblk;
          const int64_t p0 = blk * kRowBlock, rows = std::min(kRowBlock, P - p0);
          PULLBACK_ROW_KERNEL(project_rows, u_all + (b * P + p0) * r, v_all + (b * P + p0) * k, rows,
                              r, k, partial.data() + task * k * r, nullptr, scratch.data());
        }
      });
      for (int64_t i = 0; i < nb; ++i) {
        for (int64_t kk = 0; kk < k; ++kk) {
          for (int64_t j = 0; j < r; ++j) {
            double a = 0.0;
            for (int64_t blk = 0; blk < nblk; ++blk) a += partial[((i * nblk) + blk) * k * r + kk * r + j];
            c[(i * r + j) * k + kk] = static_cast<scalar_t>(static_cast<double>(lam_all[(b0 + i) * r + j]) * a);
          }
        }
      }
      at::parallel_for(0, nb * nblk, 1, [&](int64_t first, int64_t last) {
        std::vector<scalar_t> scratch(
            PULLBACK_ROW_KERNEL(metric_scratch_elems, static_cast<const scalar_t*>(nullptr), r, k));
        for (int64_t task = first; task < last; ++task) {
          const int64_t i = task / nblk, blk = task % nblk, b = b0 + i;
          const int64_t p0 = blk * kRowBlock, rows = std::min(kRowBlock, P - p0);
          PULLBACK_ROW_KERNEL(metric_rows, u_all + (b * P + p0) * r, v_all + (b * P + p0) * k, rows, r,
                              k, c.data() + i * r * k, static_cast<scalar_t>(eps), y_all + (b * P + p0) * k,
                              scratch.data());
        }
      });
    }
  });
  return y;
}

at::Tensor lowrank_metric_quadform(const at::Tensor& U_in, const at::Tensor& lam_in,
                                   const at::Tensor& v_in, double eps) {
  expect_metric_operands("lowrank_metric_quadform", U_in, lam_in, v_in);
  const at::Tensor U = U_in.contiguous(), lam = lam_in.contiguous(), v = v_in.contiguous();
  const int64_t B = U.size(0), P = U.size(1), r = U.size(2), k = v.size(2);
  at::Tensor q = at::empty({B, k}, v.options());
  AT_DISPATCH_FLOATING_TYPES(U.scalar_type(), "lowrank_metric_quadform_cpu", [&] {
    const int64_t nblk = num_blocks(P);
    const int64_t stride = k * r + k;  // per block: projections [k, r], then squared norms [k]
    std::vector<double> partial(B * nblk * stride);
    const scalar_t* u_all = U.const_data_ptr<scalar_t>();
    const scalar_t* v_all = v.const_data_ptr<scalar_t>();
    at::parallel_for(0, B * nblk, 1, [&](int64_t first, int64_t last) {
      std::vector<scalar_t> scratch(
          PULLBACK_ROW_KERNEL(project_scratch_elems, static_cast<const scalar_t*>(nullptr), r, k));
      for (int64_t task = first; task < last; ++task) {
        const int64_t b = task / nblk, blk = task % nblk;
        const int64_t p0 = blk * kRowBlock, rows = std::min(kRowBlock, P - p0);
        double* out = partial.data() + task * stride;
        PULLBACK_ROW_KERNEL(project_rows, u_all + (b * P + p0) * r, v_all + (b * P + p0) * k, rows,
                            r, k, out, out + k * r, scratch.data());
      }
    });
    const scalar_t* lam_all = lam.const_data_ptr<scalar_t>();
    scalar_t* q_all = q.mutable_data_ptr<scalar_t>();
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t kk = 0; kk < k; ++kk) {
        double vv = 0.0, form = 0.0;
        for (int64_t blk = 0; blk < nblk; ++blk) vv += partial[(b * nblk + blk) * stride + k * r + kk];
        for (int64_t j = 0; j < r; ++j) {
          double a = 0.0;
          for (int64_t blk = 0; blk < nblk; ++blk) a += partial[(b * nblk + blk) * stride + kk * r + j];
          form += static_cast<double>(lam_all[b * r + j]) * a * a;
        }
        q_all[b * k + kk] = static_cast<scalar_t>(eps * vv + form);
      }
    }
  });
  return q;
}

at::Tensor token_importance(const at::Tensor& U_in, const at::Tensor& lam_in, int64_t num_tokens) {
  expect_metric_operands("token_importance", U_in, lam_in, at::Tensor());
  const at::Tensor U = U_in.contiguous(), lam = lam_in.contiguous();
  const int64_t B = U.size(0), P = U.size(1), r = U.size(2);
  expect_that(num_tokens >= 1 && P % num_tokens == 0, "token_importance", "num_tokens = ", num_tokens,
              " does not divide P = ", P);
  const int64_t D = P / num_tokens;
  at::Tensor imp = at::empty({B, num_tokens}, U.options());
  AT_DISPATCH_FLOATING_TYPES(U.scalar_type(), "token_importance_cpu", [&] {
    const scalar_t* u = U.const_data_ptr<scalar_t>();
    const scalar_t* lam_all = lam.const_data_ptr<scalar_t>();
    scalar_t* out = imp.mutable_data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, D * r));
    at::parallel_for(0, B * num_tokens, grain, [&](int64_t first, int64_t last) {
      for (int64_t task = first; task < last; ++task) {
        const int64_t b = task / num_tokens;
        out[task] = static_cast<scalar_t>(
            PULLBACK_ROW_KERNEL(token_importance_block, u + task * D * r, D, r, lam_all + b * r));
      }
    });
  });
  return imp;
}

}  // namespace

}  // namespace cpu
}  // namespace pullback

TORCH_LIBRARY_FRAGMENT(pullback_ext, m) {
  m.set_python_module("pullback_ext.ops");
  m.def("lowrank_metric_apply(Tensor U, Tensor lam, Tensor v, float eps) -> Tensor");
  m.def("lowrank_metric_quadform(Tensor U, Tensor lam, Tensor v, float eps) -> Tensor");
  m.def("token_importance(Tensor U, Tensor lam, int num_tokens) -> Tensor");
}

TORCH_LIBRARY_IMPL(pullback_ext, CPU, m) {
  m.impl("lowrank_metric_apply", &pullback::cpu::lowrank_metric_apply);
  m.impl("lowrank_metric_quadform", &pullback::cpu::lowrank_metric_quadform);
  m.impl("token_importance", &pullback::cpu::token_importance);
}
