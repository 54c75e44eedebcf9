// The buffer dispatchers' shared steps, the expert kernels and the local dispatcher (r = 0).
#include <utility>

#include "parallel/dispatcher.h"
#include "parallel/exchange.h"
#include "parallel/trace_context.h"
#include "switchyard/moe/dispatch.h"

namespace switchyard::parallel::internal {

Tensor ExpertKernels::Forward(const moe::ExpertWeights& weights, const Tensor& rows,
                              const moe::ExpertGroups& groups, moe::ExpertActivations* acts) const {
  return moe::ExpertsForward(options, weights, rows, groups, acts, threads);
}

moe::ExpertGradients ExpertKernels::Backward(const moe::ExpertWeights& weights,
                                             const moe::ExpertActivations& acts,
                                             const Tensor& d_out) const {
  return moe::ExpertsBackward(options, weights, acts, d_out, threads);
}

void AddInto(const Tensor& dst, const Tensor& src) {
  float* d = dst.data<float>();
  const float* s = src.data<float>();
  for (int64_t i = 0; i < dst.numel(); ++i) d[i] += s[i];
}

TpShare TpShareOf(ProcessGroups& groups, bool dedup) {
  if (!dedup) return {};
  comm::Communicator& tp = groups.Get(GroupKind::kTensor);
  return {tp.size(), tp.rank()};
}

Tensor BufferStep::Decode(const StepInput& in, int threads, CommStats* stats) const {
  if (dedup_) GatherTpShares(groups_.Get(GroupKind::kTensor), in.plan, out_buf_, stats);
  TraceSpan span("decode");
  return moe::Combine(in.plan, out_buf_, prescore_, threads);
}

DispatchGradients BufferStep::Backward(const StepInput& in, const ExpertKernels& experts,
                                       const Tensor& dy, CommStats* stats) const {
  moe::CombineGradients cg;
  {
    TraceSpan span("decode backward");
    cg = moe::CombineBackward(in.plan, dy, out_buf_, prescore_, experts.threads);
  }
  DispatchGradients g;
  Tensor d_in_buf = ExpertsBackward(in, experts, cg.expert_out, &g.experts, stats);
  if (dedup_) GatherTpShares(groups_.Get(GroupKind::kTensor), in.plan, d_in_buf, stats);
  TraceSpan span("encode backward");
  moe::DispatchGradients dg =
      moe::DispatchBackward(in.plan, d_in_buf, in.x, prescore_, experts.threads);
  g.x = dg.x;
  g.weights = std::move(cg.weights);
  for (size_t i = 0; i < g.weights.size(); ++i) g.weights[i] += dg.weights[i];
  return g;
}

namespace {

class LocalStep : public BufferStep {
 public:
  using BufferStep::BufferStep;

  Tensor Forward(const StepInput& in, const ExpertKernels& experts, CommStats* stats) {
    const TpShare tp = TpShareOf(groups_, dedup_);
    const Tensor buf = moe::Dispatch(in.plan, in.x, prescore_, experts.threads);
    out_buf_ = experts.Forward(in.weights, buf, ShareGroups(in.plan, tp.shares, tp.share), &acts_);
    return Decode(in, experts.threads, stats);
  }

 private:
  Tensor ExpertsBackward(const StepInput& in, const ExpertKernels& experts, const Tensor& d_out,
                         moe::ExpertWeights* grads, CommStats*) const override {
    moe::ExpertGradients eg = experts.Backward(in.weights, acts_, d_out);
    *grads = eg.weights;
    return eg.input;
  }

  moe::ExpertActivations acts_;
};

class LocalDispatcher : public Dispatcher {
 public:
  explicit LocalDispatcher(DispatcherSetup setup) : s_(std::move(setup)) {}

  BufferLayout Layout(int64_t, int) const override { return {}; }

  std::unique_ptr<DispatchStep> Forward(const StepInput& in, const ExpertKernels& experts,
                                        Tensor* y, DispatchInfo*, CommStats* stats) override {
    auto step = std::make_unique<LocalStep>(*s_.groups, s_.dedup, s_.config.prescore);
    *y = step->Forward(in, experts, stats);
    return step;
  }

  const CostModel& cost_model() const override { return s_.options.cost_model; }

 private:
  DispatcherSetup s_;
};

}  // namespace

std::unique_ptr<Dispatcher> MakeLocalDispatcher(const DispatcherSetup& setup) {
  return std::make_unique<LocalDispatcher>(setup);
}

}  // namespace switchyard::parallel::internal
