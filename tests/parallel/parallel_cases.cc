#include "parallel/parallel_cases.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>

#include "switchyard/comm/mpi.h"
#include "switchyard/core/error.h"
#include "switchyard/core/rng.h"
#include "switchyard/parallel/expert_shard.h"
#include "switchyard/parallel/mesh.h"

namespace switchyard::parallel::testing {

moe::LayerConfig SmallConfig(int64_t num_experts, bool dropless, float capacity_factor) {
  moe::LayerConfig c;
  c.model_dim = 16;
  c.hidden_dim = 32;
  c.num_experts = num_experts;
  c.top_k = 2;
  c.dropless = dropless;
  c.capacity_factor = capacity_factor;
  c.aux_loss_coef = 0.1f;
  c.z_loss_coef = 0.01f;
  c.seed = 7;
  return c;
}

namespace {

Tensor Uniform(Shape shape, uint64_t seed, float lo, float hi) {
  Tensor t = Tensor::Empty(std::move(shape));
  CounterRng rng(seed, kStreamData);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i)
    p[i] = lo + (hi - lo) * rng.Uniform(static_cast<uint64_t>(i));
  return t;
}

}  // namespace

Inputs MakeInputs(const moe::LayerConfig& config, int64_t num_tokens, uint64_t seed) {
  Inputs in;
  in.params = moe::InitParams(config, seed);
  // Tokens have a positive mean in every dimension and expert e's gate row is pushed along it by
  // 3 - 1.5 e / M per element: early experts are popular, late ones get no tokens at all.
  const int64_t m = config.model_dim, e_num = config.num_experts;
  float* wg = in.params.gate_weight.data<float>();
  for (int64_t e = 0; e < e_num; ++e) {
    const float push = (3.0f - 1.5f * static_cast<float>(e)) / static_cast<float>(m);
    for (int64_t j = 0; j < m; ++j) wg[e * m + j] += push;
  }
  in.x = Uniform({num_tokens, m}, seed + 1, -0.5f, 1.5f);
  in.dy = Uniform({num_tokens, m}, seed + 2, -1.0f, 1.0f);
  return in;
}

namespace {

Tensor Rows(const Tensor& t, int64_t begin, int64_t end) { return t.Slice(begin, end); }

Tensor Concat(const std::vector<Tensor>& parts) {
  Shape shape = parts[0].shape();
  int64_t rows = 0;
  for (const Tensor& t : parts) rows += t.size(0);
  shape[0] = rows;
  Tensor out = Tensor::Empty(shape, parts[0].dtype());
  auto* dst = static_cast<std::byte*>(out.raw());
  for (const Tensor& t : parts) {
    if (t.nbytes()) std::memcpy(dst, t.raw(), t.nbytes());
    dst += t.nbytes();
  }
  return out;
}

void AddInto(const Tensor& dst, const Tensor& src) {
  if (!src.defined()) return;
  float* d = dst.data<float>();
  const float* s = src.data<float>();
  for (int64_t i = 0; i < dst.numel(); ++i) d[i] += s[i];
}

}  // namespace

Reference WholeBatchReference(const moe::LayerConfig& config, const Inputs& in) {
  moe::MoeLayer layer(config);
  Reference ref;
  ref.output = layer.Forward(in.params, in.x);
  moe::LayerGradients g = layer.Backward(in.params, ref.output, in.dy);
  ref.grad_x = g.x;
  ref.grads = g.params;
  ref.l_aux_per_shard = {ref.output.l_aux};
  return ref;
}

