// Element-wise reductions used by the collectives (and by anyone combining partial results).
#pragma once

#include <cstddef>

#include "switchyard/comm/types.h"
#include "switchyard/core/dtype.h"

namespace switchyard::comm {

// dst[i] = op(a[i], b[i]) for i in [0, count). dst may equal a or b. bfloat16 is computed in
// float32 and rounded to nearest even; integer sums wrap around (two's complement).
void ReduceInto(void* dst, const void* a, const void* b, size_t count, DType dtype, ReduceOp op);

}  // namespace switchyard::comm
