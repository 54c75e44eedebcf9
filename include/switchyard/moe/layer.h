// The MoE layer on one rank: gate -> plan -> dispatch -> experts -> combine (docs/moe.md), and its
// backward, which reuses the plan. Each step is also callable on its own (gate.h, plan.h,
// dispatch.h, experts.h, losses.h) so that expert parallelism can insert all-to-alls between
// dispatch and the experts.
//
// Activations x and dy may be float32 or bfloat16; every computation runs in float32 and y / the
// x gradient come back in x's dtype. Parameters are float32 (master weights).
//
// Thread-safety: a MoeLayer is immutable; Forward and Backward may run concurrently on different
// inputs. `threads` is the number of compute threads a call may use (the rank's budget, see
// core/threading.h); BLAS threading is the process's setting (kernels::SetBlasThreads).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "switchyard/core/tensor.h"
#include "switchyard/moe/config.h"
#include "switchyard/moe/experts.h"
#include "switchyard/moe/router_load_loss.h"

namespace switchyard::moe {

// Parameters of one layer. The names in comments are the tensor names of files (ParamsFromMap).
struct LayerParams {
  Tensor gate_weight;     // "gate.weight" [E, M]
  Tensor expert_bias;     // "gate.expert_bias" [E] (expert_bias; a state, not trained)
  ExpertWeights experts;  // "experts.fc1.weight" [E, H, M], "experts.fc1.bias" [E, H],
                          // "experts.fc2.weight" [E, M, H], "experts.fc2.bias" [E, M],
                          // "experts.fc3.weight" [E, H, M]
  // residual_moe (PR-MoE): "residual_mlp.fc1.weight" [H, M], ... (the expert layout without the
  // expert dimension) and "coefficient.weight" [2, M], "coefficient.bias" [2] (fc_bias).
  ExpertWeights residual_mlp;
  Tensor coefficient_weight;
  Tensor coefficient_bias;
  // shared_expert_hidden = Hs > 0: "shared_experts.fc1.weight" [Hs, M], ...
  ExpertWeights shared_mlp;
};

using NamedTensors = std::map<std::string, Tensor>;

// The parameter tensors a config needs, by name, with their shapes.
std::vector<std::pair<std::string, Shape>> ParamShapes(const LayerConfig& config);
// Picks the parameters out of `tensors` (other names are ignored). A missing name or a wrong shape
// throws InvalidArgument naming the tensor; bfloat16 parameters are converted to float32.
LayerParams ParamsFromMap(const LayerConfig& config, const NamedTensors& tensors);
NamedTensors ParamsToMap(const LayerConfig& config, const LayerParams& params);

// For `check_finite`: throws InvalidArgument naming `name` and the first element that is NaN or
// infinite, e.g. "x: element [1, 1] is nan (check_finite is on)". Float tensors only; others and
// undefined tensors pass.
void CheckFinite(std::string_view name, const Tensor& t);
// Random parameters: PyTorch Linear's default U(-1/sqrt(fan_in), 1/sqrt(fan_in)), keyed by seed.
LayerParams InitParams(const LayerConfig& config, uint64_t seed);

struct AuxCountsSoFar;  // losses.h

struct ForwardOptions {
  int64_t global_token_offset = 0;         // global index of local token 0 (keys random draws)
  uint64_t step = 0;                       // training step (keys random draws with config.seed)
  std::optional<int64_t> global_max_load;  // capacity_factor <= 0: max load over the EP group
  int threads = 1;
  bool save_for_backward = true;  // false: inference, Backward cannot be called
  // true: a training call (gate noise and GShard random routing as the config says); false:
  // evaluation, neither. Everything else (capacity, drops, losses) is the same in both.
  bool training = true;
  // [T] the global index of each token of x (GateOptions::token_index): routing visits the tokens
  // in that order and keys every random draw by it, so rows given in another order (context
  // parallelism) route exactly as in the global order. Empty: global_token_offset + t.
  std::span<const int64_t> token_index = {};
  // aux_loss global: the counts of the step's earlier micro-batches (losses.h); null: none (the
  // first micro-batch, or one micro-batch per step). Read by no other loss.
  const AuxCountsSoFar* aux_counts_so_far = nullptr;
  // [T, k] replay: the experts each token chooses (GateOptions::forced_experts); empty: the gate
  // chooses.
  std::span<const int32_t> forced_experts = {};
  // true: LayerOutput::entropy_sum is computed (T x E logarithms; router_stats.h).
  bool entropy = false;
};

struct LayerState;  // what the backward needs (opaque)

struct LayerOutput {
  Tensor y;  // [T, M], x's dtype
  float l_aux = 0;
  float z_loss = 0;
  int64_t capacity = 0;    // C (dropless: the largest expert count)
  Tensor topk_idx;         // [T, k] int32 chosen experts
  Tensor locations;        // [T, k] int32 slot within the expert, -1 where dropped
  Tensor gates;            // [T, k] float32 gate values g (after normalize_gate, before drops)
  Tensor combine_weights;  // [T, k] float32 weights used by combine (0 where dropped)
  std::vector<int64_t> expert_loads;   // [E] routed pairs per expert, before drops
  std::vector<int64_t> expert_counts;  // [E] kept pairs per expert
  int64_t dropped = 0;                 // routed pairs dropped for capacity
  // aux_loss global: [E] N_e of this call's batch (Megatron's aux routing map counted per expert,
  // over every rank's tokens in the parallel layer), for the next micro-batch's AuxCountsSoFar;
  // empty for other losses.
  std::vector<double> aux_counts;
  // aux_loss hf_concat: this call's batch's sums (over every rank of the batch in the parallel
  // layer), this layer's part of the concatenation (router_load_loss.h); empty sums otherwise.
  RouterLoadSums concat_sums;
  // With ForwardOptions::entropy: the sum over this call's tokens of the router entropy
  // -sum_e P log P (RouterEntropySum, router_stats.h); 0 otherwise.
  double entropy_sum = 0;
  std::shared_ptr<const LayerState> state;  // for Backward; null with save_for_backward = false
};

struct LayerGradients {
  Tensor x;            // [T, M], x's dtype
  LayerParams params;  // float32, same names and shapes (expert_bias undefined: not trained)
};

class MoeLayer {
 public:
  // Validates the config (InvalidArgument).
  explicit MoeLayer(LayerConfig config);

  const LayerConfig& config() const { return config_; }
  int64_t top_k() const;  // k after clamping to E

  // x [T, M] float32 or bfloat16. Checks the parameters' shapes and, with check_finite, that x
  // and the parameters hold no NaN/Inf.
  LayerOutput Forward(const LayerParams& params, const Tensor& x,
                      const ForwardOptions& options = {}) const;

  // Gradients of sum(y * dy) + aux_loss_coef * l_aux + z_loss_coef * z_loss.
  // dy [T, M] float32 or bfloat16; `forward` from Forward on the same params. aux_loss
  // hf_concat: `concat_total` (null: this layer's own rows) is the sums of the whole
  // concatenation this layer's rows are part of, and l_aux in the objective is the
  // concatenation's loss (LayerOutput::l_aux stays this call's rows' own value).
  LayerGradients Backward(const LayerParams& params, const LayerOutput& forward, const Tensor& dy,
                          int threads = 1, const RouterLoadSums* concat_total = nullptr) const;

 private:
  LayerConfig config_;
};

}  // namespace switchyard::moe
