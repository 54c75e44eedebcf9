// Megatron's allgather dispatcher as a Dispatcher (allgather_dispatch.h does the transfers).
#include <utility>

#include "parallel/allgather_dispatch.h"
#include "parallel/dispatcher.h"

namespace switchyard::parallel::internal {
namespace {

using AllGatherStep = TransportStep<AllGatherDispatch>;

class AllGatherDispatcher : public Dispatcher {
 public:
  explicit AllGatherDispatcher(DispatcherSetup setup) : s_(std::move(setup)) {}

  BufferLayout Layout(int64_t, int) const override { return {}; }

  std::unique_ptr<DispatchStep> Forward(const StepInput& in, const ExpertKernels& experts,
                                        Tensor* y, DispatchInfo*, CommStats* stats) override {
    const AllGatherSpec spec{s_.shards, in.r, s_.local_experts, s_.config.prescore};
    auto step = std::make_unique<AllGatherStep>(s_.groups->Get(GroupKind::kExpert), spec, in.plan,
                                                in.x, stats);
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
