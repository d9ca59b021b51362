// CPU kernels of the token ops (gather, weighted merge with weight tracking, reinsertion), their
// schemas and their CPU registrations.
//
// Unchecked calls (check_values=False) may pass invalid indices: the kernels then never address
// memory outside their operands (results unspecified, as on CUDA): a gathered row with an index out
// of range is NaN, a reinserted row with a position out of range is dropped, and merge_tokens
// drops what it cannot place (see plan_merge).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <limits>
#include <tuple>
#include <vector>

#include "cpu/simd.h"
#include "invariants.h"

namespace pullback {
namespace cpu {

namespace {

// Rows of D values per parallel task: enough bytes to amortise scheduling.
int64_t row_grain(int64_t D, int64_t elem_size) {
  return std::max<int64_t>(1, 65536 / std::max<int64_t>(1, D * elem_size));
}

// One row of D NaN in x's dtype (float or double): what a gathered row with an index out of range
// becomes.
std::vector<char> nan_row(const at::Tensor& x, int64_t D) {
  std::vector<char> row(D * x.element_size());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "gather_tokens_cpu", [&] {
    std::fill_n(reinterpret_cast<scalar_t*>(row.data()), D, std::numeric_limits<scalar_t>::quiet_NaN());
  });
  return row;
}

at::Tensor gather_tokens(const at::Tensor& x_in, const at::Tensor& idx_in) {
  expect_tensor("gather_tokens", x_in, "x", {-1, -1, -1}, x_in.device(), x_in.scalar_type());
  expect_tensor("gather_tokens", idx_in, "idx", {x_in.size(0), -1}, x_in.device(), at::kLong);
  const at::Tensor x = x_in.contiguous(), idx = idx_in.contiguous();
  const int64_t B = x.size(0), N = x.size(1), D = x.size(2), K = idx.size(1);
  at::Tensor out = at::empty({B, K, D}, x.options());
  const int64_t* id = idx.const_data_ptr<int64_t>();
  const int64_t row_bytes = D * x.element_size();
  const std::vector<char> nan = nan_row(x, D);
  const char* src = static_cast<const char*>(x.const_data_ptr());
  char* dst = static_cast<char*>(out.mutable_data_ptr());
  at::parallel_for(0, B * K, row_grain(D, x.element_size()), [&](int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) {
      const int64_t b = row / K, t = id[row];
      const char* from = t >= 0 && t < N ? src + (b * N + t) * row_bytes : nan.data();
      PULLBACK_ROW_KERNEL(copy_bytes, dst + row * row_bytes, from, row_bytes);
    }
  });
  return out;
}

// Merge plan of one image: kept[m] = token in output slot m (m < M), and the merge sources of
// slot m are members[begin[m] .. begin[m + 1]) (a CSR list, sources in src_idx order).
//
// The indices are trusted only as far as memory goes: out-of-range sources and destinations are
// dropped, and when repeated sources leave more than M tokens unmerged, those past M are dropped
// too (only unchecked calls pass such indices; their result is unspecified).
void plan_merge(const int64_t* src, const int64_t* dst, int64_t N, int64_t R, int64_t* kept,
                int64_t* begin, int64_t* members, std::vector<int64_t>& slot,
                std::vector<int64_t>& target) {
  const int64_t M = N - R;
  const auto valid = [N](int64_t t) { return t >= 0 && t < N; };
  std::fill(slot.begin(), slot.end(), 0);
  for (int64_t i = 0; i < R; ++i) {
    if (valid(src[i])) slot[src[i]] = -1;
  }
  int64_t m = 0;
  for (int64_t t = 0; t < N; ++t) {
    if (slot[t] < 0) continue;
    slot[t] = m < M ? m : -1;
    if (m < M) kept[m] = t;
    ++m;
  }
  std::fill(begin, begin + M + 1, 0);
  for (int64_t i = 0; i < R; ++i) {
    target[i] = valid(src[i]) && valid(dst[i]) ? slot[dst[i]] : -1;
    if (target[i] >= 0) ++begin[target[i] + 1];
  }
  for (int64_t j = 0; j < M; ++j) begin[j + 1] += begin[j];
  std::vector<int64_t> fill(begin, begin + M);
  for (int64_t i = 0; i < R; ++i) {
    if (target[i] >= 0) members[fill[target[i]]++] = src[i];
  }
}

std::tuple<at::Tensor, at::Tensor> merge_tokens(const at::Tensor& x_in, const at::Tensor& w_in,
                                                const at::Tensor& src_in,
                                                const at::Tensor& dst_in) {
  expect_merge_operands(x_in, w_in, src_in, dst_in);
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const at::Tensor src_idx = src_in.contiguous(), dst_idx = dst_in.contiguous();
  const int64_t B = x.size(0), N = x.size(1), D = x.size(2), R = src_idx.size(1);
  const int64_t M = N - R;
  at::Tensor out = at::empty({B, M, D}, x.options());
  at::Tensor w_out = at::empty({B, M}, w.options());
  const int64_t* src = src_idx.const_data_ptr<int64_t>();
  const int64_t* dst = dst_idx.const_data_ptr<int64_t>();

  std::vector<int64_t> kept(B * M), begin(B * (M + 1)), members(B * std::max<int64_t>(R, 1));
  at::parallel_for(0, B, 1, [&](int64_t first, int64_t last) {
    std::vector<int64_t> slot(N), target(R);
    for (int64_t b = first; b < last; ++b) {
      plan_merge(src + b * R, dst + b * R, N, R, kept.data() + b * M, begin.data() + b * (M + 1),
                 members.data() + b * R, slot, target);
    }
  });

  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "merge_tokens_cpu", [&] {
    const scalar_t* xs = x.const_data_ptr<scalar_t>();
    const scalar_t* ws = w.const_data_ptr<scalar_t>();
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    scalar_t* wo = w_out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, B * M, row_grain(D, sizeof(scalar_t)), [&](int64_t first, int64_t last) {
      for (int64_t row = first; row < last; ++row) {
        const int64_t b = row / M, m = row % M;
        const int64_t t = kept[row];
        const scalar_t* xt = xs + (b * N + t) * D;
        scalar_t* orow = o + row * D;
        const int64_t* bg = begin.data() + b * (M + 1);
        const int64_t* mem = members.data() + b * R;
        double total = static_cast<double>(ws[b * N + t]);
        for (int64_t e = bg[m]; e < bg[m + 1]; ++e) total += static_cast<double>(ws[b * N + mem[e]]);
        wo[row] = static_cast<scalar_t>(total);
        if (bg[m] == bg[m + 1] || total == 0.0) {
          PULLBACK_ROW_KERNEL(copy_bytes, reinterpret_cast<char*>(orow), reinterpret_cast<const char*>(xt),
                              D * static_cast<int64_t>(sizeof(scalar_t)));
          continue;
        }
        const scalar_t c0 = static_cast<scalar_t>(static_cast<double>(ws[b * N + t]) / total);
        for (int64_t d = 0; d < D; ++d) orow[d] = c0 * xt[d];
        for (int64_t e = bg[m]; e < bg[m + 1]; ++e) {
          const int64_t s = mem[e];
          const scalar_t cs = static_cast<scalar_t>(static_cast<double>(ws[b * N + s]) / total);
          const scalar_t* xsrc = xs + (b * N + s) * D;
          for (int64_t d = 0; d < D; ++d) orow[d] += cs * xsrc[d];
        }
      }
    });
  });
  return {out, w_out};
}

