// ParallelMoeLayer from Python: this process is one rank of an MPI job (the world of mpi4py, or of
// MPI initialized here). docs/python.md, "Expert parallelism".
//
// MPI: if MPI is already initialized (mpi4py does that when it is imported) switchyard uses it and
// never finalizes it; otherwise switchyard initializes it on first use and finalizes it at exit.
// The world communicator and the process groups are created on first use and shared by every
// layer; close_mpi() drops them (the Python package calls it at exit, before mpi4py finalizes).
#include <pybind11/stl.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "bindings.h"
#include "convert.h"
#include "switchyard/comm/mpi.h"
#include "switchyard/core/error.h"
#include "switchyard/parallel/mesh.h"
#include "switchyard/parallel/moe_parallel.h"

namespace switchyard::python {
namespace {

struct MpiState {
  std::shared_ptr<comm::Communicator> world;
  // Groups by mesh (shared between layers with the same mesh, as the C++ API asks).
  std::map<std::string, std::shared_ptr<parallel::ProcessGroups>> groups;
};

MpiState& State() {
  static MpiState* state = new MpiState();  // dropped by close_mpi, not by static destruction
  return *state;
}

std::shared_ptr<comm::Communicator> World() {
  MpiState& s = State();
  if (!s.world) s.world = comm::CreateMpiWorld();
  return s.world;
}

template <typename T>
T Get(const py::dict& d, const char* key, T fallback) {
  return d.contains(key) ? py::cast<T>(d[key]) : fallback;
}

parallel::ParallelOptions OptionsFromDict(const py::dict& d) {
  static const char* kKeys[] = {"ep",
                                "tp",
                                "etp",
                                "arrangement",
                                "sequence_parallel",
                                "dispatch",
                                "batch_scope",
                                "adaptive_r",
                                "hierarchical_ranks_per_node",
                                "overlap_degree",
                                "smart_group",
                                "tp_dedup",
                                "dispatch_dedup"};
  for (auto item : d) {
    std::string key = py::cast<std::string>(py::str(item.first));
    bool known = false;
    for (const char* k : kKeys) known |= key == k;
    SY_REQUIRE(known, InvalidArgument,
               "parallel option '{}': unknown (expected one of ep, tp, etp, arrangement, "
               "sequence_parallel, dispatch, batch_scope, adaptive_r, "
               "hierarchical_ranks_per_node, overlap_degree, smart_group, tp_dedup, "
               "dispatch_dedup)",
               key);
  }
  parallel::ParallelOptions o;
  o.mesh.ep = Get<int>(d, "ep", 0);
  o.mesh.tp = Get<int>(d, "tp", 1);
  o.mesh.etp = Get<int>(d, "etp", 1);
  o.mesh.arrangement =
      parallel::ArrangementFromName(Get<std::string>(d, "arrangement", "deepspeed"));
  if (d.contains("sequence_parallel")) {
    o.mesh.sequence_parallel = py::cast<bool>(d["sequence_parallel"]);
  }
  o.dispatch = parallel::DispatchKindFromName(Get<std::string>(d, "dispatch", "alltoall"));
  o.batch_scope = parallel::BatchScopeFromName(Get<std::string>(d, "batch_scope", "global"));
  if (d.contains("adaptive_r")) {
    o.adaptive_r = parallel::AdaptiveRFromString(py::cast<std::string>(py::str(d["adaptive_r"])));
  }
  o.hierarchical_ranks_per_node = Get<int>(d, "hierarchical_ranks_per_node", 0);
  o.overlap_degree = Get<int>(d, "overlap_degree", 1);
  if (d.contains("smart_group")) {
    o.smart_group =
        parallel::SmartGroupFromString(py::cast<std::string>(py::str(d["smart_group"])));
  }
  o.tp_dedup = Get<bool>(d, "tp_dedup", true);
  o.dispatch_dedup = Get<bool>(d, "dispatch_dedup", true);
  return o;
}

class PyParallelLayer {
 public:
  PyParallelLayer(const std::string& config_json, const py::dict& options) : world_(World()) {
    moe::LayerConfig config = moe::LayerConfigFromJson(config_json);
    parallel::ParallelOptions o = OptionsFromDict(options);
    parallel::Mesh mesh = parallel::LayerMesh(config, o, world_->size());
    // Layers whose meshes have the same groups share them (collective on first use).
    const std::string key = fmt::format(
        "{} tp{} ep{} etp{} {} sp{} n{}", world_->size(), o.mesh.tp, mesh.ep(), o.mesh.etp,
        parallel::ArrangementName(o.mesh.arrangement),
        o.mesh.sequence_parallel ? int(*o.mesh.sequence_parallel) : -1, config.num_experts);
    auto& cached = State().groups[key];
    if (!cached) {
      py::gil_scoped_release nogil;
      cached = parallel::MakeLayerGroups(*world_, config, o);
    }
    groups_ = cached;
    layer_ = std::make_unique<parallel::ParallelMoeLayer>(config, o, groups_);
  }

  py::dict ShardParams(const py::dict& full) const {
    moe::LayerParams p = moe::ParamsFromMap(layer_->config(), NamedFromDict(full));
    return DictFromNamed(NamedFromParamsLoose(layer_->ShardParams(p)));
  }

