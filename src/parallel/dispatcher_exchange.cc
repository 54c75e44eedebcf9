// The token-exchange dispatcher: all-to-all (fixed capacity) or all-to-all-v (variable size),
// pipelined (overlap degree, smart schedule) by TokenExchange, with shadowed experts computed
// locally while the first transfers travel.
#include <algorithm>
#include <functional>
#include <utility>

#include "parallel/collectives.h"
#include "parallel/dedup_exchange.h"
#include "parallel/dispatcher.h"
#include "parallel/exchange.h"
#include "parallel/shadow.h"
#include "parallel/trace_context.h"
#include "switchyard/moe/dispatch.h"

namespace switchyard::parallel::internal {
namespace {

// sum += g for every defined tensor (sum empty: takes g).
void Accumulate(moe::ExpertWeights* sum, const moe::ExpertWeights& g) {
  if (!sum->fc1_weight.defined()) {
    *sum = g;
    return;
  }
  AddInto(sum->fc1_weight, g.fc1_weight);
  AddInto(sum->fc2_weight, g.fc2_weight);
  if (g.fc1_bias.defined()) AddInto(sum->fc1_bias, g.fc1_bias);
  if (g.fc2_bias.defined()) AddInto(sum->fc2_bias, g.fc2_bias);
  if (g.fc3_weight.defined()) AddInto(sum->fc3_weight, g.fc3_weight);
}

// One step: the exchange's layout (counts exchanged at construction), the shadowed experts, the
// activations of every pipeline phase and the outputs in the plan's buffer layout.
class ExchangeStep : public BufferStep {
 public:
  ExchangeStep(ProcessGroups& groups, bool dedup, bool prescore, int64_t num_experts,
               int64_t local_experts, const ExchangeSpec& spec, std::vector<int64_t> shadowed,
               const StepInput& in, CommStats* stats)
      : BufferStep(groups, dedup, prescore) {
    comm::Communicator& expert = groups.Get(GroupKind::kExpert);
    ExchangeSpec es = spec;
    if (!shadowed.empty()) {
      shadow_ =
          std::make_unique<ShadowExperts>(expert, std::move(shadowed), local_experts, in.weights);
      es.skip = shadow_->Mask(num_experts);
    }
    exchange_ = std::make_unique<TokenExchange>(expert, es, in.plan, stats);
  }

  const ShadowExperts* shadow() const { return shadow_.get(); }

  Tensor Forward(const StepInput& in, const ExpertKernels& experts, CommStats* stats) {
    Tensor buf;
    {
      TraceSpan span("encode");
      buf = moe::Dispatch(in.plan, in.x, prescore_, experts.threads);
    }
    if (shadow_) shadow_->StartBroadcast();
    Tensor shadow_out;
    std::function<void()> local_work;
    if (shadow_) {
      local_work = [&] {
        shadow_->FinishBroadcast(stats);
        TraceSpan span("shadow experts");
        shadow_out =
            experts.Forward(shadow_->weights(), buf, shadow_->Groups(in.plan), &shadow_acts_);
      };
    }
    phase_acts_.resize(static_cast<size_t>(exchange_->phases()));
    out_buf_ = exchange_->Pipeline(
        buf,
        [&](int phase, const Tensor& rows) {
          return experts.Forward(in.weights, rows, exchange_->phase_groups(phase),
                                 &phase_acts_[static_cast<size_t>(phase)]);
        },
        local_work, stats);
    if (shadow_out.defined()) AddInto(out_buf_, shadow_out);
    return Decode(in, experts.threads, stats);
  }

 private:
  Tensor ExpertsBackward(const StepInput& in, const ExpertKernels& experts, const Tensor& d_out,
                         moe::ExpertWeights* grads, CommStats* stats) const override {
    Tensor shadow_d_in;
    std::function<void()> local_work;
    if (shadow_) {
      local_work = [&] {
        TraceSpan span("shadow experts backward");
        moe::ExpertGradients sg = experts.Backward(shadow_->weights(), shadow_acts_, d_out);
        shadow_d_in = sg.input;
        shadow_->StartReduce(sg.weights);
      };
    }
    Tensor d_in = exchange_->Pipeline(
        d_out,
        [&](int k, const Tensor& rows) {
          moe::ExpertGradients pg =
              experts.Backward(in.weights, phase_acts_[static_cast<size_t>(k)], rows);
          Accumulate(grads, pg.weights);
          return pg.input;
        },
        local_work, stats);
    if (shadow_d_in.defined()) AddInto(d_in, shadow_d_in);
    if (shadow_) shadow_->FinishReduce(grads, stats);
    return d_in;
  }

  // The backward starts and finishes the shadow reductions (ShadowExperts keeps their buffers).
  std::unique_ptr<ShadowExperts> shadow_;
  std::unique_ptr<TokenExchange> exchange_;
  std::vector<moe::ExpertActivations> phase_acts_;  // per pipeline phase
  moe::ExpertActivations shadow_acts_;
};

// One step of the per-destination-rank exchange.
using DedupStep = TransportStep<DedupExchange>;

class ExchangeDispatcher : public Dispatcher {
 public:
  explicit ExchangeDispatcher(DispatcherSetup setup)
      : s_(std::move(setup)), cost_(s_.options.cost_model) {}

  bool needs_group_capacity() const override { return fixed(); }

  BufferLayout Layout(int64_t capacity, int r) const override {
    if (!fixed()) return {};
    // Every (tp share, H-part copy, overlap chunk) slice of an expert's rows has the same size.
    const int64_t slices = static_cast<int64_t>(TpShareOf(*s_.groups, s_.dedup).shares) *
                           (s_.shards / r) * s_.options.overlap_degree;
    return {true, (capacity + slices - 1) / slices * slices};
  }

