#include "switchyard/parallel/driver.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <nlohmann/json.hpp>
#include <type_traits>

#include "parallel/collectives.h"
#include "switchyard/comm/agree.h"
#include "switchyard/core/clock.h"
#include "switchyard/core/error.h"
#include "switchyard/core/threading.h"
#include "switchyard/parallel/expert_shard.h"

namespace switchyard::parallel {

std::vector<int64_t> EvenSplit(int64_t num_tokens, int shards) {
  std::vector<int64_t> split(static_cast<size_t>(shards), num_tokens / shards);
  for (int64_t d = 0; d < num_tokens % shards; ++d) ++split[static_cast<size_t>(d)];
  return split;
}

namespace {

// One rank's results, as needed to assemble the whole batch's.
struct RankResult {
  RankReport report;
  int64_t dropped = 0, capacity = 0, buffer_capacity = 0;
  int adaptive_r = 1;
  float l_aux = 0, z_loss = 0;
  double predicted_volume = 0;
  int overlap_degree = 1, smart_group = 0;
  std::vector<int64_t> shadowed;
  CostModel cost;
  std::string trace;  // MPI: this rank's serialized trace events
  Tensor y, grad_x, topk, locations, gates, combine, loads, counts;
  Tensor grad_gate;
  moe::ExpertWeights grad_experts;
  // The dense variants (residual MLP and its coefficient, shared expert), synced like the gate.
  moe::ExpertWeights grad_residual, grad_shared;
  Tensor grad_coef_w, grad_coef_b;
};

Tensor VectorTensor(const std::vector<int64_t>& v) {
  return Tensor::FromVector(v, {static_cast<int64_t>(v.size())});
}

RankResult RunRank(comm::Communicator& world, const moe::LayerConfig& config,
                   const moe::LayerParams& params, const Tensor& x, const Tensor& dy,
                   const DriverOptions& o, const std::vector<int64_t>& split, int threads,
                   Tracer* tracer) {
  const ParallelOptions& po = o.parallel;
  ParallelMoeLayer layer(config, po, MakeLayerGroups(world, config, po));
  const RankCoords& c = layer.coords();
  SY_REQUIRE(static_cast<int>(split.size()) == layer.mesh().data_shards(), InvalidArgument,
             "token split: expected {} parts (the data shards of the layout), got {}",
             layer.mesh().data_shards(), split.size());
  int64_t start = 0;
  for (int d = 0; d < c.token_shard; ++d) start += split[static_cast<size_t>(d)];
  const int64_t t_num = split[static_cast<size_t>(c.token_shard)];
  const Tensor xs = x.Slice(start, start + t_num);
  const moe::LayerParams p = layer.ShardParams(params);
  ParallelForwardOptions fo;
  fo.global_token_offset = o.global_token_offset + start;
  fo.step = o.step;
  fo.threads = threads;
  fo.save_for_backward = dy.defined();
  fo.training = o.training;
  if (!o.forced_experts.empty()) {
    const auto ids = static_cast<int64_t>(o.forced_experts.size());
    SY_REQUIRE(x.size(0) > 0 && ids % x.size(0) == 0, InvalidArgument,
               "forced_experts: expected [T, k] ids for the T = {} tokens of x, got {}", x.size(0),
               ids);
    const int64_t k = ids / x.size(0);
    fo.forced_experts =
        std::span<const int32_t>(o.forced_experts)
            .subspan(static_cast<size_t>(start * k), static_cast<size_t>(t_num * k));
  }
  RankResult r;
  r.report.coords = c;
  r.report.tokens = t_num;
  const int reps = std::max(0, o.warmup) + std::max(1, o.repeat);
  for (int rep = 0; rep < reps; ++rep) {
    if (rep == reps - 1) layer.set_tracer(tracer);
    const double t0 = NowSeconds();
    ParallelOutput out = layer.Forward(p, xs, fo);
    r.report.forward = out.stats;
    const moe::LayerOutput& lo = out.layer;
    r.y = lo.y;
    r.topk = lo.topk_idx;
    r.locations = lo.locations;
    r.gates = lo.gates;
    r.combine = lo.combine_weights;
    r.loads = VectorTensor(lo.expert_loads);
    r.counts = VectorTensor(lo.expert_counts);
    r.dropped = lo.dropped;
    r.capacity = lo.capacity;
    r.l_aux = lo.l_aux;
    r.z_loss = lo.z_loss;
    r.adaptive_r = out.adaptive_r;
    r.predicted_volume = out.predicted_volume;
    r.buffer_capacity = out.buffer_capacity;
    r.overlap_degree = out.overlap_degree;
    r.smart_group = out.smart_group;
    r.shadowed = out.shadowed;
    if (dy.defined()) {
      ParallelGradients g = layer.Backward(p, out, dy.Slice(start, start + t_num), threads);
      r.report.backward = g.stats;
      r.report.sync = CommStats{};
      layer.SyncGradients(&g.params, /*mean=*/false, &r.report.sync);
      r.grad_x = g.x;
      r.grad_gate = g.params.gate_weight;
      r.grad_experts = g.params.experts;
      r.grad_residual = g.params.residual_mlp;
      r.grad_shared = g.params.shared_mlp;
      r.grad_coef_w = g.params.coefficient_weight;
      r.grad_coef_b = g.params.coefficient_bias;
    }
    if (rep >= o.warmup) r.report.step_seconds.push_back(NowSeconds() - t0);
  }
  layer.set_tracer(nullptr);
  r.cost = layer.cost_model();
  return r;
}

// ---- MPI: results travel to rank 0 as int64 words. ----

class Writer {
 public:
  void Int(int64_t v) { words_.push_back(v); }
  void Double(double v) { words_.push_back(std::bit_cast<int64_t>(v)); }
  void Stats(const CommStats& s) {
    for (double b : s.bytes) Double(b);
    Int(s.collectives);
    Double(s.comm_seconds);
    Double(s.total_seconds);
    Double(s.busy_seconds);
    for (double t : s.traffic_comm_seconds) Double(t);
    for (double t : s.traffic_busy_seconds) Double(t);
  }
  void String(const std::string& text) {
    Int(static_cast<int64_t>(text.size()));
    const size_t at = words_.size();
    words_.resize(at + (text.size() + 7) / 8, 0);
    if (!text.empty()) std::memcpy(words_.data() + at, text.data(), text.size());
  }
  void Put(const Tensor& t) {
    Int(t.defined() ? 1 : 0);
    if (!t.defined()) return;
    Int(static_cast<int64_t>(t.dtype()));
    Int(t.dim());
    for (int64_t d : t.shape()) Int(d);
    const size_t words = (t.nbytes() + 7) / 8;
    const size_t at = words_.size();
    words_.resize(at + words, 0);
    if (t.nbytes() > 0) std::memcpy(words_.data() + at, t.raw(), t.nbytes());
  }
  std::vector<int64_t>& words() { return words_; }

