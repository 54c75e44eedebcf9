// Conversions between NumPy arrays and switchyard tensors for the Python module (docs/python.md,
// "Memory").
//
// Arrays in: a C-contiguous, aligned float32 array is wrapped without a copy; the tensor keeps a
// reference to the array, so the memory lives as long as any tensor (or saved forward state) uses
// it. Any other array (another dtype, strided, Fortran order) is first converted to a
// contiguous float32 copy by NumPy.
// Tensors out: an array over the tensor's own memory (no copy); the array holds a handle to the
// tensor, so the memory lives as long as the array (and anything made from it, such as a
// torch tensor from torch.from_numpy).
//
// Thread-safety: call with the GIL held.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>
#include <string_view>

#include "switchyard/core/tensor.h"
#include "switchyard/moe/layer.h"

namespace switchyard::python {

namespace py = pybind11;

// `obj` (any array-like) as a float32 tensor; `name` names it in errors.
Tensor TensorFromArray(py::handle obj, std::string_view name);
// True if TensorFromArray(obj) would wrap obj's memory without copying.
bool WrapsWithoutCopy(py::handle obj);
// An array over t's memory (float32, int32 or int64; undefined -> None).
py::object ArrayFromTensor(const Tensor& t);
// A 1-D int64 array of the values.
py::array_t<int64_t> ArrayFromVector(const std::vector<int64_t>& v);

// A dict {name: array} of tensors.
moe::NamedTensors NamedFromDict(const py::dict& d);
py::dict DictFromNamed(const moe::NamedTensors& named);

// Parameters by name without shape checks (the parallel layer checks a shard's shapes itself):
// "gate.weight", "gate.expert_bias", "experts.fc1.weight", ... as in docs/moe.md.
moe::LayerParams ParamsFromNamedLoose(const moe::NamedTensors& named);
moe::NamedTensors NamedFromParamsLoose(const moe::LayerParams& params);

}  // namespace switchyard::python
