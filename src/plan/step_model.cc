// The step model (docs/planner.md, "The step model"). Quantities are per rank of the pipeline's
// last stage (the slowest: it also holds the output head), per micro-batch unless named per step.
#include "switchyard/plan/step_model.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>

#include "plan/config_view.h"
#include "plan/predict.h"
#include "switchyard/comm/algorithm_select.h"
#include "switchyard/core/error.h"
#include "switchyard/parallel/pipeline.h"
#include "switchyard/train/pipeline.h"

namespace switchyard::plan {

using internal::LayoutView;
using internal::ModelView;

namespace {

double Log2Ceil(int w) { return std::ceil(std::log2(std::max(1, w))); }

// The link a group crosses: the inter-node one when its `span` consecutive ranks do not fit in
// one node.
const LinkSpec& LinkFor(const Cluster& c, int64_t span) {
  return span > c.devices_per_node ? c.inter_node : c.intra_node;
}
int NodesSpanned(const Cluster& c, int64_t span) {
  return static_cast<int>(
      std::max<int64_t>(1, (span + c.devices_per_node - 1) / c.devices_per_node));
}

// The collectives of one kind of traffic, accumulated.
struct Traffic {
  double seconds = 0;
  double latency_s = 0;  // the messages' latency part of `seconds`
  void Add(const Cluster& c, Collective kind, double bytes, int64_t group, int64_t span,
           const char* efficiency_key, double count = 1) {
    if (group <= 1 || bytes <= 0 || count <= 0) return;
    const CollectiveCost cost =
        CostOfCollective(kind, bytes, static_cast<int>(group), LinkFor(c, span),
                         c.efficiency(efficiency_key), NodesSpanned(c, std::min(span, group)));
    seconds += count * cost.seconds;
    latency_s += count * static_cast<double>(cost.messages) * LinkFor(c, span).latency_us * 1e-6;
  }
};

// Parameters of the last stage's rank: dense (reduced over the data-parallel ranks) and expert
// (over the expert-data-parallel ranks), counted as train's memory estimate counts them.
struct StageParams {
  double dense = 0, expert = 0;
};

}  // namespace

CollectiveCost CostOfCollective(Collective kind, double bytes, int group, const LinkSpec& link,
                                double efficiency, int nodes) {
  CollectiveCost cost;
  if (group <= 1 || !(bytes > 0)) return cost;
  const double w = group;
  const double block = bytes / w;
  using comm::Algorithm;
  using comm::CollectiveKind;
  auto select = [&](CollectiveKind k) {
    comm::Topology topology;
    if (nodes > 1 && group % nodes == 0) topology = {nodes, group / nodes};
    return comm::SelectAlgorithm(k, Algorithm::kAuto, static_cast<size_t>(bytes), group, topology,
                                 false, "inprocess");
  };
  Algorithm a = Algorithm::kLinear;
  switch (kind) {
    case Collective::kAllReduce:
      a = select(CollectiveKind::kAllReduce);
      if (a == Algorithm::kTree) {  // reduce up and broadcast down: the root's side
        cost.messages = static_cast<int64_t>(2 * Log2Ceil(group));
        cost.bytes_sent = bytes * Log2Ceil(group);
        // Each level waits for the one below: the receives are on the critical path too.
        cost.bytes_sent *= 2;
      } else {
        cost.messages = 2 * (group - 1);
        cost.bytes_sent = 2 * block * (w - 1);
      }
      break;
    case Collective::kAllGather:
      a = select(CollectiveKind::kAllGather);
      cost.messages = group - 1;
      cost.bytes_sent = block * (w - 1);
      break;
    case Collective::kReduceScatter:
      a = select(CollectiveKind::kReduceScatter);
      cost.messages = group - 1;
      cost.bytes_sent = block * (w - 1);
      break;
    case Collective::kAllToAll:
      a = select(CollectiveKind::kAllToAll);
      if (a == Algorithm::kHierarchical) {
        const double m = nodes, l = w / nodes;
        cost.messages = static_cast<int64_t>((l - 1) + (m - 1));
        cost.bytes_sent = block * m * (l - 1) + block * l * (m - 1);
      } else {
        cost.messages = group - 1;
        cost.bytes_sent = block * (w - 1);
      }
      break;
    case Collective::kSendRecv:
      cost.algorithm = "sendrecv";
      cost.messages = 1;
      cost.bytes_sent = bytes;
      break;
  }
  if (kind != Collective::kSendRecv) cost.algorithm = std::string(comm::AlgorithmName(a));
  cost.seconds = static_cast<double>(cost.messages) * link.latency_us * 1e-6 +
                 cost.bytes_sent / (link.bandwidth_gbps * 1e9 * efficiency);
  return cost;
}

double GemmSeconds(const Cluster& cluster, double flops, double rows) {
  if (!(flops > 0)) return 0;
  double rate = cluster.gemm_tflops * 1e12;
  if (cluster.gemm_half_rows > 0) rate *= rows / (rows + cluster.gemm_half_rows);
  return flops / rate;
}

namespace {

StageParams LastStageParams(const ModelView& m, const LayoutView& l, double moe_blocks_stage,
                            double dense_blocks_stage) {
  const double d = m.model_dim, tp = l.tp;
  StageParams p;
  const double attention = m.attention_matrices * d * d / tp + 8 * d;
  p.dense = (moe_blocks_stage + dense_blocks_stage) * attention +
            dense_blocks_stage * static_cast<double>(m.dense_matrices) * d * m.hidden_dim / tp +
            moe_blocks_stage * m.num_experts * d +
            m.vocab_size * d / tp * (m.tied_head || l.pp > 1 ? 1 : 2) + m.seq_len * d;
  const double held = std::max<double>(
      1, static_cast<double>(m.num_experts) / static_cast<double>(std::max<int64_t>(1, l.ep)));
  p.expert = moe_blocks_stage * held * m.expert_matrices * d * m.expert_hidden_dim;
  return p;
}

}  // namespace

namespace {

// What the gradient reduction of a step depends on besides the model and the layout.
struct GradientInputs {
  double blocks = 0, moe_blocks = 0, dense_blocks = 0;  // of the last stage
  double microbatches = 1;
  double fwd_compute = 0, bwd_compute = 0;  // seconds per micro-batch
};

// The data-parallel gradient reduction and ZeRO's gathers of a step (p->dp_comm_s,
// p->dp_exposed_s) and the optimizer's pass over this rank's shard (p->optimizer_s).
void PredictGradients(const Cluster& c, const ModelView& m, const LayoutView& l,
                      const GradientInputs& in, StepPrediction* p) {
  const double blocks = in.blocks, mbs = in.microbatches;
  const double fwd_compute = in.fwd_compute, bwd_compute = in.bwd_compute;
  const int64_t stage_ranks = l.ranks / l.pp;
  const StageParams params = LastStageParams(m, l, in.moe_blocks, in.dense_blocks);
  const int64_t dense_group = l.dp * l.cp;
  const int64_t expert_group =
      std::max<int64_t>(1, stage_ranks / (l.ep * (l.megatron ? l.etp : l.tp)));
  Traffic reductions, regathers, gathers;
  // Train reduces (and ZeRO-3 gathers) the gradients block by block (param_grad_buffer.cc:
  // one bucket per block): the dense parameters in blocks + 1 units (the embeddings and the head
  // one more), the experts in one unit per MoE block; each unit its own collective.
  const double dense_units = blocks + 1, expert_units = std::max(1.0, in.moe_blocks);
  for (const auto& [count, group, units] :
       {std::tuple{params.dense, dense_group, dense_units},
        std::tuple{params.expert, expert_group, expert_units}}) {
    const double bytes = count * 4 / units;
    if (l.zero_stage == 0) {
      reductions.Add(c, Collective::kAllReduce, bytes, group, stage_ranks, "allreduce", units);
    } else {
      reductions.Add(c, Collective::kReduceScatter, bytes, group, stage_ranks, "reduce_scatter",
                     units);
      if (l.zero_stage < 3) {
        regathers.Add(c, Collective::kAllGather, bytes, group, stage_ranks, "allgather", units);
      } else {
        gathers.Add(c, Collective::kAllGather, bytes, group, stage_ranks, "allgather",
                    2 * mbs * units);
      }
    }
  }
  // Once per step over every rank: the gradient norm's all-reduce and the step's metrics (loss,
  // routing statistics: Trainer::SumOverRanks), a few floats each.
  Traffic step_sums;
  step_sums.Add(c, Collective::kAllReduce, 64, l.ranks, l.ranks, "allreduce", 2);
  // With overlap_grad_reduce (pp 1) train launches block i's reduction after its backward in
  // the last micro-batch and waits for it after block i - 1's (param_grad_buffer.cc's
  // AfterBlock): blocks - 1 of the blocks + 1 units each hide behind one block's backward; block
  // 0's and the embeddings' run after the backward. ZeRO 1-2's all-gathers follow the optimizer
  // step: exposed. (Until 2026-11-28 the model hid up to 1 - 1 / blocks of all of it; train's
  // summary measured the ranks blocked in the reduction for most of its time.)
  double grad_hidden = 0;
  if (l.overlap_grad_reduce && l.pp == 1 && blocks > 1) {
    grad_hidden = (blocks - 1) * std::min(reductions.seconds / (blocks + 1), bwd_compute / blocks);
  }
  const double grads = reductions.seconds + regathers.seconds;
  p->dp_comm_s = grads + gathers.seconds + step_sums.seconds;
  // ZeRO-3's gathers are prefetched one block ahead, so their bytes can move behind compute;
  // their latency cannot: each block waits for its gather, a synchronization of the ranks.
  p->dp_exposed_s =
      grads - grad_hidden + gathers.latency_s + step_sums.seconds +
      std::max(0.0, gathers.seconds - gathers.latency_s - mbs * (fwd_compute + bwd_compute));
  const double bw = c.memory_bandwidth_gbps * 1e9;
  const double shards = l.zero_stage >= 1 ? static_cast<double>(dense_group) : 1.0;
  p->optimizer_s = 28 * (params.dense + params.expert) / shards / bw;
}

// The makespan of a step's micro-batches (forward F, backward B seconds each on a stage; `send`
// seconds per stage boundary crossing), and with pp > 1 the schedule's bubble and its exposed
// sends (p->bubble_s, p->pp_comm_s, p->pp_exposed_s) from the schedule simulator.
double PredictPipeline(const train::TrainConfig& config, const LayoutView& l, double F, double B,
                       double send, StepPrediction* p) {
  const double mbs = static_cast<double>(l.microbatches);
  if (l.pp == 1) return mbs * (F + B);
  // The schedule depends on its config alone: built once per thread for the search's layouts.
  const parallel::ScheduleConfig schedule_config = train::PipelineScheduleConfig(config);
  thread_local std::map<std::tuple<int, int, int, int>, parallel::Schedule> schedules;
  const auto key =
      std::tuple{schedule_config.stages, schedule_config.microbatches,
                 schedule_config.virtual_stages, static_cast<int>(schedule_config.kind)};
  auto it = schedules.find(key);
  if (it == schedules.end()) {
    if (schedules.size() > 256) schedules.clear();
    it = schedules.emplace(key, parallel::MakeSchedule(schedule_config)).first;
  }
  const parallel::Schedule& schedule = it->second;
  const double v = static_cast<double>(l.virtual_stages);
  parallel::ScheduleCosts costs{.forward = F / v,
                                .backward = B / v,
                                .backward_input = B / (2 * v),
                                .backward_weight = B / (2 * v),
                                .send = 0};
  const double without_send = parallel::SimulateSchedule(schedule, costs).makespan;
  costs.send = send;
  const double pipe = parallel::SimulateSchedule(schedule, costs).makespan;
  p->bubble_s = std::max(0.0, without_send - mbs * (F + B));
  p->pp_comm_s = 2 * mbs * v * send;
  p->pp_exposed_s = std::max(0.0, pipe - without_send);
  return pipe;
}

}  // namespace

namespace {

// Shared cores: a rank computes on max(1, cores / ranks) threads (core/threading.h); with
// more ranks than cores, the ranks' compute phases share them (the collectives keep the ranks
// in step, so they compute at the same times).
Cluster RankShareOf(const Cluster& cluster, int64_t ranks) {
  Cluster c = cluster;
  if (c.shared_cores > 0) {
    const double share = ranks <= c.shared_cores
                             ? static_cast<double>(c.shared_cores / ranks)
                             : static_cast<double>(c.shared_cores) / static_cast<double>(ranks);
    c.gemm_tflops *= share;
    c.memory_bandwidth_gbps *= share;
  }
  return c;
}

// The MoE layers' routing collectives (global routing statistics, the row counts, the capacity
// or the sizes of the exchange; counted in train's --trace-step timelines) of one micro-batch:
// small, so their cost is their messages' latency, a synchronization of the ranks each. 5 per MoE
// block in forward, and one in backward with all-to-all-v (the sizes) and all-gather dispatch
// (the weights' gradients); over the expert group, or the data ranks with ep 1.
Traffic RoutingTraffic(const Cluster& c, const internal::ModelView& m,
                       const internal::LayoutView& l, double moe_blocks) {
  Traffic routing;
  if (m.moe_blocks > 0 && m.num_experts > 0) {
    const int64_t group = l.ep > 1 ? l.ep : l.dp * l.cp;
    const int64_t span = l.ep > 1 ? l.ep * (l.megatron ? l.etp : l.tp) : l.ranks / l.pp;
    const double per_block = l.dispatch == "alltoall" || l.ep == 1 ? 5.0 : 6.0;
    routing.Add(c, Collective::kAllGather, 8.0 * static_cast<double>(m.num_experts * group), group,
                span, "allgather", per_block * moe_blocks);
  }
  return routing;
}

}  // namespace

StepPrediction PredictStep(const train::TrainConfig& config, const Cluster& cluster) {
  return internal::PredictStepOf(config, internal::ReadModel(config), internal::ReadLayout(config),
                                 cluster);
}

StepPrediction internal::PredictStepOf(const train::TrainConfig& config, const ModelView& m,
                                       const LayoutView& l, const Cluster& cluster) {
  SY_REQUIRE(l.ranks <= cluster.devices(), InvalidArgument,
             "plan: {} ranks but the cluster '{}' has {} devices ({} nodes x {})", l.ranks,
             cluster.name, cluster.devices(), cluster.nodes, cluster.devices_per_node);
  const Cluster c = RankShareOf(cluster, l.ranks);
  StepPrediction p;
  p.memory = train::EstimateRankMemory(config);
  const double d = m.model_dim, tp = l.tp, S = m.seq_len;
  const double act = m.precision == "bf16" ? 2 : 4;
  const double rows =
      static_cast<double>(m.batch_size) / static_cast<double>(l.dp * l.microbatches);
  const double T = rows * S / static_cast<double>(l.cp);  // tokens of a micro-batch on the rank
  // Blocks of the last stage (the largest stage of an even split).
  const int64_t stages = l.pp * l.virtual_stages;
  const double blocks =
      static_cast<double>((m.num_layers + stages - 1) / stages * l.virtual_stages);
  const double moe_share = m.num_layers > 0 ? static_cast<double>(m.moe_blocks) / m.num_layers : 0;
  const double moe_blocks = blocks * moe_share, dense_blocks = blocks - moe_blocks;
  // MoE tokens of the rank: de-duplicated over tp (DeepSpeed) or sequence-parallel (Megatron).
  const double Tm = T / tp;
  const bool capacity_padded = l.dispatch == "alltoall" && m.capacity_factor > 0;
  const double slot_factor = capacity_padded ? std::max(1.0, m.capacity_factor) : 1.0;
  const double experts_held =
      std::max<double>(1, static_cast<double>(m.num_experts) / static_cast<double>(l.ep));
  // The busiest expert's share above the mean (dropless dispatch): two standard deviations of
  // a multinomial count of Tm k slots over the experts.
  const double mean_slots = Tm * static_cast<double>(m.top_k);
  const double per_expert =
      mean_slots * static_cast<double>(l.ep) / std::max<double>(1, m.num_experts);
  const double imbalance = capacity_padded ? 1.0 : 1.0 + 2.0 / std::sqrt(std::max(1.0, per_expert));
  const double slots = mean_slots * slot_factor * imbalance;
  const double expert_tp = l.megatron ? static_cast<double>(l.etp) : 1.0;

  // ---- compute per micro-batch (forward; backward = 2 x forward) ----
  const double proj_flops = blocks * 2 * m.attention_matrices * d * d / tp * T;
  const double ffn_flops =
      dense_blocks * 2 * static_cast<double>(m.dense_matrices) * d * m.hidden_dim / tp * T;
  const double gate_flops = moe_blocks * 2 * d * m.num_experts * Tm;
  const double expert_flops =
      moe_blocks * 2 * m.expert_matrices * d * m.expert_hidden_dim / expert_tp * slots;
  const double head_flops = 2 * d * m.vocab_size / tp * T;
  const double core_flops = blocks * 4 * S * d / tp * T;
  const double dense_gemm = GemmSeconds(c, proj_flops + ffn_flops + gate_flops + head_flops, T);
  const double expert_gemm = GemmSeconds(c, expert_flops, slots / experts_held);
  const double core = GemmSeconds(c, core_flops, S / static_cast<double>(l.cp));
  double recompute_forward = 0;  // forward work run again in backward
  if (l.recompute == "full") {
    recompute_forward = dense_gemm - GemmSeconds(c, head_flops, T) + expert_gemm + core;
  } else if (l.recompute == "selective") {
    recompute_forward = core;
  }
  const double bw = c.memory_bandwidth_gbps * 1e9;
  const double residual = l.sequence_parallel ? 12 * d / tp : 12 * d;
  // The softmax core's probabilities pass through memory (scores, softmax, its backward); the
  // flash core keeps its tiles in cache.
  const bool softmax_core = train::ResolvedAttentionCore(config) == train::AttentionCore::kSoftmax;
  const double per_token_block =
      residual + 12 * d / tp + (softmax_core ? 6.0 * m.num_heads / tp * S : 0.0);
  const double elementwise_bytes =
      3 * 4 *
      (blocks * per_token_block * T + moe_blocks * m.expert_hidden_dim * slots +
       3.0 * m.vocab_size / tp * T);
  const double elementwise = elementwise_bytes / bw;
  const double fwd_compute = dense_gemm + expert_gemm + core + elementwise / 3;
  const double bwd_compute =
      2 * (dense_gemm + expert_gemm + core) + recompute_forward + 2 * elementwise / 3;

  // ---- communication per micro-batch ----
  const int64_t stage_ranks = l.ranks / l.pp;
  Traffic tpc, cpc, epc, ppc;
  if (l.tp > 1) {
    const double buffer = T * d * 4;
    if (l.sequence_parallel) {
      tpc.Add(c, Collective::kAllGather, buffer, l.tp, l.tp, "allgather", 4 * blocks);
      tpc.Add(c, Collective::kReduceScatter, buffer, l.tp, l.tp, "reduce_scatter", 4 * blocks);
    } else {
      tpc.Add(c, Collective::kAllReduce, buffer, l.tp, l.tp, "allreduce", 4 * blocks);
    }
    tpc.Add(c, Collective::kAllReduce, T * 4, l.tp, l.tp, "allreduce", 4);  // vocab-parallel loss
    if (l.pp == 1) tpc.Add(c, Collective::kAllReduce, buffer, l.tp, l.tp, "allreduce", 2);
  }
  if (l.cp > 1) {
    const double kv = T * d / tp * 4;
    if (l.cp_algo == "ulysses") {
      cpc.Add(c, Collective::kAllToAll, kv, l.cp, l.cp * l.tp, "alltoall", 8 * blocks);
    } else {
      cpc.Add(c, Collective::kSendRecv, 2 * kv, 2, l.cp * l.tp, "sendrecv",
              3.0 * static_cast<double>(l.cp - 1) * blocks);
    }
  }
  if (l.ep > 1 && m.moe_blocks > 0) {
    const int64_t span = l.ep * (l.megatron ? l.etp : l.tp);
    const double chunks = l.dispatch == "alltoall" ? static_cast<double>(l.overlap_degree) : 1.0;
    if (l.dispatch == "allgather") {
      const double gathered = Tm * d * act * static_cast<double>(l.ep);
      epc.Add(c, Collective::kAllGather, gathered, l.ep, span, "allgather", 2 * moe_blocks);
      epc.Add(c, Collective::kReduceScatter, gathered, l.ep, span, "reduce_scatter",
              2 * moe_blocks);
    } else {
      epc.Add(c, Collective::kAllToAll, slots * d * act / chunks, l.ep, span, "alltoall",
              4 * moe_blocks * chunks);
    }
  }
  const Traffic routing = RoutingTraffic(c, m, l, moe_blocks);
  const double ep_hidden = l.overlap_degree > 1 && l.dispatch == "alltoall"
                               ? std::min(epc.seconds, 3 * expert_gemm) *
                                     (1.0 - 1.0 / static_cast<double>(l.overlap_degree))
                               : 0.0;
  double tp_hidden = 0;
  if (l.tp_comm_overlap) {
    tp_hidden = std::min(tpc.seconds * (1.0 - 1.0 / tp), 3 * GemmSeconds(c, proj_flops, T));
  }
  if (l.pp > 1) {
    const double boundary = T * d * act / (l.sequence_parallel ? tp : 1.0);
    ppc.Add(c, Collective::kSendRecv, boundary, 2, stage_ranks * l.pp, "sendrecv", 1);
  }
  const double mb_exposed =
      (tpc.seconds - tp_hidden) + cpc.seconds + (epc.seconds - ep_hidden) + routing.seconds;
  const double F = fwd_compute + mb_exposed / 2, B = bwd_compute + mb_exposed / 2;

  // ---- the pipeline ----
  const double mbs = static_cast<double>(l.microbatches);
  const double pipe = PredictPipeline(config, l, F, B, ppc.seconds, &p);

  // ---- data-parallel gradients and ZeRO, once per step ----
  PredictGradients(c, m, l,
                   GradientInputs{.blocks = blocks,
                                  .moe_blocks = moe_blocks,
                                  .dense_blocks = dense_blocks,
                                  .microbatches = mbs,
                                  .fwd_compute = fwd_compute,
                                  .bwd_compute = bwd_compute},
                   &p);

  // ---- the breakdown ----
  p.gemm_s = mbs * (3 * (dense_gemm + expert_gemm) + recompute_forward);
  p.attention_s = mbs * 3 * core;
  p.elementwise_s = mbs * elementwise;
  p.tp_comm_s = mbs * tpc.seconds;
  p.cp_comm_s = mbs * cpc.seconds;
  p.ep_comm_s = mbs * (epc.seconds + routing.seconds);
  p.tp_exposed_s = mbs * (tpc.seconds - tp_hidden);
  p.cp_exposed_s = mbs * cpc.seconds;
  p.ep_exposed_s = mbs * (epc.seconds - ep_hidden + routing.seconds);
  p.step_s = pipe + p.dp_exposed_s + p.optimizer_s;
  return p;
}

}  // namespace switchyard::plan