 private:
  std::vector<int64_t> words_;
};

class Reader {
 public:
  explicit Reader(std::span<const int64_t> w) : w_(w) {}
  int64_t Int() {
    SY_CHECK(at_ < w_.size(), "truncated rank result");
    return w_[at_++];
  }
  double Double() { return std::bit_cast<double>(Int()); }
  CommStats Stats() {
    CommStats s;
    for (double& b : s.bytes) b = Double();
    s.collectives = static_cast<int>(Int());
    s.comm_seconds = Double();
    s.total_seconds = Double();
    s.busy_seconds = Double();
    for (double& t : s.traffic_comm_seconds) t = Double();
    for (double& t : s.traffic_busy_seconds) t = Double();
    return s;
  }
  std::string String() {
    const auto size = static_cast<size_t>(Int());
    const size_t words = (size + 7) / 8;
    SY_CHECK(at_ + words <= w_.size(), "truncated rank result");
    std::string text(size, '\0');
    if (size > 0) std::memcpy(text.data(), w_.data() + at_, size);
    at_ += words;
    return text;
  }
  Tensor Get() {
    if (Int() == 0) return Tensor();
    auto dtype = static_cast<DType>(Int());
    Shape shape(static_cast<size_t>(Int()));
    for (int64_t& d : shape) d = Int();
    Tensor t = Tensor::Empty(shape, dtype);
    const size_t words = (t.nbytes() + 7) / 8;
    SY_CHECK(at_ + words <= w_.size(), "truncated rank result");
    if (t.nbytes() > 0) std::memcpy(t.raw(), w_.data() + at_, t.nbytes());
    at_ += words;
    return t;
  }