  std::unique_ptr<DispatchStep> Forward(const StepInput& in, const ExpertKernels& experts,
                                        Tensor* y, DispatchInfo* info, CommStats* stats) override {
    const TpShare tp = TpShareOf(*s_.groups, s_.dedup);
    ExchangeSpec es;
    es.shards = s_.shards;
    es.r = in.r;
    es.local_experts = s_.local_experts;
    es.tp_shares = tp.shares;
    es.tp_share = tp.share;
    es.fixed = fixed();
    if (s_.options.hierarchical_ranks_per_node > 0) {
      es.options.algorithm = comm::Algorithm::kHierarchical;
      es.options.ranks_per_node = s_.options.hierarchical_ranks_per_node;
    }
    es.overlap_degree = s_.options.overlap_degree;
    es.smart_group = SmartGroup(in.plan, experts.threads, stats);
    std::vector<int64_t> shadowed = ChooseShadows(in.plan, in.r, experts.threads, stats);
    info->overlap_degree = es.overlap_degree;
    info->smart_group = es.smart_group;
    if (UsesDedup(es, in, shadowed)) {
      auto step =
          std::make_unique<DedupStep>(s_.groups->Get(GroupKind::kExpert), s_.local_experts,
                                      s_.config.prescore, experts.threads, in.plan, in.x, stats);
      *y = step->Forward(in, experts, stats);
      return step;
    }
    auto step = std::make_unique<ExchangeStep>(*s_.groups, s_.dedup, s_.config.prescore,
                                               s_.config.num_experts, s_.local_experts, es,
                                               std::move(shadowed), in, stats);
    if (step->shadow()) info->shadowed = step->shadow()->experts();
    *y = step->Forward(in, experts, stats);
    return step;
  }

  const CostModel& cost_model() const override { return cost_; }

 private:
  bool fixed() const { return s_.options.dispatch == DispatchKind::kAllToAll; }

  // Whether this step sends a token once per destination rank (dedup_exchange.h): variable size,
  // every expert whole on one rank of a group of several, one phase, nothing shadowed.
  bool UsesDedup(const ExchangeSpec& es, const StepInput& in,
                 const std::vector<int64_t>& shadowed) const {
    return s_.options.dispatch_dedup && !fixed() && s_.shards == 1 && in.r == 1 &&
           es.tp_shares == 1 && es.overlap_degree == 1 && es.smart_group == kSmartOff &&
           shadowed.empty() && s_.groups->Get(GroupKind::kExpert).size() > 1;
  }

  // Resolves the cost model (measuring what is missing, once). Collective over the expert group.
  const CostModel& ResolvedCostModel(int threads) {
    if (!cost_resolved_) {
      if (!cost_.complete()) {
        cost_ = MeasureCostModel(s_.groups->Get(GroupKind::kExpert), cost_, s_.config.model_dim,
                                 s_.config.hidden_dim, threads);
      }
      cost_resolved_ = true;
    }
    return cost_;
  }

  // The smart-schedule group size of this step (auto: from the cost model). Collective when auto.
  int SmartGroup(const moe::DispatchPlan& plan, int threads, CommStats* stats) {
    if (s_.options.smart_group != kSmartAuto) return s_.options.smart_group;
    comm::Communicator& expert = s_.groups->Get(GroupKind::kExpert);
    const int p = expert.size();
    if (p == 1) return kSmartOff;
    int64_t kept = 0;
    for (int64_t n : plan.counts) kept += n;
    std::vector<int64_t> rows{kept};
    AllReduceMax(expert, rows, Traffic::kRouting, stats);
    const CostModel& model = ResolvedCostModel(threads);
    const moe::LayerConfig& c = s_.config;
    const double bytes =
        static_cast<double>(rows[0]) * static_cast<double>(c.model_dim) * 4.0 * (p - 1) / p;
    const double flops =
        static_cast<double>(rows[0]) * moe::ExpertFlops(1, c.model_dim, c.hidden_dim, c.gated);
    return ChooseSmartGroup(p, bytes, flops, model);
  }

  // The experts to shadow in this step (auto: the cost model on every rank's counts).
  // Collective when auto.
  std::vector<int64_t> ChooseShadows(const moe::DispatchPlan& plan, int r, int threads,
                                     CommStats* stats) {
    const ShadowOptions& o = s_.options.shadow;
    if (o.policy == ShadowPolicy::kNone || r != 1) return {};
    if (o.policy == ShadowPolicy::kList) {
      std::vector<int64_t> list = o.experts;
      std::sort(list.begin(), list.end());
      list.erase(std::unique(list.begin(), list.end()), list.end());
      return list;
    }
    comm::Communicator& expert = s_.groups->Get(GroupKind::kExpert);
    const moe::LayerConfig& c = s_.config;
    ShadowProblem pr;
    pr.ranks = expert.size();
    pr.num_experts = c.num_experts;
    pr.counts = AllGather(expert, plan.counts, Traffic::kRouting, stats);
    pr.model_dim = c.model_dim;
    pr.hidden_dim = c.hidden_dim;
    pr.gated = c.gated;
    pr.bias = c.fc_bias;
    return ChooseShadowExperts(pr, ResolvedCostModel(threads));
  }

  DispatcherSetup s_;
  CostModel cost_;
  bool cost_resolved_ = false;
};

}  // namespace

std::unique_ptr<Dispatcher> MakeExchangeDispatcher(const DispatcherSetup& setup) {
  return std::make_unique<ExchangeDispatcher>(setup);
}

}  // namespace switchyard::parallel::internal
