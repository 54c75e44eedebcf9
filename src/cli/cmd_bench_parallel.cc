// `switchyard bench layer-parallel`: one MoE layer on W ranks (threads of this process, or MPI
// processes), forward + backward + gradient sync per step: step time, tokens/s, and per rank the
// time blocked in communication vs. computing and the bytes put on the wire, against SPEC §2.3's
// predicted volume. The limit, measured interleaved in the same run (in-process only): the
// single-rank layer on the same global batch with all the cores.
#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/command.h"
#include "cli/timing.h"
#include "switchyard/comm/mpi.h"
#include "switchyard/core/rng.h"
#include "switchyard/core/threading.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/moe/layer.h"
#include "switchyard/parallel/driver.h"

namespace switchyard::cli {
namespace {

struct BenchParallelOptions {
  int64_t tokens = 4096;      // per data shard
  int64_t global_tokens = 0;  // > 0: the whole batch instead
  int64_t model_dim = 512;
  int64_t hidden_dim = 2048;
  int64_t experts = 8;
  int64_t top_k = 2;
  float capacity_factor = 1.25f;
  bool dropless = false;
  std::string activation = "gelu";
  bool gated = false;
  int ranks = 2;
  int tp = 1, ep = 0, etp = 1;
  std::string arrangement = "deepspeed";
  std::string dispatch = "alltoall";
  std::string adaptive_r = "default";
  int hierarchical = 0;
  bool no_tp_dedup = false;
  std::string scope = "global";
  std::string transport = "inproc";
  int threads = 0;
  int repeat = 3;
  int warmup = 1;
  int rounds = 2;
  bool no_reference = false;
  // Emulated topology (in-process): nodes of `emulate_per_node` ranks with alpha-beta links.
  int emulate_per_node = 0;
  double intra_gbps = 0, intra_latency_us = 0, inter_gbps = 0, inter_latency_us = 0;
  bool json = false;
};

Tensor RandomTensor(Shape shape, uint64_t seed) {
  Tensor t = Tensor::Empty(std::move(shape));
  CounterRng rng(seed, kStreamData);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = 2.0f * rng.Uniform(static_cast<uint64_t>(i)) - 1;
  return t;
}

double Median(std::vector<double> v) { return SummarizeTimes(std::move(v)).median_s; }

int RunBenchParallel(const BenchParallelOptions& o) {
  moe::LayerConfig config;
  config.model_dim = o.model_dim;
  config.hidden_dim = o.hidden_dim;
  config.num_experts = o.experts;
  config.top_k = o.top_k;
  config.capacity_factor = o.capacity_factor;
  config.dropless = o.dropless;
  config.activation = kernels::ActivationFromName(o.activation);
  config.gated = o.gated;
  moe::ValidateConfig(config);

  parallel::DriverOptions d;
  parallel::ParallelOptions& p = d.parallel;
  p.mesh.world_size = o.ranks;
  p.mesh.tp = o.tp;
  p.mesh.ep = o.ep;
  p.mesh.etp = o.etp;
  p.mesh.arrangement = parallel::ArrangementFromName(o.arrangement);
  p.dispatch = parallel::DispatchKindFromName(o.dispatch);
  p.adaptive_r = parallel::AdaptiveRFromString(o.adaptive_r);
  p.hierarchical_ranks_per_node = o.hierarchical;
  p.tp_dedup = !o.no_tp_dedup;
  p.batch_scope = parallel::BatchScopeFromName(o.scope);
  d.transport = parallel::TransportFromName(o.transport);
  d.threads = o.threads;
  d.repeat = o.repeat;
  d.warmup = o.warmup;
  if (o.emulate_per_node > 0) {
    d.inprocess.ranks_per_node = o.emulate_per_node;
    d.inprocess.emulation = comm::EmulationOptions{{o.intra_latency_us, o.intra_gbps},
                                                   {o.inter_latency_us, o.inter_gbps}};
  }
  const parallel::Mesh mesh(p.mesh, config.num_experts, config.hidden_dim);
  const int64_t t_global = o.global_tokens > 0 ? o.global_tokens : o.tokens * mesh.data_shards();

  const moe::LayerParams params = moe::InitParams(config, 1);
  const Tensor x = RandomTensor({t_global, o.model_dim}, 2);
  const Tensor dy = RandomTensor({t_global, o.model_dim}, 3);
  const bool mpi = d.transport == parallel::Transport::kMpi;
  const bool reference = !o.no_reference && !mpi;
  const int cores = UsableCores();

  // Interleaved rounds: the parallel run, then the single-rank layer on the same batch.
  std::vector<double> steps, single;
  parallel::LayerRunResult last;
  for (int round = 0; round < std::max(1, o.rounds); ++round) {
    last = parallel::RunLayerOnRanks(config, params, x, dy, d);
    if (!last.is_root) continue;
    for (size_t rep = 0; rep < last.ranks[0].step_seconds.size(); ++rep) {
      double worst = 0;
      for (const parallel::RankReport& r : last.ranks) worst = std::max(worst, r.step_seconds[rep]);
      steps.push_back(worst);
    }
    if (reference) {
      kernels::SetBlasThreads(cores);
      moe::MoeLayer layer(config);
      moe::ForwardOptions fo;
      fo.threads = cores;
      auto step = [&] {
        moe::LayerOutput out = layer.Forward(params, x, fo);
        layer.Backward(params, out, dy, cores);
      };
      for (int i = 0; i < o.warmup; ++i) step();
      for (int i = 0; i < o.repeat; ++i) {
        double t0 = NowSeconds();
        step();
        single.push_back(NowSeconds() - t0);
      }
    }
  }
  if (!last.is_root) return 0;

  const TimingStats st = SummarizeTimes(steps);
  const double tokens_per_s = static_cast<double>(t_global) / st.median_s;
  const double single_s = single.empty() ? 0 : Median(single);
  const double bytes_per_float = 4;
  // Per rank: the last step's traffic (forward + backward + sync).
  nlohmann::json ranks = nlohmann::json::array();
  double max_bytes = 0, max_token_bytes = 0, max_weight_bytes = 0;
  for (const parallel::RankReport& r : last.ranks) {
    parallel::CommStats s = r.forward;
    s += r.backward;
    s += r.sync;
    max_bytes = std::max(max_bytes, s.TotalBytes());
    max_token_bytes = std::max(max_token_bytes, s.Bytes(parallel::Traffic::kTokens));
    max_weight_bytes =
        std::max(max_weight_bytes, r.forward.Bytes(parallel::Traffic::kWeights) +
                                       r.backward.Bytes(parallel::Traffic::kWeights));
    ranks.push_back({{"rank", r.coords.rank},
                     {"tokens", r.tokens},
                     {"step_ms", Median(r.step_seconds) * 1e3},
                     {"comm_ms", s.comm_seconds * 1e3},
                     {"compute_ms", s.compute_seconds() * 1e3},
                     {"collectives", s.collectives},
                     {"bytes_tokens", s.Bytes(parallel::Traffic::kTokens)},
                     {"bytes_routing", s.Bytes(parallel::Traffic::kRouting)},
                     {"bytes_weights_fwd_bwd", r.forward.Bytes(parallel::Traffic::kWeights) +
                                                   r.backward.Bytes(parallel::Traffic::kWeights)},
                     {"bytes_grad_sync", r.sync.Bytes(parallel::Traffic::kWeights)},
                     {"bytes_tp", s.Bytes(parallel::Traffic::kTensor)}});
  }
  const double predicted_bytes = last.predicted_volume * bytes_per_float;
  const int group = mesh.expert_group_size();
  if (o.json) {
    nlohmann::json j = {{"op", "layer-parallel"},
                        {"ranks", o.ranks},
                        {"arrangement", o.arrangement},
                        {"tp", o.tp},
                        {"ep", mesh.ep()},
                        {"etp", o.etp},
                        {"expert_group", group},
                        {"dispatch", o.dispatch},
                        {"adaptive_r", last.adaptive_r},
                        {"2dh", o.hierarchical},
                        {"scope", o.scope},
                        {"transport", o.transport},
                        {"global_tokens", t_global},
                        {"model_dim", o.model_dim},
                        {"hidden_dim", o.hidden_dim},
                        {"experts", o.experts},
                        {"top_k", o.top_k},
                        {"capacity_factor", o.capacity_factor},
                        {"dropless", o.dropless},
                        {"capacity", last.output.capacity},
                        {"wire_capacity", last.buffer_capacity},
                        {"step_median_ms", st.median_s * 1e3},
                        {"step_min_ms", st.min_s * 1e3},
                        {"tokens_per_s", tokens_per_s},
                        {"single_rank_ms", single_s * 1e3},
                        {"single_rank_threads", cores},
                        {"ratio_to_single_rank", single_s > 0 ? st.median_s / single_s : 0},
                        {"predicted_volume_bytes", predicted_bytes},
                        {"max_rank_bytes", max_bytes},
                        {"max_rank_token_bytes", max_token_bytes},
                        {"max_rank_weight_bytes", max_weight_bytes},
                        {"per_rank", ranks}};
    fmt::print("{}\n", j.dump());
    return 0;
  }
  fmt::print(
      "layer-parallel: {} ranks ({}), {} tp {} ep {} etp {}: expert group {} ({} experts/rank{}), "
      "dispatch {}, r {}{}, scope {}\n",
      o.ranks, o.transport, o.arrangement, o.tp, mesh.ep(), o.etp, group, mesh.local_experts(),
      mesh.shards() > 1 ? fmt::format(", H split {}", mesh.shards()) : std::string(), o.dispatch,
      last.adaptive_r, o.hierarchical ? fmt::format(", 2DH {} ranks/node", o.hierarchical) : "",
      o.scope);
  fmt::print("  batch {} tokens ({} data shards), M {}, H {}, E {}, k {}, {}\n", t_global,
             mesh.data_shards(), o.model_dim, o.hidden_dim, o.experts, o.top_k,
             o.dropless
                 ? std::string("dropless")
                 : fmt::format("cf {} -> capacity {}, {} rows/expert/source on the wire",
                               o.capacity_factor, last.output.capacity, last.buffer_capacity));
  fmt::print(
      "  step (fwd+bwd+grad sync): median {:.1f} ms, best {:.1f} ms over {} -> {:.0f} "
      "tokens/s\n",
      st.median_s * 1e3, st.min_s * 1e3, st.repeat, tokens_per_s);
  if (single_s > 0) {
    fmt::print(
        "  limit: single-rank layer, same {} tokens, {} thread(s), interleaved: {:.1f} ms "
        "-> parallel/single = {:.2f}\n",
        t_global, cores, single_s * 1e3, st.median_s / single_s);
  }
  fmt::print(
      "  per rank (last step): tokens  step ms  comm ms  compute ms  MB tokens  MB routing  "
      "MB weights  MB grad-sync  MB tp\n");
  for (const auto& r : ranks) {
    fmt::print(
        "    {:4d} {:8d} {:8.1f} {:8.1f} {:11.1f} {:10.2f} {:11.3f} {:11.2f} {:13.2f} "
        "{:6.2f}\n",
        r["rank"].get<int>(), r["tokens"].get<int64_t>(), r["step_ms"].get<double>(),
        r["comm_ms"].get<double>(), r["compute_ms"].get<double>(),
        r["bytes_tokens"].get<double>() / 1e6, r["bytes_routing"].get<double>() / 1e6,
        r["bytes_weights_fwd_bwd"].get<double>() / 1e6, r["bytes_grad_sync"].get<double>() / 1e6,
        r["bytes_tp"].get<double>() / 1e6);
  }
  // SPEC §2.3's two terms: tokens 4 C_g r (all-to-alls there and back, forward and backward) and
  // weights 2 P / (E r) (r = 0: 2 P). On the wire a rank sends (P - 1) / P of its token volume.
  const double p_elems = static_cast<double>(o.experts) *
                         (static_cast<double>(o.hidden_dim * o.model_dim) * (o.gated ? 3.0 : 2.0) +
                          static_cast<double>(o.hidden_dim + o.model_dim));
  const int r = last.adaptive_r;
  const double weight_term =
      (r == 0 ? 2.0 * p_elems : 2.0 * p_elems / (static_cast<double>(o.experts) * r)) *
      bytes_per_float;
  const double token_term = predicted_bytes - weight_term;
  fmt::print(
      "  SPEC §2.3 for r = {}: {:.2f} MB per rank per step = tokens 4 C_g r {:.2f} MB (x (P-1)/P "
      "= {:.2f} MB; measured {:.2f} MB) + weights {} {:.2f} MB (measured {:.2f} MB)\n",
      r, predicted_bytes / 1e6, token_term / 1e6,
      token_term * (group - 1) / std::max(1, group) / 1e6, max_token_bytes / 1e6,
      r == 0 ? "2P" : "2P/(E r)", weight_term / 1e6, max_weight_bytes / 1e6);
  return 0;
}

SY_REGISTER_COMMAND(Command{
    "bench", "layer-parallel",
    "One MoE layer on W ranks: step time, tokens/s, comm vs compute and bytes per rank",
    [](CLI::App& app) -> Action {
      auto o = std::make_shared<BenchParallelOptions>();
      auto range = CLI::Range(int64_t{1}, int64_t{1} << 40);
      app.add_option("--tokens", o->tokens, "tokens per data shard (default 4096)")->check(range);
      app.add_option("--global-tokens", o->global_tokens, "tokens of the whole batch instead")
          ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
      app.add_option("--model-dim", o->model_dim, "M")->check(range);
      app.add_option("--hidden-dim", o->hidden_dim, "H")->check(range);
      app.add_option("--experts", o->experts, "E")->check(range);
      app.add_option("--top-k", o->top_k, "k")->check(range);
      app.add_option("--capacity-factor", o->capacity_factor, "cf (0: no drops)");
      app.add_flag("--dropless", o->dropless, "dropless mode");
      app.add_option("--activation", o->activation, "relu, gelu or silu");
      app.add_flag("--gated", o->gated, "gated experts");
      app.add_option("--ranks", o->ranks, "W")->check(CLI::Range(1, 4096));
      app.add_option("--tp", o->tp, "dense tensor-parallel degree")->check(CLI::Range(1, 4096));
      app.add_option("--ep", o->ep, "EP size (0: as large as possible)")
          ->check(CLI::Range(0, 4096));
      app.add_option("--etp", o->etp, "expert tensor parallel (Megatron)")
          ->check(CLI::Range(1, 4096));
      app.add_option("--arrangement", o->arrangement, "deepspeed | megatron")
          ->check(CLI::IsMember({"deepspeed", "megatron"}));
      app.add_option("--dispatch", o->dispatch, "alltoall | alltoallv | allgather")
          ->check(CLI::IsMember({"alltoall", "alltoallv", "allgather"}));
      app.add_option("--adaptive-r", o->adaptive_r, "R (0 or a divisor of the H shards) or auto");
      app.add_option("--2dh", o->hierarchical, "hierarchical all-to-all with this many ranks/node")
          ->check(CLI::Range(0, 4096));
      app.add_flag("--no-tp-dedup", o->no_tp_dedup, "DeepSpeed arrangement: no TP de-duplication");
      app.add_option("--scope", o->scope, "global | per_rank (capacity, slots and l_aux)")
          ->check(CLI::IsMember({"global", "per_rank"}));
      app.add_option("--transport", o->transport, "inproc | mpi")
          ->check(CLI::IsMember({"inproc", "mpi"}));
      app.add_option("--threads", o->threads, "compute threads per rank (0: cores / ranks)")
          ->check(CLI::Range(0, 256));
      app.add_option("--repeat", o->repeat, "timed steps per round")->check(CLI::Range(1, 10000));
      app.add_option("--warmup", o->warmup, "untimed steps per round")->check(CLI::Range(0, 10000));
      app.add_option("--rounds", o->rounds, "interleaved rounds (parallel, then single-rank)")
          ->check(CLI::Range(1, 1000));
      app.add_flag("--no-reference", o->no_reference, "skip the single-rank limit");
      app.add_option("--emulate-ranks-per-node", o->emulate_per_node,
                     "in-process: emulate nodes of this many ranks (alpha-beta link costs)")
          ->check(CLI::Range(0, 4096));
      app.add_option("--intra-gbps", o->intra_gbps, "emulated intra-node bandwidth, GB/s");
      app.add_option("--intra-latency-us", o->intra_latency_us, "emulated intra-node latency");
      app.add_option("--inter-gbps", o->inter_gbps, "emulated inter-node bandwidth, GB/s");
      app.add_option("--inter-latency-us", o->inter_latency_us, "emulated inter-node latency");
      app.add_flag("--json", o->json, "one JSON line instead of text");
      return [o] { return RunBenchParallel(*o); };
    }});

}  // namespace
}  // namespace switchyard::cli
