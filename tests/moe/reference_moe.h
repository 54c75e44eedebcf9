// A plain reference of the MoE layer, written straight from docs/moe.md ("What the layer
// computes") for tests: float64 throughout, loops and the GShard one-hot einsum form
// (dispatch/combine tensors [T, E, C]) for small sizes. It shares no code with src/moe; only the
// documented random-number keying (docs/moe.md) and StepSeed are common, so that noise draws can
// agree.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "switchyard/moe/config.h"
#include "switchyard/moe/layer.h"

namespace switchyard::moe::testing {

// Parameters by tensor name (the names of layer.h), as float64.
using RefParams = std::map<std::string, std::vector<double>>;

struct RefOutput {
  std::vector<double> y;  // [T, M]
  double l_aux = 0;
  double z_loss = 0;
  int64_t capacity = 0;
  std::vector<int32_t> topk;       // [T, k]
  std::vector<int32_t> locations;  // [T, k], -1 dropped
  std::vector<double> gates;       // [T, k] after normalize_gate, before drops
  std::vector<double> weights;     // [T, k] combine weights
};

struct RefOptions {
  int64_t global_token_offset = 0;
  uint64_t step = 0;
  std::optional<int64_t> global_max_load;
  bool training = true;  // as moe::ForwardOptions::training
};

RefOutput ReferenceForward(const LayerConfig& config, const RefParams& params,
                           const std::vector<double>& x, int64_t num_tokens,
                           const RefOptions& options = {});

// sum(y * dy) + aux_loss_coef * l_aux + z_loss_coef * z_loss: the objective whose gradients the
// layer's Backward returns.
double ReferenceObjective(const LayerConfig& config, const RefParams& params,
                          const std::vector<double>& x, int64_t num_tokens,
                          const std::vector<double>& dy, const RefOptions& options = {});

RefParams ToRefParams(const NamedTensors& tensors);
std::vector<double> ToDoubles(const Tensor& t);

}  // namespace switchyard::moe::testing
