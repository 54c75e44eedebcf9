#include "convert.h"

#include <fmt/format.h>

#include <utility>
#include <vector>

#include "switchyard/core/error.h"

namespace switchyard::python {
namespace {

constexpr int kCContiguousAligned = py::array::c_style;

py::array AsFloat32Array(py::handle obj) {
  // NumPy's own conversion: returns obj itself when it already fits (no copy).
  return py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(obj);
}

}  // namespace

bool WrapsWithoutCopy(py::handle obj) {
  if (!py::isinstance<py::array>(obj)) return false;
  auto a = py::reinterpret_borrow<py::array>(obj);
  const bool aligned = (reinterpret_cast<uintptr_t>(a.data()) % sizeof(float)) == 0;
  return a.dtype().is(py::dtype::of<float>()) && (a.flags() & kCContiguousAligned) && aligned;
}

Tensor TensorFromArray(py::handle obj, std::string_view name) {
  py::array a;
  if (WrapsWithoutCopy(obj)) {
    a = py::reinterpret_borrow<py::array>(obj);
  } else {
    a = AsFloat32Array(obj);
    SY_REQUIRE(a, InvalidArgument,
               "{}: expected a float32 array (or something NumPy converts to one)", name);
  }
  Shape shape(a.shape(), a.shape() + a.ndim());
  if (a.size() == 0) return Tensor::Zeros(shape);
  // The tensor keeps the array alive; the reference is dropped with the GIL held.
  auto* keep = new py::object(a);
  return Tensor::FromBlob(const_cast<void*>(a.data()), std::move(shape), DType::kFloat32,
                          [keep](void*) {
                            py::gil_scoped_acquire gil;
                            delete keep;
                          });
}

py::object ArrayFromTensor(const Tensor& t) {
  if (!t.defined()) return py::none();
  py::dtype dtype;
  switch (t.dtype()) {
    case DType::kFloat32: dtype = py::dtype::of<float>(); break;
    case DType::kInt32: dtype = py::dtype::of<int32_t>(); break;
    case DType::kInt64: dtype = py::dtype::of<int64_t>(); break;
    case DType::kInt16: dtype = py::dtype::of<int16_t>(); break;
    default: {
      Tensor f = t.To(DType::kFloat32);
      return ArrayFromTensor(f);
    }
  }
  std::vector<py::ssize_t> shape(t.shape().begin(), t.shape().end());
  if (t.numel() == 0) return py::array(dtype, shape);
  auto* handle = new Tensor(t);
  py::capsule owner(handle, [](void* p) { delete static_cast<Tensor*>(p); });
  return py::array(dtype, shape, {}, t.raw(), owner);
}

py::array_t<int64_t> ArrayFromVector(const std::vector<int64_t>& v) {
  py::array_t<int64_t> a(static_cast<py::ssize_t>(v.size()));
  std::copy(v.begin(), v.end(), a.mutable_data());
  return a;
}

moe::NamedTensors NamedFromDict(const py::dict& d) {
  moe::NamedTensors out;
  for (auto item : d) {
    std::string name = py::cast<std::string>(py::str(item.first));
    if (item.second.is_none()) continue;
    out[name] = TensorFromArray(item.second, name);
  }
  return out;
}

py::dict DictFromNamed(const moe::NamedTensors& named) {
  py::dict d;
  for (const auto& [name, t] : named) d[py::str(name)] = ArrayFromTensor(t);
  return d;
}

namespace {

// The names of docs/moe.md and where they live in LayerParams.
template <typename Params, typename Fn>
void ForEachSlot(Params& p, Fn&& fn) {
  fn("gate.weight", p.gate_weight);
  fn("gate.expert_bias", p.expert_bias);
  const std::pair<const char*, decltype(&p.experts)> groups[] = {{"experts", &p.experts},
                                                                 {"residual_mlp", &p.residual_mlp},
                                                                 {"shared_experts", &p.shared_mlp}};
  for (const auto& [prefix, w] : groups) {
    fn(fmt::format("{}.fc1.weight", prefix), w->fc1_weight);
    fn(fmt::format("{}.fc1.bias", prefix), w->fc1_bias);
    fn(fmt::format("{}.fc2.weight", prefix), w->fc2_weight);
    fn(fmt::format("{}.fc2.bias", prefix), w->fc2_bias);
    fn(fmt::format("{}.fc3.weight", prefix), w->fc3_weight);
  }
  fn("coefficient.weight", p.coefficient_weight);
  fn("coefficient.bias", p.coefficient_bias);
}

}  // namespace

moe::LayerParams ParamsFromNamedLoose(const moe::NamedTensors& named) {
  moe::LayerParams p;
  size_t used = 0;
  ForEachSlot(p, [&](const std::string& name, Tensor& t) {
    auto it = named.find(name);
    if (it != named.end()) {
      t = it->second;
      ++used;
    }
  });
  if (used != named.size()) {
    std::string unknown;
    moe::LayerParams probe;
    for (const auto& [name, t] : named) {
      bool known = false;
      ForEachSlot(probe, [&](const std::string& n, Tensor&) { known |= n == name; });
      if (!known) unknown += (unknown.empty() ? "'" : ", '") + name + "'";
    }
    throw InvalidArgument(
        fmt::format("params: unknown parameter name(s) {} (expected the names of docs/moe.md, "
                    "e.g. 'gate.weight', 'experts.fc1.weight')",
                    unknown));
  }
  return p;
}

moe::NamedTensors NamedFromParamsLoose(const moe::LayerParams& params) {
  moe::NamedTensors out;
  moe::LayerParams& p = const_cast<moe::LayerParams&>(params);
  ForEachSlot(p, [&](const std::string& name, Tensor& t) {
    if (t.defined()) out[name] = t;
  });
  return out;
}

}  // namespace switchyard::python
