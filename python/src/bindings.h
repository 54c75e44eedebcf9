// Pieces of the Python module shared by its files (module.cc, parallel.cc).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <optional>

#include "switchyard/moe/layer.h"
#include "switchyard/parallel/moe_parallel.h"

namespace switchyard::python {

namespace py = pybind11;

// One forward call's results and what its backward needs: of moe::MoeLayer (`single`) or of
// parallel::ParallelMoeLayer (`parallel`).
struct PyForward {
  moe::LayerOutput single;
  std::optional<parallel::ParallelOutput> parallel;
  const moe::LayerOutput& out() const { return parallel ? parallel->layer : single; }
};

// A forward call's options from the Python arguments, for moe::ForwardOptions and
// parallel::ParallelForwardOptions alike (the same fields).
template <typename Options>
Options ForwardCallOptions(bool training, uint64_t step, int64_t global_token_offset, int threads,
                           bool save_for_backward) {
  Options o;
  o.training = training;
  o.step = step;
  o.global_token_offset = global_token_offset;
  o.threads = threads;
  o.save_for_backward = save_for_backward;
  return o;
}

// The class `Forward` (y, l_aux, z_loss, capacity, dropped, routing).
void BindForward(py::module_& m);
// The class `ParallelMoeLayer` and the MPI world functions.
void BindParallel(py::module_& m);
// The class `CudaMoeLayer` (cuda.cc; only in builds with SY_BUILD_CUDA).
void BindCuda(py::module_& m);

}  // namespace switchyard::python
