// Argument checks shared by the front ends (csrc/ops/*.cpp). Each raises a Python ValueError,
// TypeError or IndexError whose message names the argument with expected and actual values.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

namespace pullback {
namespace ops {

// "[2, 5, 3]"
std::string shape_str(const at::Tensor& t);

// `t` has `dim` dimensions; `layout` names them for the message, e.g. "[B, P, r]".
void check_rank(const at::Tensor& t, const char* name, int64_t dim, const char* layout);

// t.size(d) == expected for every d where expected[d] >= 0.
void check_shape(const at::Tensor& t, const char* name, const std::vector<int64_t>& expected,
                 const char* layout);

// A floating tensor the backend of its device handles (CPU: float32, float64; CUDA: also float16
// and bfloat16), on a CPU or (in CUDA builds) CUDA device.
void check_float_input(const at::Tensor& t, const char* name);

// `t` has `ref`'s dtype and device.
void check_same_dtype(const at::Tensor& t, const char* name, const at::Tensor& ref, const char* ref_name);
void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& ref, const char* ref_name);

// An int64 index tensor [B, K] on `ref`'s device.
void check_index_tensor(const at::Tensor& idx, const char* name, const at::Tensor& ref,
                        const char* ref_name, int64_t batch);

// Batch size at least 1.
void check_batch(const at::Tensor& t, const char* name);
// A non-empty batch of tall-skinny floating matrices [B, P, r] with 1 <= r <= P.
void check_tall_skinny(const at::Tensor& t, const char* name);

// The value checks that read tensor data (lam >= 0, w >= 0, index ranges, repeated indices)
// cost a device-to-host synchronisation for CUDA tensors. They can be switched off for the
// calling thread; CPU tensors are always checked, and the CUDA kernels stay memory-safe on
// invalid values (unspecified results, never an out-of-bounds access).
void set_sync_checks(bool enabled);
bool sync_checks_enabled();
// Whether the value checks of `t` run: always for CPU tensors, else unless switched off.
bool value_checks(const at::Tensor& t);

// Every element >= 0 (NaN is left to check_finite); skipped when value_checks(t) is false.
void check_nonnegative(const at::Tensor& t, const char* name);

// Every element finite; only called when the caller asked for it.
void check_all_finite(const at::Tensor& t, const char* name);

// Row-major host copy of an int64 index tensor [B, K] (a view when it is already on the CPU).
at::Tensor host_indices(const at::Tensor& idx);

// Every idx[b, i] in [0, bound).
void check_index_range(const at::Tensor& host_idx, const char* name, int64_t bound);

}  // namespace ops
}  // namespace pullback
