// CPU kernel of select_with_partners (the greedy choice of merge sources that spares the partner
// of every source it takes, csrc/partner_selection.h), its schema and its CPU registration.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "invariants.h"
#include "partner_selection.h"

namespace pullback {
namespace cpu {

namespace {

at::Tensor select_with_partners(const at::Tensor& order_in, const at::Tensor& partner_in, int64_t count) {
  expect_selection_operands(order_in, partner_in, count);
  const at::Tensor order = order_in.contiguous(), partner = partner_in.contiguous();
  const int64_t B = order.size(0), n = order.size(1);
  at::Tensor out = at::empty({B, count}, order.options());
  const int64_t* ord = order.const_data_ptr<int64_t>();
  const int64_t* par = partner.const_data_ptr<int64_t>();
  int64_t* o = out.mutable_data_ptr<int64_t>();
  // A row is a few hundred dependent steps: enough rows per task to amortise scheduling.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, n));
  at::parallel_for(0, B, grain, [&](int64_t first, int64_t last) {
    std::vector<uint8_t> flags(2 * n);
    for (int64_t b = first; b < last; ++b) {
      select_with_partners_row(ord + b * n, par + b * n, n, count, flags.data(), flags.data() + n, o + b * count);
    }
  });
  return out;
}

}  // namespace

}  // namespace cpu
}  // namespace pullback

TORCH_LIBRARY_FRAGMENT(pullback_ext, m) {
  m.set_python_module("pullback_ext.ops");
  m.def("select_with_partners(Tensor order, Tensor partner, int count) -> Tensor");
}

TORCH_LIBRARY_IMPL(pullback_ext, CPU, m) {
  m.impl("select_with_partners", &pullback::cpu::select_with_partners);
}
