// The class `CudaMoeLayer` of the Python module (built with SY_BUILD_CUDA; docs/gpu.md): the GPU
// layer over device pointers, for switchyard.torch.MoE on CUDA tensors. Pointers and the stream
// are integers (torch's data_ptr() and torch.cuda.current_stream().cuda_stream); nothing is
// copied to the host but the routing statistics the layer itself reads.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <map>
#include <string>

#include "bindings.h"
#include "switchyard/core/error.h"
#include "switchyard/cuda/moe_layer.h"

namespace switchyard::python {
namespace {

using Pointers = std::map<std::string, uintptr_t>;

template <typename T>
T* Ptr(const Pointers& p, const char* name) {
  auto it = p.find(name);
  return it == p.end() ? nullptr : reinterpret_cast<T*>(it->second);
}

cudaStream_t Stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

cuda::DeviceParams ParamsOf(const Pointers& p) {
  cuda::DeviceParams d;
  d.gate_weight = Ptr<const float>(p, "gate.weight");
  d.expert_bias = Ptr<const float>(p, "gate.expert_bias");
  d.fc1_weight = Ptr<const float>(p, "experts.fc1.weight");
  d.fc1_bias = Ptr<const float>(p, "experts.fc1.bias");
  d.fc2_weight = Ptr<const float>(p, "experts.fc2.weight");
  d.fc2_bias = Ptr<const float>(p, "experts.fc2.bias");
  d.fc3_weight = Ptr<const float>(p, "experts.fc3.weight");
  SY_REQUIRE(d.gate_weight && d.fc1_weight && d.fc2_weight, InvalidArgument,
             "CudaMoeLayer: the parameters need 'gate.weight', 'experts.fc1.weight' and "
             "'experts.fc2.weight'");
  return d;
}

class PyCudaMoeLayer {
 public:
  PyCudaMoeLayer(const std::string& config_json, const std::string& dtype)
      : layer_(moe::LayerConfigFromJson(config_json), DTypeOf(dtype)) {}

  py::dict Forward(const Pointers& params, uintptr_t x, int64_t num_tokens, uintptr_t y,
                   uintptr_t stream) {
    cuda::DeviceParams p = ParamsOf(params);
    cuda::CudaForwardResult r;
    {
      py::gil_scoped_release nogil;
      layer_.PrepareWeights(p, Stream(stream));
      r = layer_.Forward(p, reinterpret_cast<const void*>(x), num_tokens,
                         reinterpret_cast<void*>(y), Stream(stream));
    }
    py::dict d;
    d["l_aux"] = r.l_aux;
    d["z_loss"] = r.z_loss;
    d["capacity"] = r.capacity;
    d["dropped"] = r.dropped;
    d["expert_loads"] = r.expert_loads;
    d["expert_counts"] = r.expert_counts;
    return d;
  }

  void Backward(const Pointers& params, uintptr_t dy, uintptr_t dx, const Pointers& grads,
                uintptr_t stream, float aux_loss_coef, float z_loss_coef) {
    cuda::DeviceParams p = ParamsOf(params);
    cuda::DeviceGrads g;
    g.gate_weight = Ptr<float>(grads, "gate.weight");
    g.fc1_weight = Ptr<float>(grads, "experts.fc1.weight");
    g.fc1_bias = Ptr<float>(grads, "experts.fc1.bias");
    g.fc2_weight = Ptr<float>(grads, "experts.fc2.weight");
    g.fc2_bias = Ptr<float>(grads, "experts.fc2.bias");
    g.fc3_weight = Ptr<float>(grads, "experts.fc3.weight");
    layer_.SetLossWeights(aux_loss_coef, z_loss_coef);
    py::gil_scoped_release nogil;
    layer_.Backward(p, reinterpret_cast<const void*>(dy), reinterpret_cast<void*>(dx), g,
                    Stream(stream));
  }

  py::dict Routing(uintptr_t stream) const {
    cuda::CudaRouting r = layer_.Routing(Stream(stream));
    py::dict d;
    d["topk_idx"] = r.topk_idx;
    d["locations"] = r.locations;
    d["gates"] = r.gates;
    d["combine_weights"] = r.combine_weights;
    return d;
  }

 private:
  static DType DTypeOf(const std::string& name) {
    if (name == "float32") return DType::kFloat32;
    if (name == "bfloat16") return DType::kBFloat16;
    throw InvalidArgument("CudaMoeLayer: dtype: expected 'float32' or 'bfloat16', got '" + name +
                          "'");
  }

  cuda::CudaMoeLayer layer_;
};

}  // namespace

void BindCuda(py::module_& m) {
  py::class_<PyCudaMoeLayer>(m, "CudaMoeLayer",
                             "The MoE layer on an NVIDIA GPU over device pointers (docs/gpu.md).")
      .def(py::init<const std::string&, const std::string&>(), py::arg("config_json"),
           py::arg("dtype") = "float32")
      .def("forward", &PyCudaMoeLayer::Forward, py::arg("params"), py::arg("x"),
           py::arg("num_tokens"), py::arg("y"), py::arg("stream"))
      .def("backward", &PyCudaMoeLayer::Backward, py::arg("params"), py::arg("dy"), py::arg("dx"),
           py::arg("grads"), py::arg("stream"), py::arg("aux_loss_coef"), py::arg("z_loss_coef"))
      .def("routing", &PyCudaMoeLayer::Routing, py::arg("stream"));
  m.attr("has_cuda") = true;
}

}  // namespace switchyard::python
