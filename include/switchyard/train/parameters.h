// Named parameters of a model: the float32 master values, their gradients, and how the
// optimizer and the parallel layouts treat each one.
//
// Names follow PyTorch's state_dict convention ("blocks.3.attn.qkv.weight"), so that checkpoints
// load into PyTorch with the same names. A ParameterSet owns its Parameter records; modules keep
// pointers to them, which stay valid for the lifetime of the set (records are never moved).
// Parameter tensors are handles: a module may share a parameter's storage with another structure
// (the MoE layer's LayerParams) by passing that tensor to Add().
//
// Thread-safety: a ParameterSet is not synchronized; one training step owns it at a time.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <string_view>
#include <vector>

#include "switchyard/core/safetensors.h"
#include "switchyard/core/tensor.h"

namespace switchyard::train {

// How data-parallel layouts treat a parameter's gradient (docs/parallel.md, "Gradients"): dense
// parameters are averaged over the whole data-parallel world, expert parameters over their ep_dp
// group.
enum class ParamGroup : uint8_t { kDense, kExpert };

// How a parameter is split over the tensor-parallel group (train/tensor_parallel.h), so that
// checkpoints hold the single-rank tensor whatever the layout: rank r holds ShardOf(full, r).
struct TpShard {
  enum class Dim : uint8_t {
    kReplicated,  // every rank holds the whole tensor
    kRows,        // dim 0 split, each of fused_parts equal parts on its own (see fused_parts below)
    kColumns      // dim 1 of a 2-d tensor split
  };
  Dim dim = Dim::kReplicated;
  int64_t fused_parts = 1;  // kRows only
  bool split() const { return dim != Dim::kReplicated; }
};

struct ParamOptions {
  bool weight_decay = false;  // AdamW applies decoupled weight decay (matrices, embeddings)
  bool trainable = true;      // false: a buffer (saved in checkpoints, never optimized)
  ParamGroup group = ParamGroup::kDense;
};

struct Parameter {
  std::string name;
  Tensor value;  // float32
  Tensor grad;   // float32, value's shape; undefined for buffers (trainable = false)
  ParamOptions options;
  // Set by the tensor-parallel layers for the shards they register; kReplicated otherwise.
  TpShard tp_shard;
  // A second copy of a parameter another pipeline stage holds (the tied embedding on the head's
  // stage): same name and value, its gradient summed with the other copy's.
  bool tied_copy = false;
};

class ParameterSet {
 public:
  ParameterSet() = default;
  ParameterSet(const ParameterSet&) = delete;
  ParameterSet& operator=(const ParameterSet&) = delete;

  // Registers a parameter with the given (float32) value and a zero gradient. Throws
  // InvalidArgument if the name is taken or the value is not a defined float32 tensor.
  Parameter& Add(std::string name, Tensor value, ParamOptions options = {});

  // nullptr if absent.
  Parameter* Find(std::string_view name);
  const Parameter* Find(std::string_view name) const;
  // Throws InvalidArgument naming the parameter if absent.
  Parameter& Get(std::string_view name);

  // Registration order (the order of the model's modules).
  std::deque<Parameter>& all() { return params_; }
  const std::deque<Parameter>& all() const { return params_; }
  size_t size() const { return params_.size(); }

  // Sets every gradient to zero.
  void ZeroGrad();
  // Elements of the trainable parameters (buffers excluded).
  int64_t NumTrainableElements() const;

  // Every value (trainable parameters and buffers) by name; the tensors share storage with the
  // parameters.
  TensorMap Values() const;
  // Copies values from `tensors` into the parameters. Every parameter must be present with its
  // exact shape (InvalidArgument naming it otherwise); float32 or bfloat16 (converted). With
  // `allow_extra` false, a name in `tensors` that is no parameter is an error too.
  void LoadValues(const TensorMap& tensors, bool allow_extra = false);

 private:
  std::deque<Parameter> params_;
};

// Fills `t` (float32) with N(0, std^2), each element keyed by (seed, name, index) through
// CounterRng, so a parameter's initial value does not depend on what else the model holds.
void InitNormal(const Tensor& t, float std, uint64_t seed, std::string_view name);

// The CounterRng stream of a parameter's initialization: kStreamInit + a 64-bit hash of `name`.
uint64_t InitStream(std::string_view name);

}  // namespace switchyard::train
