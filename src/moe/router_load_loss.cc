// Hugging Face's load-balancing loss over the concatenated router logits of all MoE layers.
#include "switchyard/moe/router_load_loss.h"

#include <algorithm>
#include <vector>

#include "switchyard/core/error.h"
#include "switchyard/kernels/ops.h"

namespace switchyard::moe {
namespace {

void CheckLogits(const Tensor& logits, int64_t top_k) {
  SY_REQUIRE(logits.defined() && logits.dim() == 2 && logits.dtype() == DType::kFloat32,
             InvalidArgument, "router logits: expected float32 [num_tokens, num_experts], got {}",
             logits.defined() ? ShapeToString(logits.shape()) : "undefined");
  SY_REQUIRE(top_k >= 1 && top_k <= logits.size(1), InvalidArgument,
             "router load loss: num_experts_per_tok {} must be in [1, num_experts = {}]", top_k,
             logits.size(1));
}

}  // namespace

RouterLoadSums::RouterLoadSums(int64_t experts, int64_t k)
    : num_experts(experts),
      top_k(k),
      probs(static_cast<size_t>(experts), 0.0),
      choices(static_cast<size_t>(experts), 0.0) {}

void RouterLoadSums::Add(const RouterLoadSums& other) {
  SY_REQUIRE(other.num_experts == num_experts && other.top_k == top_k, InvalidArgument,
             "router load sums: adding E = {}, k = {} to E = {}, k = {}", other.num_experts,
             other.top_k, num_experts, top_k);
  num_rows += other.num_rows;
  for (size_t e = 0; e < probs.size(); ++e) {
    probs[e] += other.probs[e];
    choices[e] += other.choices[e];
  }
}

std::vector<double> RouterLoadSums::ToVector() const {
  std::vector<double> v;
  v.reserve(1 + probs.size() + choices.size());
  v.push_back(num_rows);
  v.insert(v.end(), probs.begin(), probs.end());
  v.insert(v.end(), choices.begin(), choices.end());
  return v;
}

RouterLoadSums RouterLoadSums::FromVector(int64_t num_experts, int64_t top_k,
                                          std::span<const double> values) {
  SY_REQUIRE(static_cast<int64_t>(values.size()) == 2 * num_experts + 1, InvalidArgument,
             "router load sums: expected {} values for E = {}, got {}", 2 * num_experts + 1,
             num_experts, values.size());
  RouterLoadSums s(num_experts, top_k);
  s.num_rows = values[0];
  for (int64_t e = 0; e < num_experts; ++e) {
    s.probs[static_cast<size_t>(e)] = values[static_cast<size_t>(1 + e)];
    s.choices[static_cast<size_t>(e)] = values[static_cast<size_t>(1 + num_experts + e)];
  }
  return s;
}

RouterLoadSums ComputeRouterLoadSums(const Tensor& logits, int64_t top_k) {
  CheckLogits(logits, top_k);
  const int64_t rows = logits.size(0), e_num = logits.size(1);
  RouterLoadSums s(e_num, top_k);
  s.num_rows = static_cast<double>(rows);
  std::vector<float> p(static_cast<size_t>(rows * e_num));
  kernels::SoftmaxRows(logits.data<float>(), p.data(), rows, e_num);
  std::vector<int32_t> idx(static_cast<size_t>(rows * top_k));
  std::vector<float> val(static_cast<size_t>(rows * top_k));
  kernels::TopK(p.data(), rows, e_num, top_k, idx.data(), val.data());
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t e = 0; e < e_num; ++e) s.probs[static_cast<size_t>(e)] += p[t * e_num + e];
    for (int64_t j = 0; j < top_k; ++j) s.choices[static_cast<size_t>(idx[t * top_k + j])] += 1.0;
  }
  return s;
}

double RouterLoadLoss(const RouterLoadSums& sums) {
  if (sums.num_rows <= 0) return 0.0;
  double acc = 0;
  for (size_t e = 0; e < sums.probs.size(); ++e) acc += sums.choices[e] * sums.probs[e];
  return static_cast<double>(sums.num_experts) * acc / (sums.num_rows * sums.num_rows);
}

double RouterLoadLoss(std::span<const Tensor> layer_logits, int64_t top_k) {
  SY_REQUIRE(!layer_logits.empty(), InvalidArgument, "router load loss: no router logits given");
  RouterLoadSums total(layer_logits.front().defined() ? layer_logits.front().size(1) : 0, top_k);
  for (const Tensor& l : layer_logits) total.Add(ComputeRouterLoadSums(l, top_k));
  return RouterLoadLoss(total);
}

void RouterLoadLossBackward(const Tensor& logits, const RouterLoadSums& total, float coef,
                            const Tensor& d_logits) {
  CheckLogits(logits, total.top_k);
  const int64_t rows = logits.size(0), e_num = logits.size(1);
  SY_REQUIRE(e_num == total.num_experts, InvalidArgument,
             "router load loss: logits have {} experts, the sums {}", e_num, total.num_experts);
  ExpectShape("router load loss d_logits", d_logits, {rows, e_num});
  if (total.num_rows <= 0 || rows == 0) return;
  // d l / d P[row, e] = E * c_e / N^2, the same for every row; then the softmax's backward.
  std::vector<float> g(static_cast<size_t>(e_num));
  const double scale =
      static_cast<double>(coef) * static_cast<double>(e_num) / (total.num_rows * total.num_rows);
  for (int64_t e = 0; e < e_num; ++e) {
    g[static_cast<size_t>(e)] = static_cast<float>(scale * total.choices[static_cast<size_t>(e)]);
  }
  std::vector<float> p(static_cast<size_t>(rows * e_num)), dp(static_cast<size_t>(rows * e_num));
  kernels::SoftmaxRows(logits.data<float>(), p.data(), rows, e_num);
  for (int64_t t = 0; t < rows; ++t) std::copy(g.begin(), g.end(), dp.begin() + t * e_num);
  kernels::SoftmaxRowsBackward(p.data(), dp.data(), dp.data(), rows, e_num);
  float* d = d_logits.data<float>();
  for (int64_t i = 0; i < rows * e_num; ++i) d[i] += dp[static_cast<size_t>(i)];
}

}  // namespace switchyard::moe
