// Qwen2-MoE's sparse MoE block (Qwen2MoeSparseMoeBlock): the routed experts plus a shared expert
// that every token passes through, scaled per token by a sigmoid gate:
//   y = routed(x) + sigmoid(x · w_g^T) * SwiGLU_shared(x)
// The routed part is any MoE FFN (MoeFeedForward, ParallelMoeFeedForward); the shared expert is a
// TensorParallelSwiGlu (gate and up column-parallel, down row-parallel over the tp group, as the
// dense MLP) and the gate's weight [1, model_dim] is replicated. Parameters below the block's
// prefix: "<prefix>shared_expert.{gate,up,down}_proj.weight" ([Hs, M], [Hs, M], [M, Hs], tp
// shards of them), "<prefix>shared_expert_gate.weight" [1, M] — Hugging Face's names with the
// block's "moe." where it says "mlp.".
//
// x and y are in the tensor-parallel layout the block's FFN gets (replicated rows, or this rank's
// tokens with sequence parallelism); the gate is a per-row product, so it needs no communication.
// Thread-safety: as the FeedForward contract (feed_forward.h).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "switchyard/train/feed_forward.h"
#include "switchyard/train/layers.h"
#include "switchyard/train/tensor_parallel_gqa.h"

namespace switchyard::train {

class GatedSharedExpertMoe : public FeedForward {
 public:
  // `routed`: the block's MoE FFN, built first (its parameters come first in the model's order).
  // The shared expert's weights ~ N(0, init_std^2) (down_proj: out_init_std), the gate's
  // N(0, init_std^2), each keyed by its name and `seed` (the same tensors on every layout).
  GatedSharedExpertMoe(std::unique_ptr<FeedForward> routed, ParameterSet& params,
                       const std::string& prefix, int64_t model_dim, int64_t shared_hidden,
                       float init_std, float out_init_std, uint64_t seed,
                       comm::Communicator& tp_group, TensorParallelOptions tp_options,
                       parallel::CommStats* stats = nullptr);

  bool is_moe() const override { return true; }
  int64_t num_experts() const override { return routed_->num_experts(); }
  FeedForward& routed() { return *routed_; }

  // The output carries the routed part's losses and routing statistics.
  FeedForwardOutput Forward(const Tensor& x, const FeedForwardContext& context) override;
  Tensor Backward(const FeedForwardOutput& forward, const Tensor& dy, float loss_scale,
                  int threads) override;
  void EndStep(std::span<const int64_t> global_expert_counts) override {
    routed_->EndStep(global_expert_counts);
  }
  void SetRouterTrace(RouterTrace* trace) override { routed_->SetRouterTrace(trace); }
  FeedForwardTimes TakeTimes() override { return routed_->TakeTimes(); }
  void SavedTensors(const FeedForwardOutput& forward, std::vector<Tensor>* out) const override;

 private:
  std::unique_ptr<FeedForward> routed_;
  TensorParallelSwiGlu shared_;
  Linear gate_;  // [1, model_dim], replicated
};

}  // namespace switchyard::train
