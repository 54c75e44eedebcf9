// Pieces of the Python module shared by its files (module.cc, parallel.cc).
#pragma once

#include <pybind11/pybind11.h>

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

// The class `Forward` (y, l_aux, z_loss, capacity, dropped, routing).
void BindForward(py::module_& m);
// The class `ParallelMoeLayer` and the MPI world functions.
void BindParallel(py::module_& m);

}  // namespace switchyard::python