at::Tensor reinsert_tokens(const at::Tensor& kept_in, const at::Tensor& kept_idx_in,
                           const at::Tensor& pruned_in, const at::Tensor& pruned_idx_in) {
  expect_reinsert_operands(kept_in, kept_idx_in, pruned_in, pruned_idx_in);
  const at::Tensor kept = kept_in.contiguous(), pruned = pruned_in.contiguous();
  const at::Tensor kept_idx = kept_idx_in.contiguous(), pruned_idx = pruned_idx_in.contiguous();
  const int64_t B = kept.size(0), K = kept.size(1), D = kept.size(2), R = pruned.size(1);
  const int64_t N = K + R;
  at::Tensor out = at::empty({B, N, D}, kept.options());
  const int64_t* ki = kept_idx.const_data_ptr<int64_t>();
  const int64_t* pi = pruned_idx.const_data_ptr<int64_t>();
  const int64_t row_bytes = D * kept.element_size();
  const char* ks = static_cast<const char*>(kept.const_data_ptr());
  const char* ps = static_cast<const char*>(pruned.const_data_ptr());
  char* o = static_cast<char*>(out.mutable_data_ptr());
  at::parallel_for(0, B * N, row_grain(D, kept.element_size()), [&](int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) {
      const int64_t b = row / N, i = row % N;
      const int64_t t = i < K ? ki[b * K + i] : pi[b * R + i - K];
      if (t < 0 || t >= N) continue;  // an unchecked position out of range: the row is dropped
      const char* from = i < K ? ks + (b * K + i) * row_bytes : ps + (b * R + i - K) * row_bytes;
      PULLBACK_ROW_KERNEL(copy_bytes, o + (b * N + t) * row_bytes, from, row_bytes);
    }
  });
  return out;
}

}  // namespace

}  // namespace cpu
}  // namespace pullback

TORCH_LIBRARY_FRAGMENT(pullback_ext, m) {
  m.set_python_module("pullback_ext.ops");
  m.def("gather_tokens(Tensor x, Tensor idx) -> Tensor");
  m.def("merge_tokens(Tensor x, Tensor w, Tensor src_idx, Tensor dst_idx) -> (Tensor, Tensor)");
  m.def("reinsert_tokens(Tensor kept, Tensor kept_idx, Tensor pruned, Tensor pruned_idx) -> Tensor");
}

TORCH_LIBRARY_IMPL(pullback_ext, CPU, m) {
  m.impl("gather_tokens", &pullback::cpu::gather_tokens);
  m.impl("merge_tokens", &pullback::cpu::merge_tokens);
  m.impl("reinsert_tokens", &pullback::cpu::reinsert_tokens);
}