 private:
  std::span<const int64_t> w_;
  size_t at_ = 0;
};

// The tensors of a result, in the order they travel.
template <typename Result>
auto TensorsOf(Result& r) {
  using T = std::conditional_t<std::is_const_v<Result>, const Tensor*, Tensor*>;
  std::vector<T> out{&r.y,     &r.grad_x, &r.topk,      &r.locations,   &r.gates,      &r.combine,
                     &r.loads, &r.counts, &r.grad_gate, &r.grad_coef_w, &r.grad_coef_b};
  for (auto* w : {&r.grad_experts, &r.grad_residual, &r.grad_shared}) {
    for (T t : {&w->fc1_weight, &w->fc1_bias, &w->fc2_weight, &w->fc2_bias, &w->fc3_weight}) {
      out.push_back(t);
    }
  }
  return out;
}

std::vector<int64_t> Serialize(const RankResult& r) {
  Writer w;
  const RankCoords& c = r.report.coords;
  for (int v :
       {c.rank, c.tp_rank, c.token_shard, c.expert_group, c.expert_member, c.expert_position,
        c.expert_shard, c.expert_replica, c.cp_rank, c.dp_rank, c.pp_rank}) {
    w.Int(v);
  }
  w.Int(r.report.tokens);
  w.Stats(r.report.forward);
  w.Stats(r.report.backward);
  w.Stats(r.report.sync);
  w.Int(static_cast<int64_t>(r.report.step_seconds.size()));
  for (double t : r.report.step_seconds) w.Double(t);
  w.Int(r.dropped);
  w.Int(r.capacity);
  w.Int(r.buffer_capacity);
  w.Int(r.adaptive_r);
  w.Double(r.l_aux);
  w.Double(r.z_loss);
  w.Double(r.predicted_volume);
  w.Int(r.overlap_degree);
  w.Int(r.smart_group);
  w.Int(static_cast<int64_t>(r.shadowed.size()));
  for (int64_t e : r.shadowed) w.Int(e);
  w.Double(r.cost.link_gbps);
  w.Double(r.cost.link_latency_us);
  w.Double(r.cost.gemm_gflops);
  w.String(r.trace);
  for (const Tensor* t : TensorsOf(r)) w.Put(*t);
  return std::move(w.words());
}

RankResult Deserialize(std::span<const int64_t> words) {
  Reader rd(words);
  RankResult r;
  RankCoords& c = r.report.coords;
  for (int* v :
       {&c.rank, &c.tp_rank, &c.token_shard, &c.expert_group, &c.expert_member, &c.expert_position,
        &c.expert_shard, &c.expert_replica, &c.cp_rank, &c.dp_rank, &c.pp_rank}) {
    *v = static_cast<int>(rd.Int());
  }
  r.report.tokens = rd.Int();
  r.report.forward = rd.Stats();
  r.report.backward = rd.Stats();
  r.report.sync = rd.Stats();
  r.report.step_seconds.resize(static_cast<size_t>(rd.Int()));
  for (double& t : r.report.step_seconds) t = rd.Double();
  r.dropped = rd.Int();
  r.capacity = rd.Int();
  r.buffer_capacity = rd.Int();
  r.adaptive_r = static_cast<int>(rd.Int());
  r.l_aux = static_cast<float>(rd.Double());
  r.z_loss = static_cast<float>(rd.Double());
  r.predicted_volume = rd.Double();
  r.overlap_degree = static_cast<int>(rd.Int());
  r.smart_group = static_cast<int>(rd.Int());
  r.shadowed.resize(static_cast<size_t>(rd.Int()));
  for (int64_t& e : r.shadowed) e = rd.Int();
  r.cost.link_gbps = rd.Double();
  r.cost.link_latency_us = rd.Double();
  r.cost.gemm_gflops = rd.Double();
  r.trace = rd.String();
  for (Tensor* t : TensorsOf(r)) *t = rd.Get();
  return r;
}

// Gathers every rank's result at rank 0 (others get an empty vector).
std::vector<RankResult> GatherResults(comm::Communicator& world, const RankResult& mine) {
  std::vector<int64_t> words = Serialize(mine);
  std::vector<int64_t> size{static_cast<int64_t>(words.size())};
  internal::AllReduceMax(world, size, Traffic::kRouting, nullptr);
  std::vector<int64_t> sizes = internal::AllGather(
      world, std::vector<int64_t>{static_cast<int64_t>(words.size())}, Traffic::kRouting, nullptr);
  words.resize(static_cast<size_t>(size[0]), 0);
  std::vector<int64_t> all(world.rank() == 0 ? words.size() * static_cast<size_t>(world.size())
                                             : 0);
  comm::RootedOptions ro;
  world.Gather(words.data(), all.data(), words.size(), DType::kInt64, ro).Wait();
  std::vector<RankResult> out;
  if (world.rank() != 0) return out;
  for (int p = 0; p < world.size(); ++p) {
    std::span<const int64_t> part(all.data() + static_cast<size_t>(p) * words.size(),
                                  static_cast<size_t>(sizes[static_cast<size_t>(p)]));
    out.push_back(Deserialize(part));
  }
  return out;
}

// Rows of `parts` concatenated (all of one dtype and row shape).
Tensor ConcatRows(const std::vector<Tensor>& parts) {
  SY_CHECK(!parts.empty());
  Shape shape = parts[0].shape();
  int64_t rows = 0;
  for (const Tensor& t : parts) rows += t.size(0);
  shape[0] = rows;
  Tensor out = Tensor::Empty(shape, parts[0].dtype());
  auto* dst = static_cast<std::byte*>(out.raw());
  for (const Tensor& t : parts) {
    if (t.nbytes() > 0) std::memcpy(dst, t.raw(), t.nbytes());
    dst += t.nbytes();
  }
  return out;
}

LayerRunResult Assemble(const moe::LayerConfig& config, const Mesh& mesh,
                        std::vector<RankResult>& ranks, BatchScope scope, bool with_grads) {
  LayerRunResult res;
  const int shards = mesh.data_shards();
  std::vector<const RankResult*> shard(static_cast<size_t>(shards), nullptr);
  for (const RankResult& r : ranks) {
    res.ranks.push_back(r.report);
    // Tensor-parallel duplicates (DeepSpeed) hold the same shard: the first one reports it.
    const RankResult*& slot = shard[static_cast<size_t>(r.report.coords.token_shard)];
    if (slot == nullptr) slot = &r;
  }
  auto concat = [&](Tensor RankResult::*field) {
    std::vector<Tensor> parts;
    for (const RankResult* r : shard) parts.push_back(r->*field);
    return ConcatRows(parts);
  };
  moe::LayerOutput& o = res.output;
  o.y = concat(&RankResult::y);
  o.topk_idx = concat(&RankResult::topk);
  o.locations = concat(&RankResult::locations);
  o.gates = concat(&RankResult::gates);
  o.combine_weights = concat(&RankResult::combine);
  o.expert_loads.assign(static_cast<size_t>(config.num_experts), 0);
  o.expert_counts.assign(static_cast<size_t>(config.num_experts), 0);
  // Per-rank scope: the mean over the shards that hold tokens. A shard without tokens has no
  // losses (a mean over zero tokens; it reports 0), so it is left out instead of pulling the
  // mean towards 0 (docs/parallel.md, "Batch scope").
  double l_aux = 0, z = 0;
  int holding = 0;
  for (const RankResult* r : shard) {
    for (int64_t e = 0; e < config.num_experts; ++e) {
      o.expert_loads[static_cast<size_t>(e)] += r->loads.data<int64_t>()[e];
      o.expert_counts[static_cast<size_t>(e)] += r->counts.data<int64_t>()[e];
    }
    o.dropped += r->dropped;
    o.capacity = std::max(o.capacity, r->capacity);
    if (r->report.tokens > 0) {
      l_aux += r->l_aux;
      z += r->z_loss;
      ++holding;
    }
    res.l_aux_per_shard.push_back(r->l_aux);
  }
  const RankResult& first = *shard[0];
  res.adaptive_r = first.adaptive_r;
  res.predicted_volume = first.predicted_volume;
  res.buffer_capacity = first.buffer_capacity;
  res.overlap_degree = first.overlap_degree;
  res.smart_group = first.smart_group;
  res.shadowed = first.shadowed;
  res.cost_model = ranks[0].cost;
  // The global scope's losses are the whole batch's (equal on every rank); per rank: the mean.
  const double per_rank_count = std::max(holding, 1);
  o.l_aux = scope == BatchScope::kGlobal ? first.l_aux : static_cast<float>(l_aux / per_rank_count);
  o.z_loss = scope == BatchScope::kGlobal ? first.z_loss : static_cast<float>(z / per_rank_count);
  if (!with_grads) return res;
  res.has_gradients = true;
  res.grad_x = concat(&RankResult::grad_x);
  res.grads.gate_weight = ranks[0].grad_gate;
  res.grads.residual_mlp = ranks[0].grad_residual;
  res.grads.shared_mlp = ranks[0].grad_shared;
  res.grads.coefficient_weight = ranks[0].grad_coef_w;
  res.grads.coefficient_bias = ranks[0].grad_coef_b;
  const int64_t e = config.num_experts, h = config.hidden_dim, m = config.model_dim;
  moe::ExpertWeights& full = res.grads.experts;
  full.fc1_weight = Tensor::Zeros({e, h, m});
  full.fc2_weight = Tensor::Zeros({e, m, h});
  if (config.fc_bias) {
    full.fc1_bias = Tensor::Zeros({e, h});
    full.fc2_bias = Tensor::Zeros({e, m});
  }
  if (config.gated) full.fc3_weight = Tensor::Zeros({e, h, m});
  for (const RankResult& r : ranks) {
    if (r.report.coords.expert_group != 0) continue;
    PlaceShard(r.grad_experts, ShardOf(mesh, r.report.coords.rank, config), &full);
  }
  return res;
}

std::string TensorDigest(const Tensor& t) {
  if (!t.defined()) return "(none)";
  return fmt::format("{} {}", t.ToString(), comm::ContentDigest(t.raw(), t.nbytes()));
}

// What every process of an MPI run must agree on: the layer config (key by key), the layout and
// schedule, the random-draw keys and every input tensor's shape, dtype and content digest.
comm::ConfigEntries AgreementEntries(const moe::LayerConfig& config, const moe::LayerParams& params,
                                     const Tensor& x, const Tensor& dy, const DriverOptions& o) {
  comm::ConfigEntries e;
  const nlohmann::json layer_config = nlohmann::json::parse(moe::ToJson(config));
  for (const auto& [key, value] : layer_config.items()) {
    e.emplace_back("layer config '" + key + "'", value.dump());
  }
  const ParallelOptions& p = o.parallel;
  e.emplace_back("ranks", std::to_string(p.mesh.world_size));
  e.emplace_back("tp", std::to_string(p.mesh.tp));
  e.emplace_back("ep", std::to_string(p.mesh.ep));
  e.emplace_back("etp", std::to_string(p.mesh.etp));
  e.emplace_back("arrangement", std::string(ArrangementName(p.mesh.arrangement)));
  e.emplace_back("dispatch", std::string(DispatchKindName(p.dispatch)));
  e.emplace_back("adaptive-r", std::to_string(p.adaptive_r));
  e.emplace_back("2dh", std::to_string(p.hierarchical_ranks_per_node));
  e.emplace_back("tp-dedup", p.tp_dedup ? "on" : "off");
  e.emplace_back("scope", std::string(BatchScopeName(p.batch_scope)));
  e.emplace_back("overlap-degree", std::to_string(p.overlap_degree));
  e.emplace_back("smart-schedule", std::to_string(p.smart_group));
  e.emplace_back("shadow", ShadowToString(p.shadow));
  e.emplace_back("cost model", fmt::format("{} GB/s, {} us, {} GFLOP/s", p.cost_model.link_gbps,
                                           p.cost_model.link_latency_us, p.cost_model.gemm_gflops));
  e.emplace_back("token split", fmt::format("{}", fmt::join(o.token_split, ",")));
  e.emplace_back("global-token-offset", std::to_string(o.global_token_offset));
  e.emplace_back("step", std::to_string(o.step));
  e.emplace_back("repetitions", fmt::format("{} warmup + {}", o.warmup, o.repeat));
  e.emplace_back("trace", o.tracer != nullptr ? "on" : "off");
  e.emplace_back("tensor 'x'", TensorDigest(x));
  e.emplace_back("tensor 'dy'", TensorDigest(dy));
  for (const auto& [name, t] : moe::ParamsToMap(config, params)) {
    e.emplace_back("tensor '" + name + "'", TensorDigest(t));
  }
  return e;
}

}  // namespace

LayerRunResult RunLayerOnRanks(comm::Launcher& launcher, const moe::LayerConfig& config,
                               const moe::LayerParams& params, const Tensor& x, const Tensor& dy,
                               const DriverOptions& options) {
  DriverOptions o = options;
  ExpectFloating("x", x);
  ExpectShape("x", x, {kAnySize, config.model_dim});
  if (dy.defined()) ExpectShape("dy", dy, {x.size(0), config.model_dim});
  if (config.check_finite) {
    // The whole inputs first, so that the message names the element as the single-rank layer
    // does (each rank checks its own part again: ParallelMoeLayer honours check_finite too).
    moe::CheckFinite("x", x);
    moe::CheckFinite("dy", dy);
    for (const auto& [name, t] : moe::ParamsToMap(config, params)) moe::CheckFinite(name, t);
  }
  const int launched = launcher.world_size();
  if (o.parallel.mesh.world_size == 0) o.parallel.mesh.world_size = launched;
  const int w = o.parallel.mesh.world_size;
  SY_REQUIRE(w >= 1, InvalidArgument, "ranks: expected >= 1, got {}", w);
  SY_REQUIRE(w == launched, InvalidArgument,
             "ranks {}: the launcher starts {} ranks ({}); ask for {} ranks or start {}", w,
             launched, launcher.kind(), launched, w);
  const Mesh mesh = ExpertMesh(o.parallel.mesh, config.num_experts, config.hidden_dim);
  SY_REQUIRE(mesh.pp() == 1, InvalidArgument,
             "pp {}: one MoE layer runs on one pipeline stage (pp 1)", mesh.pp());
  std::vector<int64_t> split =
      o.token_split.empty() ? EvenSplit(x.size(0), mesh.data_shards()) : o.token_split;
  int64_t total = 0;
  for (int64_t t : split) {
    SY_REQUIRE(t >= 0, InvalidArgument, "token split: negative part {}", t);
    total += t;
  }
  SY_REQUIRE(total == x.size(0), InvalidArgument,
             "token split: the parts add up to {} tokens, x has {}", total, x.size(0));

  const int local = launcher.ranks_in_process();
  const int threads = o.threads > 0 ? o.threads : ComputeThreadsPerRank(local, UsableCores());
  if (local == w) {
    // Every rank in this process: each writes its own result; the tracer is shared.
    std::vector<RankResult> results(static_cast<size_t>(w));
    launcher.Run([&](comm::Communicator& world) {
      results[static_cast<size_t>(world.rank())] =
          RunRank(world, config, params, x, dy, o, split, threads, o.tracer);
    });
    return Assemble(config, mesh, results, o.parallel.batch_scope, dy.defined());
  }
  // Ranks in other processes: they must run the same layer on the same tensors
  // (comm/agree.h); each records into its own tracer and rank 0 assembles everything.
  LayerRunResult res;
  launcher.Run([&](comm::Communicator& world) {
    comm::AgreeOnConfig(world, "layer", AgreementEntries(config, params, x, dy, o));
    Tracer local_tracer;
    RankResult mine = RunRank(world, config, params, x, dy, o, split, threads,
                              o.tracer != nullptr ? &local_tracer : nullptr);
    if (o.tracer != nullptr && world.rank() != 0) mine.trace = local_tracer.Serialize();
    std::vector<RankResult> all = GatherResults(world, mine);
    if (world.rank() != 0) {
      res.is_root = false;
      res.ranks.push_back(mine.report);
      return;
    }
    if (o.tracer != nullptr) {
      o.tracer->Merge(local_tracer.Serialize());
      for (const RankResult& r : all) o.tracer->Merge(r.trace);
    }
    res = Assemble(config, mesh, all, o.parallel.batch_scope, dy.defined());
  });
  return res;
}

}  // namespace switchyard::parallel