Reference PerShardReference(const moe::LayerConfig& config, const Inputs& in,
                            const std::vector<int64_t>& split,
                            const std::vector<int64_t>& global_max_load) {
  moe::MoeLayer layer(config);
  Reference ref;
  std::vector<Tensor> y, topk, loc, gates, cw, gx;
  int64_t start = 0;
  double l_aux = 0, z = 0;
  int holding = 0;
  moe::LayerOutput& o = ref.output;
  o.expert_loads.assign(static_cast<size_t>(config.num_experts), 0);
  o.expert_counts.assign(static_cast<size_t>(config.num_experts), 0);
  for (size_t d = 0; d < split.size(); ++d) {
    moe::ForwardOptions fo;
    fo.global_token_offset = start;
    if (!global_max_load.empty()) fo.global_max_load = global_max_load[d];
    const Tensor xs = Rows(in.x, start, start + split[d]);
    moe::LayerOutput out = layer.Forward(in.params, xs, fo);
    moe::LayerGradients g = layer.Backward(in.params, out, Rows(in.dy, start, start + split[d]));
    y.push_back(out.y);
    topk.push_back(out.topk_idx);
    loc.push_back(out.locations);
    gates.push_back(out.gates);
    cw.push_back(out.combine_weights);
    gx.push_back(g.x);
    for (size_t e = 0; e < o.expert_loads.size(); ++e) {
      o.expert_loads[e] += out.expert_loads[e];
      o.expert_counts[e] += out.expert_counts[e];
    }
    o.dropped += out.dropped;
    o.capacity = std::max(o.capacity, out.capacity);
    if (split[d] > 0) {  // the mean is over the shards that hold tokens
      l_aux += out.l_aux;
      z += out.z_loss;
      ++holding;
    }
    ref.l_aux_per_shard.push_back(out.l_aux);
    // Every parameter gradient summed over the shards (the variants' too, where defined).
    const auto grads_of = [](moe::LayerParams& p) {
      std::vector<Tensor*> all{&p.gate_weight, &p.coefficient_weight, &p.coefficient_bias};
      for (moe::ExpertWeights* w : {&p.experts, &p.residual_mlp, &p.shared_mlp}) {
        for (Tensor* t :
             {&w->fc1_weight, &w->fc1_bias, &w->fc2_weight, &w->fc2_bias, &w->fc3_weight}) {
          all.push_back(t);
        }
      }
      return all;
    };
    if (d == 0) {
      ref.grads = g.params;
      for (Tensor* t : grads_of(ref.grads)) {
        if (t->defined()) *t = t->Clone();
      }
    } else {
      const std::vector<Tensor*> sum = grads_of(ref.grads), add = grads_of(g.params);
      for (size_t i = 0; i < sum.size(); ++i) {
        if (sum[i]->defined()) AddInto(*sum[i], *add[i]);
      }
    }
    start += split[d];
  }
  o.y = Concat(y);
  o.topk_idx = Concat(topk);
  o.locations = Concat(loc);
  o.gates = Concat(gates);
  o.combine_weights = Concat(cw);
  o.l_aux = static_cast<float>(l_aux / std::max(holding, 1));
  o.z_loss = static_cast<float>(z / std::max(holding, 1));
  ref.grad_x = Concat(gx);
  return ref;
}

