// Uses an installed switchyard through its public headers only, on memory the program owns:
//   1. an MoE layer forward on an input in a std::vector (Tensor::FromBlob, no copy), checked
//      against a plain loop over the experts the layer chose;
//   2. an all-reduce over 2 ranks as threads of this process, in place in the ranks' vectors.
// Exits 0 and prints "consumer: ok" when every result is right, 1 otherwise.
#include <cmath>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "switchyard/comm/inprocess.h"
#include "switchyard/core/tensor.h"
#include "switchyard/moe/layer.h"
#include "switchyard/version.h"

namespace sy = switchyard;

namespace {

int failures = 0;

void Expect(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "consumer: FAILED: %s\n", what.c_str());
    ++failures;
  }
}

// out[r] = sum_c w[r, c] * in[c] + b[r]: one row of an expert's Linear layer.
std::vector<float> Linear(const float* w, const float* b, const std::vector<float>& in,
                          int64_t rows) {
  std::vector<float> out(static_cast<size_t>(rows));
  const auto cols = static_cast<int64_t>(in.size());
  for (int64_t r = 0; r < rows; ++r) {
    double acc = b[r];
    for (int64_t c = 0; c < cols; ++c) acc += double{w[r * cols + c]} * in[c];
    out[r] = static_cast<float>(acc);
  }
  return out;
}

void CheckMoeLayer() {
  constexpr int64_t kTokens = 6, kModel = 8, kHidden = 16, kExperts = 4;
  sy::moe::LayerConfig config;
  config.model_dim = kModel;
  config.hidden_dim = kHidden;
  config.num_experts = kExperts;
  config.top_k = 2;
  config.capacity_factor = 0;  // no token is dropped
  config.activation = sy::kernels::Activation::kRelu;
  sy::moe::MoeLayer layer(config);
  sy::moe::LayerParams params = sy::moe::InitParams(config, /*seed=*/7);

  // The input lives in the program's own vector; the tensor is a view of it.
  std::vector<float> x_buffer(kTokens * kModel);
  for (size_t i = 0; i < x_buffer.size(); ++i) x_buffer[i] = std::sin(0.7f * float(i));
  sy::Tensor x = sy::Tensor::FromBlob(x_buffer.data(), {kTokens, kModel});
  Expect(x.raw() == x_buffer.data(), "FromBlob points at the caller's buffer");

  sy::moe::ForwardOptions options;
  options.save_for_backward = false;
  sy::moe::LayerOutput out = layer.Forward(params, x, options);
  Expect(out.y.shape() == sy::Shape{kTokens, kModel},
         "y has shape [6, 8], got " + sy::ShapeToString(out.y.shape()));
  Expect(out.dropped == 0, "no token dropped with capacity_factor 0");

  // The result written into the program's memory through a second view.
  std::vector<float> y_buffer(kTokens * kModel, 0.0f);
  sy::Tensor::FromBlob(y_buffer.data(), {kTokens, kModel}).CopyFrom(out.y);

  const sy::moe::ExpertWeights& w = params.experts;
  const float* gate_w = params.gate_weight.data<float>();
  for (int64_t t = 0; t < kTokens; ++t) {
    std::vector<float> xt(x_buffer.begin() + t * kModel, x_buffer.begin() + (t + 1) * kModel);
    // The first choice is the expert with the largest gate logit.
    std::vector<float> zero_bias(kExperts, 0.0f);
    std::vector<float> logits = Linear(gate_w, zero_bias.data(), xt, kExperts);
    int64_t best = 0;
    for (int64_t e = 1; e < kExperts; ++e) best = logits[e] > logits[best] ? e : best;
    Expect(out.topk_idx.data<int32_t>()[t * 2] == best,
           "token " + std::to_string(t) + ": first choice is expert " + std::to_string(best));
    // y_t = sum_j weight_j * fc2(relu(fc1(x_t))) of expert j.
    std::vector<double> y_ref(kModel, 0.0);
    double weight_sum = 0;
    for (int64_t j = 0; j < 2; ++j) {
      int64_t e = out.topk_idx.data<int32_t>()[t * 2 + j];
      float weight = out.combine_weights.data<float>()[t * 2 + j];
      weight_sum += weight;
      std::vector<float> h = Linear(w.fc1_weight.data<float>() + e * kHidden * kModel,
                                    w.fc1_bias.data<float>() + e * kHidden, xt, kHidden);
      for (float& v : h) v = v > 0 ? v : 0;
      std::vector<float> o = Linear(w.fc2_weight.data<float>() + e * kModel * kHidden,
                                    w.fc2_bias.data<float>() + e * kModel, h, kModel);
      for (int64_t m = 0; m < kModel; ++m) y_ref[m] += double{weight} * o[m];
    }
    Expect(std::fabs(weight_sum - 1.0) < 1e-5, "token " + std::to_string(t) +
                                                   ": combine weights sum to 1, got " +
                                                   std::to_string(weight_sum));
    for (int64_t m = 0; m < kModel; ++m) {
      double got = y_buffer[t * kModel + m];
      Expect(std::fabs(got - y_ref[m]) <= 1e-4 + 1e-4 * std::fabs(y_ref[m]),
             "y[" + std::to_string(t) + ", " + std::to_string(m) + "] = " + std::to_string(got) +
                 ", expected " + std::to_string(y_ref[m]));
    }
  }
}

void CheckAllReduce() {
  constexpr int kRanks = 2;
  constexpr int64_t kCount = 1001;
  std::vector<std::vector<float>> buffers(kRanks, std::vector<float>(kCount));
  sy::comm::RunInProcess(kRanks, [&](sy::comm::Communicator& comm) {
    std::vector<float>& mine = buffers[static_cast<size_t>(comm.rank())];
    for (int64_t i = 0; i < kCount; ++i) mine[i] = float((comm.rank() + 1) * (i + 1));
    // In place, in this rank's vector.
    comm.AllReduce(sy::Tensor::FromBlob(mine.data(), {kCount})).Wait();
  });
  for (int r = 0; r < kRanks; ++r) {
    for (int64_t i = 0; i < kCount; ++i) {
      float expected = float(3 * (i + 1));  // 1 * (i + 1) + 2 * (i + 1)
      if (buffers[r][i] != expected) {
        Expect(false, "rank " + std::to_string(r) + " element " + std::to_string(i) + " = " +
                          std::to_string(buffers[r][i]) + ", expected " + std::to_string(expected));
        break;
      }
    }
  }
}

}  // namespace

int main() {
  try {
    Expect(std::string(sy::kVersion) == SWITCHYARD_PACKAGE_VERSION,
           std::string("headers say version ") + sy::kVersion + ", the package " +
               SWITCHYARD_PACKAGE_VERSION);
    CheckMoeLayer();
    CheckAllReduce();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer: FAILED: %s\n", e.what());
    return 1;
  }
  if (failures > 0) return 1;
  std::printf("consumer: ok (switchyard %s)\n", sy::kVersion);
  return 0;
}
