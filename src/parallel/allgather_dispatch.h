// Megatron-Core's allgather token dispatcher over an expert group: every rank all-gathers the
// tokens and the routing of the group, computes its experts on the rows routed to them, applies
// the combine weights itself and returns the partial outputs with a reduce-scatter
// (docs/parallel.md, "Dispatchers").
// No capacity padding on the wire, but every rank receives every token of the group.
//
// With Tutel's adaptive r the kept rows of expert e from each source are cut into g = n / r
// slices; member (q, i) computes slice i % g with H-part i / g, and the reduce-scatter adds the r
// partial outputs. Token counts may differ between ranks (zero included): the gathers are padded
// to the largest count. Private to src/parallel.
#pragma once

#include <cstdint>
#include <vector>

#include "switchyard/comm/communicator.h"
#include "switchyard/core/tensor.h"
#include "switchyard/moe/experts.h"
#include "switchyard/moe/plan.h"
#include "switchyard/parallel/comm_stats.h"

namespace switchyard::parallel::internal {

struct AllGatherSpec {
  int shards = 1;             // n
  int r = 1;                  // parts of H
  int64_t local_experts = 1;  // E_l
  bool prescore = false;
};

class AllGatherDispatch {
 public:
  // x [T, M] float32 and its plan (kept pairs: plan.rows >= 0 and plan.slots, weights). Gathers
  // tokens and routing over `group`. Collective.
  AllGatherDispatch(comm::Communicator& group, const AllGatherSpec& spec,
                    const moe::DispatchPlan& plan, const Tensor& x, CommStats* stats);

  // Rows this rank computes [rows, M] (pre-score: scaled by the combine weight), one group per
  // local expert.
  const Tensor& expert_input() const { return input_; }
  const moe::ExpertGroups& groups() const { return groups_; }

  // Expert outputs [rows, M] -> this rank's y [T, M] (weighted sum over its tokens' choices).
  // Collective.
  Tensor Combine(const Tensor& expert_out, CommStats* stats) const;

  // Backward of Combine: dy [T, M] -> d expert outputs [rows, M]. Collective. Keeps the
  // post-score weight gradients for DispatchBackward.
  Tensor CombineBackward(const Tensor& dy, const Tensor& expert_out, CommStats* stats);

  struct Grads {
    Tensor x;                    // [T, M] gradient through the expert inputs
    std::vector<float> weights;  // [T, k] gradient of the combine weights
  };
  // d expert inputs [rows, M] -> this rank's gradients. Collective.
  Grads DispatchBackward(const Tensor& d_expert_in, CommStats* stats);

 private:
  struct Row {
    int32_t source;  // rank in the group
    int32_t token;   // token index at the source
    int32_t choice;  // j
    float weight;
  };

  comm::Communicator& group_;
  AllGatherSpec spec_;
  int64_t num_tokens_ = 0, top_k_ = 0, t_max_ = 0, model_dim_ = 0;
  Tensor x_all_;  // [P * t_max, M]
  std::vector<Row> rows_;
  Tensor input_;
  moe::ExpertGroups groups_;
  std::vector<float> d_weights_all_;  // [P * t_max, k] partial weight gradients
};

}  // namespace switchyard::parallel::internal
