// CUDA kernels of merge_step (one merge of ToMe's loop, csrc/cpu/merge_step.cpp): four launches.
//
// 1. unit head-mean keys, one warp per token, in the accumulation type (float; double for double);
// 2. the ranking, one block per image: PiToMe's energies when the rule has them, the order, every A
//    token's best B token, the stable rank of the scores (a count of the values before each one:
//    the ties of torch.argsort(stable=True), csrc/merge_step.h) and the merge plan (slots, sources
//    in src order), all in an int64 workspace;
// 3. the merged rows, one warp each, with merge_tokens's CUDA arithmetic (csrc/cuda/tokens.cu:
//    acc = w_d x_d + Σ w_s x_s in source order, times 1 / total), so fused and unfused agree;
// 4. the owner map, one thread per original token.
#include <torch/library.h>

#include <cmath>

#include "common.cuh"
#include "invariants.h"
#include "merge_step.h"

namespace pullback {
namespace cuda {

namespace {

constexpr int kThreads = 256;

// The int64 workspace of one image: order[K] | slot[K] | new_index[K] | kept[K] | offsets[K + 1] |
// src[K] | dst[K] | match[K] | members[K] | ranked[K].
struct StepLayout {
  int64_t K;
  __host__ __device__ int64_t stride() const { return 10 * K + 1; }
};

template <typename T, typename Acc>
__global__ void __launch_bounds__(kThreads)
    unit_keys_kernel(const T* __restrict__ keys, int64_t H, int64_t K, int64_t hd, int64_t sb, int64_t sh,
                     int64_t sk, int64_t sd, Acc* __restrict__ metric, int64_t B) {
  const int lane = threadIdx.x % detail::kWarpSize;
  const int64_t q = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / detail::kWarpSize;
  if (q >= B * K) return;
  const int64_t b = q / K, t = q % K;
  Acc* row = metric + q * hd;
  Acc sq = 0;
  for (int64_t d = lane; d < hd; d += detail::kWarpSize) {
    Acc s = 0;
    for (int64_t h = 0; h < H; ++h) s += detail::to_acc<Acc>(keys[b * sb + h * sh + t * sk + d * sd]);
    s /= static_cast<Acc>(H);
    row[d] = s;
    sq += s * s;
  }
  sq = detail::warp_sum(sq);
  const Acc norm = max(sqrt(__shfl_sync(0xffffffffu, sq, 0)), Acc(1e-12));
  for (int64_t d = lane; d < hd; d += detail::kWarpSize) row[d] /= norm;
}

// x^y as torch's pow(Tensor, Scalar) computes it (its exact special cases, then pow).
template <typename Acc>
__device__ Acc torch_pow(Acc x, double y) {
  if (y == 0.0) return Acc(1);
  if (y == 1.0) return x;
  if (y == 0.5) return sqrt(x);
  if (y == 2.0) return x * x;
  if (y == 3.0) return x * x * x;
  return pow(x, static_cast<Acc>(y));
}

template <typename Acc>
__device__ Acc dot(const Acc* a, const Acc* b, int64_t n) {
  Acc s = 0;
  for (int64_t d = 0; d < n; ++d) s += a[d] * b[d];
  return s;
}

// The stable descending (ascending with `ascending`) rank of value i among values[0..n).
template <typename Acc>
__device__ int64_t stable_rank(const Acc* values, int64_t n, int64_t i, bool ascending) {
  const Acc v = values[i];
  int64_t rank = 0;
  for (int64_t j = 0; j < n; ++j) {
    const Acc u = values[j];
    const bool before = ascending ? merge_greater(v, u) : merge_greater(u, v);
    const bool tie = !merge_greater(u, v) && !merge_greater(v, u);
    rank += before || (tie && j < i);
  }
  return rank;
}

struct RankArgs {
  int rule;
  int64_t K, hd, prefix, count;
  double guard, margin, alpha;
};

template <typename T, typename E, typename Acc>
__global__ void __launch_bounds__(kThreads)
    rank_kernel(const Acc* __restrict__ metric, const T* __restrict__ sizes, const E* __restrict__ energy,
                Acc* __restrict__ scratch, int64_t* __restrict__ workspace, RankArgs args) {
  const MergeRule rule = static_cast<MergeRule>(args.rule);
  const int64_t K = args.K, hd = args.hd, p = args.prefix, count = args.count, n = K - p;
  const int64_t b = blockIdx.x;
  const Acc* m = metric + b * K * hd;
  Acc* values = scratch + b * K;
  int64_t* order = workspace + b * StepLayout{K}.stride();
  int64_t *slot = order + K, *new_index = slot + K, *kept = new_index + K, *offsets = kept + K;
  int64_t *src = offsets + K + 1, *dst = src + K, *match = dst + K, *members = match + K, *ranked = members + K;
  const auto size_of = [&](int64_t t) { return sizes == nullptr ? Acc(1) : detail::to_acc<Acc>(sizes[b * K + t]); };
  const auto energy_of = [&](int64_t t) { return energy == nullptr ? Acc(0) : static_cast<Acc>(energy[b * K + t]); };

  int64_t a_start = p, size_a = (K + 1) / 2 - (p + 1) / 2;
  for (int64_t t = threadIdx.x; t < p; t += blockDim.x) order[t] = t;
  if (merge_rule_is_pitome(rule)) {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      Acc total = 0;
      for (int64_t j = 0; j < n; ++j) {
        const Acc v = dot(m + (p + i) * hd, m + (p + j) * hd, hd) - static_cast<Acc>(args.margin);
        total += v > Acc(0) ? v : static_cast<Acc>(args.alpha) * expm1(v);
      }
      values[i] = total / static_cast<Acc>(n);
    }
    __syncthreads();
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) ranked[stable_rank(values, n, i, false)] = i + p;
    __syncthreads();
    const int64_t candidates = rule == MergeRule::PitomeProtected ? 2 * count : n;
    a_start = p + n - candidates;
    size_a = (candidates + 1) / 2;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {  // [prefix, protected, A, B]
      const int64_t at = i >= candidates ? p + i - candidates : (i % 2 == 0 ? a_start : a_start + size_a) + i / 2;
      order[at] = ranked[i];
    }
  } else {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const int64_t t = p + i;
      const bool in_a = t % 2 == 0;
      const int64_t first = in_a ? p + p % 2 : p + 1 - p % 2;
      order[(in_a ? p : p + size_a) + (t - first) / 2] = t;
    }
  }
  __syncthreads();

