// The Python module `switchyard._switchyard` (docs/python.md): the MoE layer on one rank over
// NumPy arrays, and across MPI processes (parallel.cc). The pure-Python package `switchyard`
// (python/switchyard/) wraps it; switchyard.torch builds the torch.nn.Module on top.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "convert.h"
#include "switchyard/core/error.h"
#include "switchyard/moe/config.h"
#include "switchyard/moe/layer.h"
#include "switchyard/version.h"

namespace switchyard::python {
namespace {

class PyMoeLayer {
 public:
  explicit PyMoeLayer(const std::string& config_json)
      : layer_(moe::LayerConfigFromJson(config_json)) {}

  const moe::LayerConfig& config() const { return layer_.config(); }

  std::vector<std::pair<std::string, std::vector<int64_t>>> ParamShapes() const {
    std::vector<std::pair<std::string, std::vector<int64_t>>> out;
    for (auto& [name, shape] : moe::ParamShapes(config())) out.emplace_back(name, shape);
    return out;
  }

  py::dict InitParams(uint64_t seed) const {
    return DictFromNamed(moe::ParamsToMap(config(), moe::InitParams(config(), seed)));
  }

  PyForward Forward(const py::dict& params, py::handle x, bool training, uint64_t step,
                    int64_t global_token_offset, int threads, bool save_for_backward) const {
    moe::LayerParams p = moe::ParamsFromMap(config(), NamedFromDict(params));
    Tensor xt = TensorFromArray(x, "x");
    const auto o = ForwardCallOptions<moe::ForwardOptions>(training, step, global_token_offset,
                                                           threads, save_for_backward);
    PyForward f;
    {
      py::gil_scoped_release nogil;
      f.single = layer_.Forward(p, xt, o);
    }
    return f;
  }

  // aux_loss_coef / z_loss_coef, when given, replace the config's weights of the losses in this
  // backward (the forward does not depend on them): an autograd caller passes the incoming
  // gradients of l_aux and z_loss.
  py::dict Backward(const py::dict& params, const PyForward& forward, py::handle dy, int threads,
                    std::optional<float> aux_loss_coef, std::optional<float> z_loss_coef) const {
    SY_REQUIRE(!forward.parallel, InvalidArgument,
               "backward: that forward result is of a ParallelMoeLayer, not of this MoeLayer");
    SY_REQUIRE(forward.single.state != nullptr, InvalidArgument,
               "backward: the forward was called with save_for_backward=False");
    moe::LayerParams p = moe::ParamsFromMap(config(), NamedFromDict(params));
    Tensor dyt = TensorFromArray(dy, "dy");
    moe::LayerGradients g;
    {
      py::gil_scoped_release nogil;
      if (aux_loss_coef || z_loss_coef) {
        moe::LayerConfig c = config();
        if (aux_loss_coef) c.aux_loss_coef = *aux_loss_coef;
        if (z_loss_coef) c.z_loss_coef = *z_loss_coef;
        g = moe::MoeLayer(c).Backward(p, forward.single, dyt, threads);
      } else {
        g = layer_.Backward(p, forward.single, dyt, threads);
      }
    }
    py::dict d = DictFromNamed(moe::ParamsToMap(config(), g.params));
    d["x"] = ArrayFromTensor(g.x);
    return d;
  }

 private:
  moe::MoeLayer layer_;
};

}  // namespace

void BindForward(py::module_& m) {
  py::class_<PyForward>(m, "Forward", "Results of one forward call (docs/python.md).")
      .def_property_readonly("y", [](const PyForward& f) { return ArrayFromTensor(f.out().y); })
      .def_property_readonly("l_aux", [](const PyForward& f) { return f.out().l_aux; })
      .def_property_readonly("z_loss", [](const PyForward& f) { return f.out().z_loss; })
      .def_property_readonly("capacity", [](const PyForward& f) { return f.out().capacity; })
      .def_property_readonly("dropped", [](const PyForward& f) { return f.out().dropped; })
      .def_property_readonly("routing", [](const PyForward& f) {
        const moe::LayerOutput& o = f.out();
        py::dict r;
        r["topk_idx"] = ArrayFromTensor(o.topk_idx);
        r["locations"] = ArrayFromTensor(o.locations);
        r["gates"] = ArrayFromTensor(o.gates);
        r["combine_weights"] = ArrayFromTensor(o.combine_weights);
        r["expert_loads"] = ArrayFromVector(o.expert_loads);
        r["expert_counts"] = ArrayFromVector(o.expert_counts);
        return r;
      });
}

void BindLayer(py::module_& m) {
  py::class_<PyMoeLayer>(m, "MoeLayer", "The MoE layer on one rank (docs/moe.md).")
      .def(py::init<const std::string&>(), py::arg("config_json"))
      .def_property_readonly("config_json",
                             [](const PyMoeLayer& l) { return moe::ToJson(l.config()); })
      .def_property_readonly("top_k", [](const PyMoeLayer& l) { return EffectiveTopK(l.config()); })
      .def("param_shapes", &PyMoeLayer::ParamShapes)
      .def("init_params", &PyMoeLayer::InitParams, py::arg("seed") = 0)
      .def("forward", &PyMoeLayer::Forward, py::arg("params"), py::arg("x"),
           py::arg("training") = true, py::arg("step") = 0, py::arg("global_token_offset") = 0,
           py::arg("threads") = 1, py::arg("save_for_backward") = true)
      .def("backward", &PyMoeLayer::Backward, py::arg("params"), py::arg("forward"), py::arg("dy"),
           py::arg("threads") = 1, py::arg("aux_loss_coef") = py::none(),
           py::arg("z_loss_coef") = py::none());
  m.def("wraps_without_copy", &WrapsWithoutCopy, py::arg("array"),
        "True if the layer reads this array in place (C-contiguous, aligned float32).");
}

}  // namespace switchyard::python

PYBIND11_MODULE(_switchyard, m) {
  using namespace switchyard;
  using namespace switchyard::python;
  m.doc() = "switchyard's MoE layer (C++) over NumPy arrays; see docs/python.md";
  m.attr("__version__") = kVersion;
  // Translators are tried last-registered first: the base class goes first.
  py::register_exception<Error>(m, "Error", PyExc_RuntimeError);
  py::register_exception<TimeoutError>(m, "TimeoutError", PyExc_TimeoutError);
  py::register_exception<InvalidArgument>(m, "InvalidArgument", PyExc_ValueError);

  BindForward(m);
  BindLayer(m);
  BindParallel(m);
#ifdef SY_PYTHON_CUDA
  BindCuda(m);
#else
  m.attr("has_cuda") = false;
#endif
}
