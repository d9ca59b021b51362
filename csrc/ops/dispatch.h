// Calls the backend function NAME of the device `t` lives on (validated beforehand).
#pragma once

#include "kernels.h"

#ifdef WITH_CUDA
#define PULLBACK_BACKEND_CALL(t, NAME, ...) \
  ((t).is_cuda() ? ::pullback::cuda::NAME(__VA_ARGS__) : ::pullback::cpu::NAME(__VA_ARGS__))
#else
#define PULLBACK_BACKEND_CALL(t, NAME, ...) ::pullback::cpu::NAME(__VA_ARGS__)
#endif
