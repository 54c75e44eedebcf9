// `switchyard train --upcycle-from` (train/upcycle.h): a dense model made an MoE model whose
// first step's loss equals the dense model's when the router is uniform (zero), for plain and
// granular upcycling, on one rank and at ep 2, from a switchyard dense run and from tiny Hugging
// Face Llama / Qwen2 directories (against PyTorch's dense loss); the expert and router layout of
// UpcycleWeights; bad input (exit 2, nothing written). Needs python3-torch: its absence fails.
#include "switchyard/train/upcycle.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "cli/run_switchyard.h"
#include "switchyard/core/safetensors.h"
#include "switchyard/train/metrics.h"
#include "train/tiny_hf.h"

namespace switchyard::train {
namespace {

using switchyard::testing::RunSwitchyard;

class Upcycle : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { hf_.Make("--family llama --family qwen2 --family mixtral"); }
  static void TearDownTestSuite() { hf_.dir.reset(); }
  static std::string Path(const std::string& name) { return *hf_.dir / name; }
  static testing::TinyHfDirs hf_;
};
testing::TinyHfDirs Upcycle::hf_;

// The first step's cross-entropy of the run in `run`.
double FirstCe(const std::string& run) {
  const std::vector<StepMetrics> m = ReadMetrics(run + "/metrics.jsonl");
  return m.empty() ? NAN : m.front().ce_loss;
}

std::string WriteCorpus(const std::string& path) {
  std::ofstream f(path);
  for (int i = 0; i < 200; ++i) f << "the quick brown fox jumps over the lazy dog " << i << "\n";
  return path;
}

// A dense GPT-style run (2 steps, so its weights are trained ones) upcycled with a zero router:
// the first step's loss equals the dense model's first step from the same weights, plain (each
// expert the whole MLP) and granular (4 experts each half of it, top 2), on one rank and ep 2.
TEST_F(Upcycle, FirstStepLossEqualsTheDenseModels) {
  ASSERT_NO_FATAL_FAILURE(hf_.RequireMade());  // the bad input includes an MoE directory
  const std::string common =
      "train --plain --data " + WriteCorpus(Path("corpus.txt")) +
      " --batch_size 8 --log_every 1 --eval_every 0 --sample_tokens 0 --threads 1 ";
  const std::string dense = Path("dense");
  auto r = RunSwitchyard(common +
                         "--seq_len 16 --model_dim 32 --num_layers 2 --num_heads 2 --hidden_dim 48 "
                         "--arch gpt --moe_every 0 --steps 2 --ranks 1 --out " +
                         dense);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // The dense model's loss at those weights: a new run from them, one step.
  r = RunSwitchyard(common + "--steps 1 --ranks 1 --init-from " + dense + " --out " +
                    Path("dense_again"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const double want = FirstCe(Path("dense_again"));
  ASSERT_TRUE(std::isfinite(want));
  struct Case {
    const char* name;
    const char* flags;
  };
  for (const Case& c : {Case{"plain_1", "--num_experts 4 --top_k 2 --ranks 1"},
                        Case{"plain_ep2", "--num_experts 4 --top_k 2 --ranks 2 --ep 2"},
                        Case{"granular_1",
                             "--num_experts 4 --top_k 2 --expert_hidden_dim 24 "
                             "--ranks 1"},
                        Case{"granular_ep2",
                             "--num_experts 4 --top_k 2 --expert_hidden_dim 24 "
                             "--ranks 2 --ep 2"}}) {
    const std::string out = Path(c.name);
    r = RunSwitchyard(common + "--steps 1 --moe_every 1 --capacity_factor 0 " + c.flags +
                      " --upcycle-zero-router --upcycle-from " + dense + " --out " + out);
    ASSERT_EQ(r.exit_code, 0) << c.name << ": " << r.err;
    EXPECT_NE(r.out.find("upcycled from"), std::string::npos) << r.out;
    EXPECT_NEAR(FirstCe(out), want, 2e-5 * std::abs(want)) << c.name;
  }
  // A fresh router: Megatron's grouped rows give the two experts of one copy of the MLP equal
  // scores, so with a renormalizing top 2 a token takes a whole copy and the loss is still the
  // dense one; with top 1 a token gets half the MLP and the loss moves away.
  for (const Case& c : {Case{"fresh_top2", "--top_k 2"}, Case{"fresh_top1", "--top_k 1"}}) {
    r = RunSwitchyard(common + "--steps 1 --moe_every 1 --capacity_factor 0 --num_experts 4 " +
                      c.flags + " --expert_hidden_dim 24 --ranks 1 --upcycle-from " + dense +
                      " --out " + Path(c.name));
    ASSERT_EQ(r.exit_code, 0) << r.err;
  }
  EXPECT_NEAR(FirstCe(Path("fresh_top2")), want, 2e-5 * std::abs(want));
  EXPECT_GT(std::abs(FirstCe(Path("fresh_top1")) - want), 1e-4 * std::abs(want));

  // Bad input: exit 2 naming what is wrong, no run directory written.
  struct Bad {
    std::string flags, message;
  };
  const std::string moe_run = Path("plain_1");
  for (const Bad& b :
       {Bad{"--upcycle-from " + moe_run, "already an MoE model"},
        Bad{"--upcycle-from " + Path("mixtral"), "already an MoE family"},
        Bad{"--upcycle-from " + dense + " --expert_hidden_dim 20", "'expert_hidden_dim': 20"},
        Bad{"--upcycle-from " + dense + " --expert_hidden_dim 16", "'num_experts'"},
        Bad{"--upcycle-from " + dense + " --moe_every 0", "'moe_every'"},
        Bad{"--upcycle-from " + dense + " --model_dim 64", "'model_dim': --model_dim gives 64"},
        Bad{"--upcycle-from " + dense + " --init-from " + dense, "--init-from"},
        Bad{"--upcycle-from " + Path("missing"), "--upcycle-from " + Path("missing")},
        Bad{"--upcycle-from " + Path("missing"), "or a Hugging Face model directory"},
        Bad{"--upcycle-zero-router", "needs --upcycle-from"}}) {
    const std::string out = Path("bad_run");
    r = RunSwitchyard(common + "--steps 1 --num_experts 4 --top_k 2 " + b.flags + " --out " + out);
    EXPECT_EQ(r.exit_code, 2) << b.flags << ": " << r.err;
    EXPECT_NE(r.err.find(b.message), std::string::npos) << b.flags << ": " << r.err;
    EXPECT_FALSE(std::filesystem::exists(out)) << b.flags;
  }
}

// Tiny Hugging Face Llama (to Mixtral, renormalized top 2, plain) and Qwen2 (to Qwen2-MoE, no
// renormalization, granular: 4 experts of half the MLP) upcycled with a zero router and trained
// one step at learning rate 0 (at ep 2 for Qwen2): `eval` of the run gives PyTorch's dense
// logits and cross-entropy.
TEST_F(Upcycle, HuggingFaceDenseEqualsPyTorchsDenseLoss) {
  ASSERT_NO_FATAL_FAILURE(hf_.RequireMade());
  // nanoGPT-style token data (uint16) inside the tiny vocabulary of 64.
  const std::string tokens = Path("tokens.bin");
  {
    std::mt19937 rng(3);
    std::vector<uint16_t> ids(4096);
    for (uint16_t& id : ids) id = static_cast<uint16_t>(rng() % 64);
    std::ofstream f(tokens, std::ios::binary);
    f.write(reinterpret_cast<const char*>(ids.data()),
            static_cast<std::streamsize>(ids.size() * 2));
  }
  const std::string common = "train --plain --data " + tokens +
                             " --data_format nanogpt --seq_len 8 --batch_size 4 --log_every 1 "
                             "--eval_every 0 --sample_tokens 0 --threads 1 --steps 1 --lr 0 "
                             "--min_lr 0 --warmup_steps 0 --val_fraction 0 --upcycle-zero-router ";
  struct Case {
    const char* family;
    const char* flags;
  };
  for (const Case& c : {Case{"llama", "--num_experts 4 --top_k 2 --ranks 1"},
                        Case{"qwen2",
                             "--num_experts 4 --top_k 2 --expert_hidden_dim 16 --ranks 2 "
                             "--ep 2"}}) {
    const std::string dir = Path(c.family), run = Path(std::string("run_") + c.family);
    auto r = RunSwitchyard(common + c.flags + " --upcycle-from " + dir + " --out " + run);
    ASSERT_EQ(r.exit_code, 0) << c.family << ": " << r.err;
    const std::string out = Path(std::string(c.family) + "_eval.safetensors");
    r = RunSwitchyard("eval --model " + run + " --tokens " + dir + "/tokens.json --out " + out);
    ASSERT_EQ(r.exit_code, 0) << c.family << ": " << r.err;
    const TensorMap got = ReadSafetensors(out);
    const TensorMap ref = ReadSafetensors(dir + "/reference.safetensors");
    EXPECT_NEAR(got.at("ce_loss").data<float>()[0], ref.at("ce_loss").data<float>()[0], 2e-6)
        << c.family;
    const Tensor& logits = got.at("logits");
    const Tensor& want = ref.at("logits");
    ASSERT_EQ(logits.shape(), want.shape()) << c.family;
    for (int64_t i = 0; i < want.numel(); ++i) {
      ASSERT_NEAR(logits.data<float>()[i], want.data<float>()[i], 2e-5) << c.family << " " << i;
    }
  }
}

// The layout of the upcycled tensors: expert j holds chunk j % G of the dense MLP (fc2 scaled by
// G / s, here s = 1: renormalized top 2), and router rows [rG, rG + G) are the fresh row r.
TEST(UpcycleWeights, ExpertChunksAndGroupedRouterRows) {
  TrainConfig c;
  c.model.model_dim = 2;
  c.model.num_layers = 1;
  c.model.num_heads = 1;
  c.model.hidden_dim = 4;
  c.model.moe_every = 1;
  c.num_experts = 4;
  c.top_k = 2;
  c.expert_hidden_dim = 2;  // G = 2
  auto iota = [](Shape shape, float start) {
    Tensor t = Tensor::Zeros(shape);
    for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = start + static_cast<float>(i);
    return t;
  };
  TensorMap dense = {{"blocks.0.mlp.fc1.weight", iota({4, 2}, 0)},
                     {"blocks.0.mlp.fc1.bias", iota({4}, 100)},
                     {"blocks.0.mlp.fc2.weight", iota({2, 4}, 200)},
                     {"blocks.0.mlp.fc2.bias", iota({2}, 300)},
                     {"blocks.0.norm1.weight", iota({2}, 400)}};
  TensorMap initial = {{"blocks.0.moe.experts.fc1.weight", Tensor::Zeros({4, 2, 2})},
                       {"blocks.0.moe.experts.fc1.bias", Tensor::Zeros({4, 2})},
                       {"blocks.0.moe.experts.fc2.weight", Tensor::Zeros({4, 2, 2})},
                       {"blocks.0.moe.experts.fc2.bias", Tensor::Zeros({4, 2})},
                       {"blocks.0.moe.gate.weight", iota({4, 2}, 500)},
                       {"blocks.0.norm1.weight", Tensor::Zeros({2})}};
  const TensorMap up = UpcycleWeights(dense, initial, c, {});
  const float* fc1 = up.at("blocks.0.moe.experts.fc1.weight").data<float>();
  const float* fc2 = up.at("blocks.0.moe.experts.fc2.weight").data<float>();
  const float* b2 = up.at("blocks.0.moe.experts.fc2.bias").data<float>();
  const float* gate = up.at("blocks.0.moe.gate.weight").data<float>();
  for (int64_t j = 0; j < 4; ++j) {
    const int64_t g = j % 2;
    for (int64_t i = 0; i < 4; ++i) EXPECT_EQ(fc1[j * 4 + i], static_cast<float>(g * 4 + i));
    for (int64_t m = 0; m < 2; ++m) {
      for (int64_t h = 0; h < 2; ++h) {
        EXPECT_EQ(fc2[j * 4 + m * 2 + h], 2.0f * static_cast<float>(200 + m * 4 + g * 2 + h));
      }
      EXPECT_EQ(b2[j * 2 + m], static_cast<float>(300 + m));
      EXPECT_EQ(gate[j * 2 + m], static_cast<float>(500 + (j / 2) * 2 + m));  // fresh row j / 2
    }
  }
  EXPECT_EQ(up.at("blocks.0.norm1.weight").data<float>()[1], 401.0f);
  // A tensor of the MoE block without a dense source, and a dense one without a place.
  TensorMap extra = initial;
  extra["blocks.0.moe.shared_experts.fc1.weight"] = Tensor::Zeros({2, 2, 2});
  EXPECT_THROW(UpcycleWeights(dense, extra, c, {}), InvalidArgument);
  TensorMap stray = dense;
  stray["blocks.0.attn.qkv.weight"] = Tensor::Zeros({6, 2});
  EXPECT_THROW(UpcycleWeights(stray, initial, c, {}), InvalidArgument);
}

}  // namespace
}  // namespace switchyard::train
