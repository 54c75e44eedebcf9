// FasterMoE's shadow experts in the parallel layer (docs/overlap.md, "Shadow experts"): the
// parameters of a few (hot) experts are broadcast from their owners to the whole expert group,
// every rank computes its own rows of them locally (they are not sent), and their parameter
// gradients are reduced back to the owner. Requires unsharded experts (n = 1, r = 1: member p of
// the expert group owns experts [p E_l, (p + 1) E_l)). Private to src/parallel.
//
// The broadcasts and reductions are asynchronous: they travel while the rank computes. Packed
// per expert as fc1.weight [H, M], fc1.bias [H], fc2.weight [M, H], fc2.bias [M], fc3.weight
// [H, M] (those present).
#pragma once

#include <cstdint>
#include <vector>

#include "switchyard/comm/communicator.h"
#include "switchyard/core/tensor.h"
#include "switchyard/moe/experts.h"
#include "switchyard/moe/plan.h"
#include "switchyard/parallel/comm_stats.h"

namespace switchyard::parallel::internal {

class ShadowExperts {
 public:
  // experts: global indices in increasing order; local: this rank's compute weights [E_l, ...].
  ShadowExperts(comm::Communicator& group, std::vector<int64_t> experts, int64_t local_experts,
                const moe::ExpertWeights& local);
  // Waits for broadcasts or reductions still in flight (after an error), ignoring their errors.
  ~ShadowExperts();
  ShadowExperts(const ShadowExperts&) = delete;
  ShadowExperts& operator=(const ShadowExperts&) = delete;

  const std::vector<int64_t>& experts() const { return experts_; }
  // [E] 1 for shadowed experts.
  std::vector<char> Mask(int64_t num_experts) const;

  // Starts broadcasting every shadowed expert's parameters from its owner. Collective (async).
  void StartBroadcast();
  // Waits for them; weights() is valid afterwards.
  void FinishBroadcast(CommStats* stats);
  // [S, ...] in the order of experts().
  const moe::ExpertWeights& weights() const { return weights_; }
  // The kept rows of the shadowed experts in the plan's buffer, one group each.
  moe::ExpertGroups Groups(const moe::DispatchPlan& plan) const;

  // Starts reducing grads [S, ...] (this rank's contribution) to the owners. Collective (async).
  void StartReduce(const moe::ExpertWeights& grads);
  // Waits; adds the whole group's gradients of the shadowed experts this rank owns into
  // local_grads [E_l, ...].
  void FinishReduce(moe::ExpertWeights* local_grads, CommStats* stats);

 private:
  struct Pending {
    comm::Work work;
    double issued = 0;
  };

  comm::Communicator& group_;
  std::vector<int64_t> experts_;
  int64_t local_experts_;
  moe::ExpertWeights local_;
  int64_t h_ = 0, m_ = 0, packed_ = 0;
  bool bias_ = false, gated_ = false;
  std::vector<Tensor> packed_params_, packed_grads_, reduced_;
  std::vector<Pending> pending_;
  moe::ExpertWeights weights_;
};

}  // namespace switchyard::parallel::internal
