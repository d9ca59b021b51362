// CPU backend of the token ops: gather, weighted merge with weight tracking, reinsertion.
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>

#include <vector>

#include "cpu/simd.h"
#include "kernels.h"

namespace pullback {
namespace cpu {

namespace {

// Rows of D values per parallel task: enough bytes to amortise scheduling.
int64_t row_grain(int64_t D, int64_t elem_size) {
  return std::max<int64_t>(1, 65536 / std::max<int64_t>(1, D * elem_size));
}

}  // namespace

at::Tensor gather_tokens(const at::Tensor& x, const at::Tensor& idx) {
  const int64_t B = x.size(0), N = x.size(1), D = x.size(2), K = idx.size(1);
  at::Tensor out = at::empty({B, K, D}, x.options());
  const int64_t* id = idx.const_data_ptr<int64_t>();
  const int64_t row_bytes = D * x.element_size();
  const char* src = static_cast<const char*>(x.const_data_ptr());
  char* dst = static_cast<char*>(out.mutable_data_ptr());
  at::parallel_for(0, B * K, row_grain(D, x.element_size()), [&](int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) {
      const int64_t b = row / K;
      PULLBACK_ROW_KERNEL(copy_bytes, dst + row * row_bytes, src + (b * N + id[row]) * row_bytes, row_bytes);
    }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> merge_tokens(const at::Tensor& x, const at::Tensor& w,
                                                const at::Tensor& src_idx,
                                                const at::Tensor& dst_idx) {
  const int64_t B = x.size(0), N = x.size(1), D = x.size(2), R = src_idx.size(1);
  const int64_t M = N - R;
  at::Tensor out = at::empty({B, M, D}, x.options());
  at::Tensor w_out = at::empty({B, M}, w.options());
  const int64_t* src = src_idx.const_data_ptr<int64_t>();
  const int64_t* dst = dst_idx.const_data_ptr<int64_t>();

  // Per image: kept[b, m] = token in output slot m; the merge sources of slot m are
  // members[b, begin[b, m] .. begin[b, m + 1]) (a CSR list, sources in src_idx order).
  std::vector<int64_t> kept(B * M), begin(B * (M + 1)), members(B * std::max<int64_t>(R, 1));
  at::parallel_for(0, B, 1, [&](int64_t first, int64_t last) {
    std::vector<int64_t> slot(N), fill(M);
    for (int64_t b = first; b < last; ++b) {
      std::fill(slot.begin(), slot.end(), 0);
      for (int64_t i = 0; i < R; ++i) slot[src[b * R + i]] = -1;
      int64_t m = 0;
      for (int64_t t = 0; t < N; ++t) {
        if (slot[t] < 0) continue;
        slot[t] = m;
        kept[b * M + m] = t;
        ++m;
      }
      int64_t* bg = begin.data() + b * (M + 1);
      std::fill(bg, bg + M + 1, 0);
      for (int64_t i = 0; i < R; ++i) ++bg[slot[dst[b * R + i]] + 1];
      for (int64_t s = 0; s < M; ++s) bg[s + 1] += bg[s];
      std::copy(bg, bg + M, fill.begin());
      for (int64_t i = 0; i < R; ++i) members[b * R + fill[slot[dst[b * R + i]]]++] = src[b * R + i];
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

at::Tensor reinsert_tokens(const at::Tensor& kept, const at::Tensor& kept_idx,
                           const at::Tensor& pruned, const at::Tensor& pruned_idx) {
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
      if (i < K)
        PULLBACK_ROW_KERNEL(copy_bytes, o + (b * N + ki[b * K + i]) * row_bytes, ks + (b * K + i) * row_bytes,
                            row_bytes);
      else
        PULLBACK_ROW_KERNEL(copy_bytes, o + (b * N + pi[b * R + i - K]) * row_bytes,
                            ps + (b * R + i - K) * row_bytes, row_bytes);
    }
  });
  return out;
}

}  // namespace cpu
}  // namespace pullback
