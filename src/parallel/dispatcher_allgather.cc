// Megatron's allgather dispatcher as a Dispatcher (allgather_dispatch.h does the transfers).
#include <utility>

#include "parallel/allgather_dispatch.h"
#include "parallel/dispatcher.h"

namespace switchyard::parallel::internal {
namespace {

class AllGatherStep : public DispatchStep {
 public:
  AllGatherStep(comm::Communicator& expert, const AllGatherSpec& spec, const StepInput& in,
                CommStats* stats)
      : dispatch_(expert, spec, in.plan, in.x, stats) {}

  Tensor Forward(const StepInput& in, const ExpertKernels& experts, CommStats* stats) {
    expert_out_ = experts.Forward(in.weights, dispatch_.expert_input(), dispatch_.groups(), &acts_);
    return dispatch_.Combine(expert_out_, stats);
  }

  DispatchGradients Backward(const StepInput& in, const ExpertKernels& experts, const Tensor& dy,
                             CommStats* stats) const override {
    Tensor d_out = dispatch_.CombineBackward(dy, expert_out_, stats);
    moe::ExpertGradients eg = experts.Backward(in.weights, acts_, d_out);
    AllGatherDispatch::Grads ag = dispatch_.DispatchBackward(eg.input, stats);
    DispatchGradients g;
    g.x = ag.x;
    g.weights = std::move(ag.weights);
    g.experts = eg.weights;
    return g;
  }

 private:
  // CombineBackward keeps the weight gradients that DispatchBackward completes.
  mutable AllGatherDispatch dispatch_;
  moe::ExpertActivations acts_;
  Tensor expert_out_;  // rows computed by this rank
};

class AllGatherDispatcher : public Dispatcher {
 public:
  explicit AllGatherDispatcher(DispatcherSetup setup) : s_(std::move(setup)) {}

  BufferLayout Layout(int64_t, int) const override { return {}; }

  std::unique_ptr<DispatchStep> Forward(const StepInput& in, const ExpertKernels& experts,
                                        Tensor* y, DispatchInfo*, CommStats* stats) override {
    const AllGatherSpec spec{s_.shards, in.r, s_.local_experts, s_.config.prescore};
    auto step =
        std::make_unique<AllGatherStep>(s_.groups->Get(GroupKind::kExpert), spec, in, stats);
    *y = step->Forward(in, experts, stats);
    return step;
  }

  const CostModel& cost_model() const override { return s_.options.cost_model; }

 private:
  DispatcherSetup s_;
};

}  // namespace

std::unique_ptr<Dispatcher> MakeAllGatherDispatcher(const DispatcherSetup& setup) {
  return std::make_unique<AllGatherDispatcher>(setup);
}

}  // namespace switchyard::parallel::internal
