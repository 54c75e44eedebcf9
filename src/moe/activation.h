// Fused expert activations (private to moe): branch-free loops the compiler vectorizes, with a
// polynomial exp and the Abramowitz-Stegun 7.1.26 erf (|error| <= 1.5e-7), so the elementwise
// work stays small beside the expert GEMMs. Tests compare them against kernels::ref.
#pragma once

#include <cstdint>

#include "switchyard/kernels/ops.h"

namespace switchyard::moe {

// hidden = act(pre1) * pre3 (gated, pre3 != nullptr) or act(pre1). n elements.
void ActivationForwardFast(kernels::Activation act, const float* pre1, const float* pre3,
                           float* hidden, int64_t n);

// In: d holds d hidden. Out: d holds d pre1; d_pre3 (gated) receives d pre3. n elements.
void ActivationBackwardFast(kernels::Activation act, const float* pre1, const float* pre3, float* d,
                            float* d_pre3, int64_t n);

}  // namespace switchyard::moe