  PyForward Forward(const py::dict& params, py::handle x, bool training, uint64_t step,
                    int64_t global_token_offset, int threads, bool save_for_backward) {
    moe::LayerParams p = ParamsFromNamedLoose(NamedFromDict(params));
    Tensor xt = TensorFromArray(x, "x");
    const auto o = ForwardCallOptions<parallel::ParallelForwardOptions>(
        training, step, global_token_offset, threads, save_for_backward);
    PyForward f;
    py::gil_scoped_release nogil;
    f.parallel = layer_->Forward(p, xt, o);
    return f;
  }

  // aux_loss_coef / z_loss_coef as in MoeLayer.backward: the backward runs on a sibling layer with
  // those loss weights (same config otherwise, same groups; ParallelMoeLayer::Backward takes the
  // weights from its config and everything else from the forward's state). Siblings are kept.
  py::dict Backward(const py::dict& params, const PyForward& forward, py::handle dy, int threads,
                    bool sync, bool mean, std::optional<float> aux_loss_coef,
                    std::optional<float> z_loss_coef) {
    SY_REQUIRE(forward.parallel && forward.parallel->state, InvalidArgument,
               "backward: expected the result of this ParallelMoeLayer's forward with "
               "save_for_backward=True");
    moe::LayerParams p = ParamsFromNamedLoose(NamedFromDict(params));
    Tensor dyt = TensorFromArray(dy, "dy");
    parallel::ParallelGradients g;
    {
      py::gil_scoped_release nogil;
      parallel::ParallelMoeLayer& l = WithLossWeights(aux_loss_coef, z_loss_coef);
      g = l.Backward(p, *forward.parallel, dyt, threads);
      if (sync) l.SyncGradients(&g.params, mean);
    }
    py::dict d = DictFromNamed(NamedFromParamsLoose(g.params));
    d["x"] = ArrayFromTensor(g.x);
    return d;
  }

  const parallel::ParallelMoeLayer& layer() const { return *layer_; }
  parallel::ParallelMoeLayer& WithLossWeights(std::optional<float> aux, std::optional<float> z) {
    moe::LayerConfig c = layer_->config();
    if (aux) c.aux_loss_coef = *aux;
    if (z) c.z_loss_coef = *z;
    if (c.aux_loss_coef == layer_->config().aux_loss_coef &&
        c.z_loss_coef == layer_->config().z_loss_coef) {
      return *layer_;
    }
    auto& sibling = siblings_[{c.aux_loss_coef, c.z_loss_coef}];
    if (!sibling)
      sibling = std::make_unique<parallel::ParallelMoeLayer>(c, layer_->options(), groups_);
    return *sibling;
  }
  int rank() const { return world_->rank(); }
  int world_size() const { return world_->size(); }

 private:
  std::shared_ptr<comm::Communicator> world_;
  std::shared_ptr<parallel::ProcessGroups> groups_;
  std::unique_ptr<parallel::ParallelMoeLayer> layer_;
  std::map<std::pair<float, float>, std::unique_ptr<parallel::ParallelMoeLayer>> siblings_;
};

}  // namespace

void BindParallel(py::module_& m) {
  py::class_<PyParallelLayer>(m, "ParallelMoeLayer",
                              "The MoE layer across the ranks of an MPI job (docs/parallel.md).")
      .def(py::init<const std::string&, const py::dict&>(), py::arg("config_json"),
           py::arg("options"))
      .def_property_readonly("rank", &PyParallelLayer::rank)
      .def_property_readonly("world_size", &PyParallelLayer::world_size)
      .def_property_readonly(
          "first_expert",
          [](const PyParallelLayer& l) { return l.layer().shard_spec().first_expert; })
      .def_property_readonly(
          "local_experts",
          [](const PyParallelLayer& l) { return l.layer().shard_spec().local_experts; })
      .def_property_readonly("shards",
                             [](const PyParallelLayer& l) { return l.layer().shard_spec().shards; })
      .def_property_readonly("shard",
                             [](const PyParallelLayer& l) { return l.layer().shard_spec().shard; })
      .def_property_readonly(
          "data_shards", [](const PyParallelLayer& l) { return l.layer().mesh().data_shards(); })
      .def("shard_params", &PyParallelLayer::ShardParams, py::arg("params"))
      .def("forward", &PyParallelLayer::Forward, py::arg("params"), py::arg("x"),
           py::arg("training") = true, py::arg("step") = 0, py::arg("global_token_offset") = 0,
           py::arg("threads") = 1, py::arg("save_for_backward") = true)
      .def("backward", &PyParallelLayer::Backward, py::arg("params"), py::arg("forward"),
           py::arg("dy"), py::arg("threads") = 1, py::arg("sync") = true, py::arg("mean") = false,
           py::arg("aux_loss_coef") = py::none(), py::arg("z_loss_coef") = py::none());
  m.def("mpi_compiled_in", &comm::MpiCompiledIn);
  m.def(
      "close_mpi",
      [] {
        MpiState& s = State();
        py::gil_scoped_release nogil;
        s.groups.clear();
        s.world.reset();
      },
      "Drops the shared MPI world and process groups (layers still alive keep theirs).");
}

}  // namespace switchyard::python