namespace {

::testing::AssertionResult Close(std::string_view what, const Tensor& a, const Tensor& b,
                                 double rtol, double atol) {
  if (a.defined() != b.defined()) {
    return ::testing::AssertionFailure()
           << what << ": defined " << a.defined() << " vs " << b.defined();
  }
  if (!a.defined()) return ::testing::AssertionSuccess();
  if (a.shape() != b.shape()) {
    return ::testing::AssertionFailure()
           << what << ": shape " << ShapeToString(a.shape()) << " vs " << ShapeToString(b.shape());
  }
  double worst = 0;
  int64_t worst_i = -1;
  for (int64_t i = 0; i < a.numel(); ++i) {
    double x = a.At(i), y = b.At(i);
    if (x == y) continue;
    double err = std::abs(x - y) / (atol + rtol * std::abs(y));
    if (!(err <= worst)) worst = err, worst_i = i;
  }
  if (worst > 1.0 || std::isnan(worst)) {
    return ::testing::AssertionFailure() << what << ": element " << worst_i << " is "
                                         << a.At(worst_i) << ", expected " << b.At(worst_i);
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult Exact(std::string_view what, const Tensor& a, const Tensor& b) {
  return Close(what, a, b, 0, 0);
}

Tensor VecTensor(const std::vector<int64_t>& v) {
  return Tensor::FromVector(v, {static_cast<int64_t>(v.size())});
}

}  // namespace

::testing::AssertionResult MatchesReference(const LayerRunResult& run, const Reference& ref,
                                            double rtol, double atol) {
  const moe::LayerOutput &a = run.output, &b = ref.output;
  std::vector<::testing::AssertionResult> checks;
  checks.push_back(Close("y", a.y, b.y, rtol, atol));
  checks.push_back(
      Close("l_aux", Tensor::Full({}, a.l_aux), Tensor::Full({}, b.l_aux), rtol, 1e-6));
  checks.push_back(
      Close("z_loss", Tensor::Full({}, a.z_loss), Tensor::Full({}, b.z_loss), rtol, 1e-6));
  checks.push_back(Exact("capacity", Tensor::Full({}, static_cast<double>(a.capacity)),
                         Tensor::Full({}, static_cast<double>(b.capacity))));
  checks.push_back(Exact("topk_idx", a.topk_idx, b.topk_idx));
  checks.push_back(Exact("locations", a.locations, b.locations));
  checks.push_back(Close("gates", a.gates, b.gates, 1e-5, 1e-6));
  checks.push_back(Close("combine_weights", a.combine_weights, b.combine_weights, 1e-5, 1e-6));
  checks.push_back(Exact("expert_loads", VecTensor(a.expert_loads), VecTensor(b.expert_loads)));
  checks.push_back(Exact("expert_counts", VecTensor(a.expert_counts), VecTensor(b.expert_counts)));
  checks.push_back(Exact("dropped", Tensor::Full({}, static_cast<double>(a.dropped)),
                         Tensor::Full({}, static_cast<double>(b.dropped))));
  if (run.has_gradients) {
    checks.push_back(Close("grad.x", run.grad_x, ref.grad_x, rtol, atol));
    checks.push_back(
        Close("grad.gate.weight", run.grads.gate_weight, ref.grads.gate_weight, rtol, atol));
    const moe::ExpertWeights &ga = run.grads.experts, &gb = ref.grads.experts;
    checks.push_back(Close("grad.experts.fc1.weight", ga.fc1_weight, gb.fc1_weight, rtol, atol));
    checks.push_back(Close("grad.experts.fc1.bias", ga.fc1_bias, gb.fc1_bias, rtol, atol));
    checks.push_back(Close("grad.experts.fc2.weight", ga.fc2_weight, gb.fc2_weight, rtol, atol));
    checks.push_back(Close("grad.experts.fc2.bias", ga.fc2_bias, gb.fc2_bias, rtol, atol));
    checks.push_back(Close("grad.experts.fc3.weight", ga.fc3_weight, gb.fc3_weight, rtol, atol));
    // The dense variants (residual MLP and its coefficient, shared expert), where the config has
    // them (undefined on both sides otherwise).
    for (const auto& [name, wa, wb] :
         {std::tuple{"residual_mlp", &run.grads.residual_mlp, &ref.grads.residual_mlp},
          std::tuple{"shared_experts", &run.grads.shared_mlp, &ref.grads.shared_mlp}}) {
      const std::string n = std::string("grad.") + name;
      checks.push_back(Close(n + ".fc1.weight", wa->fc1_weight, wb->fc1_weight, rtol, atol));
      checks.push_back(Close(n + ".fc1.bias", wa->fc1_bias, wb->fc1_bias, rtol, atol));
      checks.push_back(Close(n + ".fc2.weight", wa->fc2_weight, wb->fc2_weight, rtol, atol));
      checks.push_back(Close(n + ".fc2.bias", wa->fc2_bias, wb->fc2_bias, rtol, atol));
      checks.push_back(Close(n + ".fc3.weight", wa->fc3_weight, wb->fc3_weight, rtol, atol));
    }
    checks.push_back(Close("grad.coefficient.weight", run.grads.coefficient_weight,
                           ref.grads.coefficient_weight, rtol, atol));
    checks.push_back(Close("grad.coefficient.bias", run.grads.coefficient_bias,
                           ref.grads.coefficient_bias, rtol, atol));
  }
  std::ostringstream failures;
  for (const auto& c : checks) {
    if (!c) failures << "\n  " << c.message();
  }
  if (failures.str().empty()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << failures.str();
}

namespace {

constexpr int64_t kHidden = 32;  // SmallConfig's hidden_dim

// Whether a layout applies to (W, E) is decided here from the divisibility rules of
// docs/parallel.md ("Layouts and groups": what must divide what), not by asking the mesh: a layout
// these rules call valid is built, and a mesh that rejects it fails every test that lists the
// layouts (LayoutsFor throws) instead of dropping it quietly.

// DeepSpeed EP over `ep` ranks: E / ep experts per rank (ep | E), or each expert split along H over
// ep / E ranks (E | ep, the split dividing H).
bool DeepSpeedFits(int ep, int64_t e) {
  if (ep <= e) return e % ep == 0;
  return ep % e == 0 && kHidden % (ep / e) == 0;
}

// Megatron's folding: etp x ep ranks per expert group dividing W, ep | E, etp | H.
bool MegatronFits(int w, int etp, int ep, int64_t e) {
  return w % (etp * ep) == 0 && e % ep == 0 && kHidden % etp == 0;
}

// The mesh of a layout its rules call valid; a rejection names the layout.
Mesh MeshOf(const std::string& name, const ParallelOptions& o, int64_t e) {
  try {
    return ExpertMesh(o.mesh, e, kHidden);
  } catch (const InvalidArgument& err) {
    throw std::logic_error(
        "layout " + name + " (W=" + std::to_string(o.mesh.world_size) + ", E=" + std::to_string(e) +
        ") is valid by the divisibility rules but the mesh rejects it: " + err.what());
  }
}

}  // namespace

std::vector<Layout> LayoutsFor(int w, int64_t e) {
  std::vector<Layout> out;
  auto add = [&](std::string name, bool applies, auto&& edit) {
    if (!applies) return;
    ParallelOptions o;
    o.mesh.world_size = w;
    edit(o);
    MeshOf(name, o, e);
    out.push_back({std::move(name), o});
  };
  using D = DispatchKind;
  const bool even = w % 2 == 0;
  const bool flat = DeepSpeedFits(w, e);             // ep = W
  const bool tp2 = even && DeepSpeedFits(w / 2, e);  // tp 2 (ep = W / 2), or ep = W / 2
  // H-shards per expert with ep = W; the "sharded" layouts only where experts are split (with
  // n = 1 they would repeat ds_alltoall & co.), every r in {1, 2, 4} that divides n.
  const int n = flat && w > e ? static_cast<int>(w / e) : 1;
  add("ds_alltoall", flat, [](ParallelOptions&) {});
  add("ds_alltoallv", flat, [](ParallelOptions& o) { o.dispatch = D::kAllToAllV; });
  add("ds_allgather", flat, [](ParallelOptions& o) { o.dispatch = D::kAllGather; });
  add("ds_r0", flat, [](ParallelOptions& o) { o.adaptive_r = 0; });
  // 2 ranks per node: the expert group (W ranks) must hold whole nodes.
  add("ds_2dh", flat && w >= 4 && even,
      [](ParallelOptions& o) { o.hierarchical_ranks_per_node = 2; });
  add("ds_tp2_dedup", tp2, [](ParallelOptions& o) { o.mesh.tp = 2; });
  add("ds_tp2_dedup_alltoallv", tp2, [](ParallelOptions& o) {
    o.mesh.tp = 2;
    o.dispatch = D::kAllToAllV;
  });
  add("ds_tp2_nodedup", tp2, [](ParallelOptions& o) {
    o.mesh.tp = 2;
    o.tp_dedup = false;
  });
  add("ds_ep_replicas", tp2, [w](ParallelOptions& o) { o.mesh.ep = w / 2; });
  for (int r : {1, 2, 4}) {
    add("ds_sharded_r" + std::to_string(r), n > 1 && n % r == 0,
        [r](ParallelOptions& o) { o.adaptive_r = r; });
  }
  add("ds_sharded_auto", n > 1, [](ParallelOptions& o) { o.adaptive_r = kAdaptiveRAuto; });
  add("ds_sharded_r1_alltoallv", n > 1, [](ParallelOptions& o) {
    o.adaptive_r = 1;
    o.dispatch = D::kAllToAllV;
  });
  add("ds_sharded_r1_allgather", n > 1, [](ParallelOptions& o) {
    o.adaptive_r = 1;
    o.dispatch = D::kAllGather;
  });
  const bool etp2 = even && MegatronFits(w, 2, w / 2, e);  // etp 2, ep = W / 2
  add("mg_etp2", etp2, [](ParallelOptions& o) {
    o.mesh.arrangement = Arrangement::kMegatron;
    o.mesh.etp = 2;
    o.dispatch = D::kAllToAllV;
  });
  add("mg_etp2_r1", etp2, [](ParallelOptions& o) {
    o.mesh.arrangement = Arrangement::kMegatron;
    o.mesh.etp = 2;
    o.adaptive_r = 1;
  });
  add("mg_etp2_allgather", etp2, [](ParallelOptions& o) {
    o.mesh.arrangement = Arrangement::kMegatron;
    o.mesh.etp = 2;
    o.dispatch = D::kAllGather;
  });
  // Dense tp 2 (sequence parallel), the MoE part over all W ranks as ep.
  add("mg_tp2_sp", even && MegatronFits(w, 1, w, e), [](ParallelOptions& o) {
    o.mesh.arrangement = Arrangement::kMegatron;
    o.mesh.tp = 2;
    o.dispatch = D::kAllToAllV;
  });
  add("mg_etp2_ep2_edp2", w >= 8 && MegatronFits(w, 2, 2, e), [](ParallelOptions& o) {
    o.mesh.arrangement = Arrangement::kMegatron;
    o.mesh.etp = 2;
    o.mesh.ep = 2;
  });
  return out;
}

std::vector<Layout> OverlapLayoutsFor(int w, int64_t e) {
  std::vector<Layout> all;
  using D = DispatchKind;
  auto add = [&](std::string name, bool applies, auto&& edit) {
    if (!applies) return;
    ParallelOptions o;
    o.mesh.world_size = w;
    edit(o);
    MeshOf(name, o, e);
    all.push_back({std::move(name), o});
  };
  const bool even = w % 2 == 0;
  const bool flat = DeepSpeedFits(w, e);                      // ep = W
  const bool tp2 = even && DeepSpeedFits(w / 2, e);           // tp 2 (ep = W / 2), or ep = W / 2
  const int n = flat && w > e ? static_cast<int>(w / e) : 1;  // H-shards with ep = W
  // Shadow experts need unsharded experts (and no TP de-duplication).
  const bool shadow = flat && n == 1;
  // A cost model under which computing is slow and moving parameters cheap: shadowing the
  // popular experts of MakeInputs' skewed gate pays.
  CostModel compute_bound;
  compute_bound.link_gbps = 100;
  compute_bound.link_latency_us = 1;
  compute_bound.gemm_gflops = 1e-3;
  add("a2a_d2", flat, [](ParallelOptions& o) { o.overlap_degree = 2; });
  add("a2a_d3", flat, [](ParallelOptions& o) { o.overlap_degree = 3; });
  add("a2av_d2", flat, [](ParallelOptions& o) {
    o.dispatch = D::kAllToAllV;
    o.overlap_degree = 2;
  });
  add("a2av_d4", flat, [](ParallelOptions& o) {
    o.dispatch = D::kAllToAllV;
    o.overlap_degree = 4;
  });
  add("a2a_d2_2dh", flat && w >= 4 && even, [](ParallelOptions& o) {
    o.overlap_degree = 2;
    o.hierarchical_ranks_per_node = 2;
  });
  add("a2a_d2_tp2_dedup", tp2, [](ParallelOptions& o) {
    o.mesh.tp = 2;
    o.overlap_degree = 2;
  });
  add("a2a_d2_sharded_r1", n > 1, [](ParallelOptions& o) {
    o.adaptive_r = 1;
    o.overlap_degree = 2;
  });
  add("a2av_d2_sharded_r2", n > 1 && n % 2 == 0, [](ParallelOptions& o) {
    o.adaptive_r = 2;
    o.dispatch = D::kAllToAllV;
    o.overlap_degree = 2;
  });
  add("smart_g1", flat, [](ParallelOptions& o) { o.smart_group = 1; });
  // g = 2 divides the expert group (W ranks).
  add("smart_g2_a2av", flat && even, [](ParallelOptions& o) {
    o.smart_group = 2;
    o.dispatch = D::kAllToAllV;
  });
  // auto with a fixed, bandwidth-bound link model (1 MB/s, no latency): the cost model must then
  // pick a real schedule (g < the EP size). Measuring the model is exercised by shadow_auto.
  add("smart_auto", flat, [](ParallelOptions& o) {
    o.smart_group = kSmartAuto;
    o.cost_model = {.link_gbps = 0.001, .link_latency_us = 0, .gemm_gflops = 100};
  });
  add("smart_g1_d2_a2av", flat, [](ParallelOptions& o) {
    o.smart_group = 1;
    o.overlap_degree = 2;
    o.dispatch = D::kAllToAllV;
  });
  add("shadow_auto", shadow, [&](ParallelOptions& o) {
    o.shadow.policy = ShadowPolicy::kAuto;
    o.cost_model = compute_bound;
  });
  add("shadow_0_a2av", shadow, [](ParallelOptions& o) {
    o.shadow = ShadowFromString("0");
    o.dispatch = D::kAllToAllV;
  });
  add("shadow_0_1_d2_smart_g1", shadow, [](ParallelOptions& o) {
    o.shadow = ShadowFromString("1,0");
    o.overlap_degree = 2;
    o.smart_group = 1;
  });
  // ep = W / 2 with unsharded experts.
  add("shadow_auto_ep_replicas", tp2 && w / 2 <= e, [&](ParallelOptions& o) {
    o.mesh.ep = w / 2;
    o.shadow.policy = ShadowPolicy::kAuto;
    o.cost_model = compute_bound;
    o.overlap_degree = 2;
  });
  return all;
}

std::vector<std::string> LayoutNames(const std::vector<Layout>& layouts) {
  std::vector<std::string> names;
  for (const Layout& l : layouts) names.push_back(l.name);
  return names;
}

}  // namespace switchyard::parallel::testing

namespace switchyard::parallel {

LayerRunResult RunLayerOnRanks(const moe::LayerConfig& config, const moe::LayerParams& params,
                               const Tensor& x, const Tensor& dy, const DriverOptions& o,
                               const comm::InProcessOptions& inprocess) {
  DriverOptions d = o;
  const int w = std::max(1, d.parallel.mesh.world_size);
  if (const auto link = comm::EmulatedLink(inprocess, w);
      link && d.parallel.cost_model.link_gbps <= 0) {
    d.parallel.cost_model.link_gbps = link->bandwidth_gbps;
    d.parallel.cost_model.link_latency_us = link->latency_us;
  }
  std::unique_ptr<comm::Launcher> launcher = comm::CreateInProcessLauncher(w, inprocess);
  return RunLayerOnRanks(*launcher, config, params, x, dy, d);
}

LayerRunResult RunLayerOnMpiRanks(const moe::LayerConfig& config, const moe::LayerParams& params,
                                  const Tensor& x, const Tensor& dy, const DriverOptions& o) {
  std::unique_ptr<comm::Launcher> launcher = comm::CreateMpiLauncher();
  return RunLayerOnRanks(*launcher, config, params, x, dy, o);
}

}  // namespace switchyard::parallel