  const int64_t b_start = a_start + size_a;
  for (int64_t i = threadIdx.x; i < size_a; i += blockDim.x) {
    const int64_t a = order[a_start + i];
    Acc best = 0;
    int64_t arg = b_start;
    for (int64_t j = b_start; j < K; ++j) {
      const int64_t bt = order[j];
      const Acc cos = dot(m + a * hd, m + bt * hd, hd);
      Acc v = cos;
      if (rule == MergeRule::Bound) {
        const Acc sa = size_of(a), sb = size_of(bt), total = sa + sb;
        const Acc moved = (energy_of(a) * (sb * sb) + energy_of(bt) * (sa * sa)) / (total * total);
        v = torch_pow(moved, args.guard / 2) * sqrt(max(Acc(2) - Acc(2) * cos, Acc(0)));
      }
      const bool better = rule == MergeRule::Bound ? merge_greater(best, v) : merge_greater(v, best);
      if (j == b_start || better) {
        best = v;
        arg = j;
      }
    }
    match[i] = arg;
    values[i] = rule == MergeRule::Cosine ? torch_pow(energy_of(a), args.guard / 2) * (Acc(1) - best)
                                          : best;
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < size_a; i += blockDim.x) {
    const int64_t rank = stable_rank(values, size_a, i, merge_rule_is_guarded(rule));
    if (rank < count) {
      src[rank] = a_start + i;
      dst[rank] = match[i];
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // the plan: O(K) sequential steps
    for (int64_t pos = 0; pos < K; ++pos) slot[pos] = 0;
    for (int64_t j = 0; j < count; ++j) slot[src[j]] = -1;
    int64_t M = 0;
    for (int64_t pos = 0; pos < K; ++pos) {
      if (slot[pos] < 0) continue;
      kept[M] = pos;
      offsets[M] = 0;
      slot[pos] = M++;
    }
    offsets[M] = 0;
    for (int64_t j = 0; j < count; ++j) ++offsets[slot[dst[j]] + 1];
    for (int64_t s = 0; s < M; ++s) offsets[s + 1] += offsets[s];
    for (int64_t s = 0; s < M; ++s) match[s] = offsets[s];  // fill pointers
    for (int64_t j = 0; j < count; ++j) members[match[slot[dst[j]]]++] = src[j];
    for (int64_t j = 0; j < count; ++j) slot[src[j]] = slot[dst[j]];
  }
  __syncthreads();
  for (int64_t pos = threadIdx.x; pos < K; pos += blockDim.x) new_index[order[pos]] = slot[pos];
}

template <typename T, typename E>
__global__ void __launch_bounds__(kThreads)
    apply_kernel(const T* __restrict__ x, const T* __restrict__ sizes, const E* __restrict__ energy,
                 const int64_t* __restrict__ positions, const int64_t* __restrict__ workspace,
                 T* __restrict__ x_out, T* __restrict__ sizes_out, E* __restrict__ energy_out,
                 int64_t* __restrict__ positions_out, int64_t B, int64_t K, int64_t D, int64_t M) {
  using Acc = at::opmath_type<T>;
  using EAcc = at::opmath_type<E>;
  const int lane = threadIdx.x % detail::kWarpSize;
  const int64_t q = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / detail::kWarpSize;
  if (q >= B * M) return;
  const int64_t b = q / M, j = q % M;
  const int64_t* order = workspace + b * StepLayout{K}.stride();
  const int64_t* kept = order + 3 * K;
  const int64_t* offsets = kept + K;
  const int64_t* members = offsets + K + 1 + 3 * K;
  const int64_t n = order[kept[j]];
  const int64_t begin = offsets[j], end = offsets[j + 1];
  const auto w_of = [&](int64_t t) { return sizes == nullptr ? Acc(1) : detail::to_acc<Acc>(sizes[b * K + t]); };
  const Acc w_dst = w_of(n);
  Acc total = w_dst;
  for (int64_t s = begin; s < end; ++s) total += w_of(order[members[s]]);
  if (lane == 0) {
    sizes_out[q] = detail::from_acc<T>(total);
    positions_out[q] = positions == nullptr ? n : positions[b * K + n];
    if (energy != nullptr) {
      EAcc e = detail::to_acc<EAcc>(energy[b * K + n]);
      for (int64_t s = begin; s < end; ++s) e += detail::to_acc<EAcc>(energy[b * K + order[members[s]]]);
      energy_out[q] = detail::from_acc<E>(e);
    }
  }
  const T* xb = x + b * K * D;
  T* out = x_out + q * D;
  if (begin == end || !(total > Acc(0))) {
    for (int64_t d = lane; d < D; d += detail::kWarpSize) out[d] = xb[n * D + d];
    return;
  }
  const Acc inv_total = Acc(1) / total;
  for (int64_t d = lane; d < D; d += detail::kWarpSize) {
    Acc acc = w_dst * detail::to_acc<Acc>(xb[n * D + d]);
    for (int64_t s = begin; s < end; ++s) {
      const int64_t token = order[members[s]];
      acc += w_of(token) * detail::to_acc<Acc>(xb[token * D + d]);
    }
    out[d] = detail::from_acc<T>(acc * inv_total);
  }
}

__global__ void owner_kernel(const int64_t* __restrict__ owner, const int64_t* __restrict__ workspace,
                             int64_t* __restrict__ owner_out, int64_t B, int64_t K, int64_t N) {
  const int64_t q = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (q >= B * N) return;
  const int64_t b = q / N;
  const int64_t* new_index = workspace + b * StepLayout{K}.stride() + 2 * K;
  const int64_t t = owner == nullptr ? q % N : owner[q];
  owner_out[q] = t >= 0 && t < K ? new_index[t] : -1;  // an unchecked owner out of range: -1
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> merge_step(
    const at::Tensor& x_in, const at::Tensor& keys, const std::optional<at::Tensor>& sizes_in,
    const std::optional<at::Tensor>& energy_in, const std::optional<at::Tensor>& owner_in,
    const std::optional<at::Tensor>& positions_in, int64_t num_prefix, int64_t r, std::string rule_name,
    double guard, double margin, double alpha) {
  constexpr const char* op = "merge_step";
  const int code = merge_rule_code(rule_name);
  expect_that(code >= 0, op, "unknown rule ", rule_name);
  const MergeRule rule = static_cast<MergeRule>(code);
  expect_tensor(op, x_in, "x", {-1, -1, -1}, x_in.device(), x_in.scalar_type());
  const int64_t B = x_in.size(0), K = x_in.size(1), D = x_in.size(2);
  expect_that(0 <= num_prefix && num_prefix <= K && r >= 0, op, "num_prefix = ", num_prefix, ", r = ", r);
  expect_tensor(op, keys, "keys", {B, -1, K, -1}, x_in.device(), x_in.scalar_type());
  const bool has_sizes = sizes_in.has_value() && sizes_in->defined();
  const bool has_energy = energy_in.has_value() && energy_in->defined();
  const bool has_owner = owner_in.has_value() && owner_in->defined();
  const bool has_positions = positions_in.has_value() && positions_in->defined();
  const at::ScalarType working = x_in.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  if (has_sizes) expect_tensor(op, *sizes_in, "sizes", {B, K}, x_in.device(), x_in.scalar_type());
  if (has_energy) expect_tensor(op, *energy_in, "energy", {B, K}, x_in.device(), working);
  expect_that(has_energy || !merge_rule_is_guarded(rule), op, "rule ", rule_name, " needs energy");
  if (has_owner) expect_tensor(op, *owner_in, "owner", {B, -1}, x_in.device(), at::kLong);
  if (has_positions) expect_tensor(op, *positions_in, "positions", {B, K}, x_in.device(), at::kLong);
  const c10::cuda::CUDAGuard device_guard(x_in.device());

  const at::Tensor x = x_in.contiguous();
  const at::Tensor sizes = has_sizes ? sizes_in->contiguous() : at::Tensor();
  const at::Tensor energy = has_energy ? energy_in->contiguous() : at::Tensor();
  const at::Tensor owner = has_owner ? owner_in->contiguous() : at::Tensor();
  const at::Tensor positions = has_positions ? positions_in->contiguous() : at::Tensor();
  const int64_t R = merge_step_count(rule, r, num_prefix, K), M = K - R, N = has_owner ? owner.size(1) : K;
  const int64_t H = keys.size(1), hd = keys.size(3);
  at::Tensor x_out = at::empty({B, M, D}, x.options());
  at::Tensor sizes_out = at::empty({B, M}, x.options());
  at::Tensor energy_out = has_energy ? at::empty({B, M}, x.options().dtype(working)) : at::empty({0}, x.options());
  at::Tensor owner_out = at::empty({B, N}, x.options().dtype(at::kLong));
  at::Tensor positions_out = at::empty({B, M}, x.options().dtype(at::kLong));
  if (B == 0 || K == 0) return {x_out, sizes_out, energy_out, owner_out, positions_out};

  const at::Tensor workspace = at::empty({B, StepLayout{K}.stride()}, x.options().dtype(at::kLong));
  const cudaStream_t stream = detail::current_stream();
  const int64_t warps_per_block = kThreads / detail::kWarpSize;
  PULLBACK_DISPATCH_FLOATING(x.scalar_type(), "pullback_cuda_merge_step", [&] {
    using E = at::opmath_type<scalar_t>;  // the energies' dtype: x's working precision
    using Acc = at::opmath_type<scalar_t>;
    const at::Tensor metric = at::empty({B, K, std::max<int64_t>(hd, 1)}, x.options().dtype(working));
    const at::Tensor scratch = at::empty({B, K}, x.options().dtype(working));
    unit_keys_kernel<scalar_t, Acc>
        <<<static_cast<unsigned>(detail::ceil_div(B * K, warps_per_block)), kThreads, 0, stream>>>(
            keys.data_ptr<scalar_t>(), H, K, hd, keys.stride(0), keys.stride(1), keys.stride(2), keys.stride(3),
            metric.data_ptr<Acc>(), B);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const scalar_t* sp = has_sizes ? sizes.data_ptr<scalar_t>() : nullptr;
    const E* ep = has_energy ? energy.data_ptr<E>() : nullptr;
    const RankArgs args{code, K, hd, num_prefix, R, guard, margin, alpha};
    rank_kernel<scalar_t, E, Acc><<<static_cast<unsigned>(B), kThreads, 0, stream>>>(
        metric.data_ptr<Acc>(), sp, ep, scratch.data_ptr<Acc>(), workspace.data_ptr<int64_t>(), args);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (M > 0) {
      apply_kernel<scalar_t, E>
          <<<static_cast<unsigned>(detail::ceil_div(B * M, warps_per_block)), kThreads, 0, stream>>>(
              x.data_ptr<scalar_t>(), sp, ep, has_positions ? positions.data_ptr<int64_t>() : nullptr,
              workspace.data_ptr<int64_t>(), x_out.data_ptr<scalar_t>(), sizes_out.data_ptr<scalar_t>(),
              has_energy ? energy_out.data_ptr<E>() : nullptr, positions_out.data_ptr<int64_t>(), B, K, D, M);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  if (N > 0) {
    owner_kernel<<<static_cast<unsigned>(detail::ceil_div(B * N, kThreads)), kThreads, 0, stream>>>(
        has_owner ? owner.data_ptr<int64_t>() : nullptr, workspace.data_ptr<int64_t>(),
        owner_out.data_ptr<int64_t>(), B, K, N);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {x_out, sizes_out, energy_out, owner_out, positions_out};
}

}  // namespace

}  // namespace cuda
}  // namespace pullback

TORCH_LIBRARY_IMPL(pullback_ext, CUDA, m) {
  m.impl("merge_step", &pullback::cuda::merge_step);
}
