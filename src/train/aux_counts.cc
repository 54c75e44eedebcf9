#include "switchyard/train/aux_counts.h"

#include <cstring>

#include "switchyard/core/error.h"

namespace switchyard::train {

void StepAuxCounts::StartStep(uint64_t step) {
  if (started_ && step == step_) return;
  started_ = true;
  step_ = step;
  total_ = {};
  given_.clear();
  added_.clear();
}

const moe::AuxCountsSoFar* StepAuxCounts::Before(uint64_t step, int64_t key) {
  StartStep(step);
  auto it = given_.find(key);
  if (it == given_.end()) it = given_.emplace(key, total_).first;
  return &it->second;
}

void StepAuxCounts::Add(uint64_t step, int64_t key, const std::vector<double>& counts) {
  StartStep(step);
  if (counts.empty() || added_[key]) return;
  added_[key] = true;
  if (total_.counts.empty()) total_.counts.assign(counts.size(), 0.0);
  for (size_t e = 0; e < counts.size() && e < total_.counts.size(); ++e) {
    total_.counts[e] += counts[e];
  }
  ++total_.micro_batches;
}

int64_t ConcatPayloadRows(int64_t num_experts, int64_t model_dim) {
  const int64_t floats =
      (2 * num_experts + 1) * static_cast<int64_t>(sizeof(double) / sizeof(float));
  return (floats + model_dim - 1) / model_dim;
}

Tensor AppendConcatSums(const Tensor& x, const moe::RouterLoadSums& sums, int64_t payload_rows) {
  ExpectDType("activation", x, DType::kFloat32);
  const int64_t rows = x.size(0), dim = x.size(1);
  const std::vector<double> v = sums.ToVector();
  SY_CHECK(static_cast<int64_t>(v.size() * sizeof(double)) <=
               payload_rows * dim * static_cast<int64_t>(sizeof(float)),
           "{} sums do not fit {} rows of {}", v.size(), payload_rows, dim);
  Tensor out = Tensor::Zeros({rows + payload_rows, dim});
  out.Slice(0, rows).CopyFrom(x);
  std::memcpy(out.data<float>() + rows * dim, v.data(), v.size() * sizeof(double));
  return out;
}

moe::RouterLoadSums ReadConcatSums(const Tensor& x, int64_t payload_rows, int64_t num_experts,
                                   int64_t top_k) {
  ExpectDType("activation", x, DType::kFloat32);
  SY_REQUIRE(x.dim() == 2 && x.size(0) >= payload_rows, InvalidArgument,
             "activation {}: expected at least the {} rows of the router sums", x.ToString(),
             payload_rows);
  std::vector<double> v(static_cast<size_t>(2 * num_experts + 1));
  std::memcpy(v.data(), x.data<float>() + (x.size(0) - payload_rows) * x.size(1),
              v.size() * sizeof(double));
  return moe::RouterLoadSums::FromVector(num_experts, top_k, v);
}

}  // namespace switchyard::train
