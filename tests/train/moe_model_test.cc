// The real MoE layer as the FFN of every other block: gradients of the whole model against
// finite differences, names, the trainer's routing metrics and figures, and bit-for-bit resume
// with the expert-bias buffer.
#include <gtest/gtest.h>

#include <filesystem>

#include "switchyard/core/file_util.h"
#include "switchyard/train/moe_feed_forward.h"
#include "switchyard/train/trainer.h"
#include "train/grad_check.h"
#include "train/temp_dir.h"

namespace switchyard::train {
namespace {

using testing::CheckGradient;
using testing::TempDir;

ModelConfig TinyMoeModel() {
  ModelConfig c;
  c.vocab_size = 13;
  c.seq_len = 5;
  c.model_dim = 8;
  c.num_layers = 2;
  c.num_heads = 2;
  c.hidden_dim = 12;
  c.init_std = 0.3f;
  c.moe_every = 2;
  return c;
}

moe::LayerConfig TinyMoeLayer() {
  moe::LayerConfig l;
  l.model_dim = 8;
  l.hidden_dim = 6;
  l.num_experts = 4;
  l.top_k = 2;
  l.capacity_factor = 0;  // no drops: the loss is smooth in the parameters
  l.aux_loss_coef = 0.1f;
  l.z_loss_coef = 0.01f;
  l.seed = 3;
  return l;
}

Tensor Tokens(std::vector<int32_t> v, int64_t batch) {
  int64_t seq = static_cast<int64_t>(v.size()) / batch;
  return Tensor::FromVector(v, {batch, seq});
}

TEST(MoeModelTest, GradientsMatchFiniteDifferences) {
  TransformerLm model(TinyMoeModel(), 9, MoeFeedForwardFactory(TinyMoeLayer()));
  Tensor tokens = Tokens({1, 5, 2, 7, 3, 12, 0, 4, 4, 9}, 2);
  Tensor targets = Tokens({5, 2, 7, 3, 11, 0, 4, 4, 9, 1}, 2);
  ForwardOptions fo;
  LmOutput out = model.Forward(tokens, targets, fo);
  ASSERT_EQ(out.routing.size(), 1u);
  EXPECT_EQ(out.routing[0].routed, 20);  // 10 tokens x top-2
  EXPECT_EQ(out.routing[0].dropped, 0);
  EXPECT_GT(out.aux_loss, 0);
  EXPECT_GT(out.z_loss, 0);
  EXPECT_NEAR(out.loss, out.ce_loss + 0.1 * out.aux_loss + 0.01 * out.z_loss, 1e-6);
  model.parameters().ZeroGrad();
  model.Backward(out);
  auto loss = [&] {
    ForwardOptions o = fo;
    o.save_for_backward = false;
    return model.Forward(tokens, targets, o).loss;
  };
  for (auto& p : model.parameters().all()) {
    if (!p.options.trainable) continue;
    EXPECT_TRUE(CheckGradient(p.name, loss, p.value, p.grad, 5e-3, 3e-2, 1e-4, 24));
  }
}

TEST(MoeModelTest, LossScaleScalesTheAuxiliaryGradientToo) {
  TransformerLm model(TinyMoeModel(), 9, MoeFeedForwardFactory(TinyMoeLayer()));
  Tensor tokens = Tokens({1, 5, 2, 7, 3, 12, 0, 4, 4, 9}, 2);
  Tensor targets = Tokens({5, 2, 7, 3, 11, 0, 4, 4, 9, 1}, 2);
  LmOutput out = model.Forward(tokens, targets, {});
  model.Backward(out, 1.0f);
  Tensor full = model.parameters().Get("blocks.1.moe.gate.weight").grad.Clone();
  model.parameters().ZeroGrad();
  model.Backward(out, 0.5f);
  const Tensor& half = model.parameters().Get("blocks.1.moe.gate.weight").grad;
  for (int64_t i = 0; i < full.numel(); ++i) {
    EXPECT_NEAR(half.data<float>()[i], 0.5f * full.data<float>()[i],
                1e-6 + 1e-5 * std::abs(full.data<float>()[i]));
  }
}

TEST(MoeModelTest, ParameterNamesAndGroups) {
  TransformerLm model(TinyMoeModel(), 9, MoeFeedForwardFactory(TinyMoeLayer()));
  const ParameterSet& p = model.parameters();
  ASSERT_NE(p.Find("blocks.0.mlp.fc1.weight"), nullptr);
  ASSERT_EQ(p.Find("blocks.1.mlp.fc1.weight"), nullptr);
  EXPECT_EQ(p.Find("blocks.1.moe.gate.weight")->value.shape(), (Shape{4, 8}));
  EXPECT_EQ(p.Find("blocks.1.moe.gate.weight")->options.group, ParamGroup::kDense);
  EXPECT_EQ(p.Find("blocks.1.moe.experts.fc1.weight")->value.shape(), (Shape{4, 6, 8}));
  EXPECT_EQ(p.Find("blocks.1.moe.experts.fc2.weight")->value.shape(), (Shape{4, 8, 6}));
  EXPECT_EQ(p.Find("blocks.1.moe.experts.fc1.bias")->options.group, ParamGroup::kExpert);
  EXPECT_TRUE(p.Find("blocks.1.moe.experts.fc1.weight")->options.weight_decay);
  EXPECT_FALSE(p.Find("blocks.1.moe.experts.fc1.bias")->options.weight_decay);
  EXPECT_EQ(model.experts_per_moe_block(), (std::vector<int64_t>{4}));
}

std::string WriteCorpus(const TempDir& dir) {
  std::string text;
  for (int i = 0; i < 120; ++i)
    text += (i % 2 ? "red fish blue fish.\n%\n" : "one two three.\n%\n");
  WriteTextFileAtomic(dir / "corpus.txt", text);
  return dir / "corpus.txt";
}

TrainConfig TinyMoeTrainConfig(const TempDir& dir) {
  TrainConfig c;
  c.model.seq_len = 16;
  c.model.model_dim = 32;
  c.model.num_layers = 2;
  c.model.num_heads = 2;
  c.model.hidden_dim = 64;
  c.model.moe_every = 2;
  c.num_experts = 4;
  c.top_k = 2;
  c.capacity_factor = 1.0;
  c.batch_size = 8;
  c.steps = 6;
  c.warmup_steps = 2;
  c.data = WriteCorpus(dir);
  c.out = dir / "run";
  c.eval_every = 3;
  c.log_every = 1;
  c.checkpoint_every = 3;
  c.keep_checkpoints = 0;
  c.sample_tokens = 10;
  c.threads = 1;
  return c;
}

std::FILE* DevNull() {
  static std::FILE* f = std::fopen("/dev/null", "w");
  return f;
}

TEST(MoeTrainerTest, MetricsFiguresAndBitForBitResume) {
  TempDir dir;
  TrainConfig c = TinyMoeTrainConfig(dir);
  // Aux-loss-free balancing too: its bias is a buffer that must survive the checkpoint.
  WriteTextFileAtomic(dir / "layer.json",
                      R"({"expert_bias": true, "expert_bias_update_rate": 0.01})");
  c.moe_layer_config = dir / "layer.json";
  c.expert_bias_update_rate = 0.01;  // as ResolveTrainConfig takes it from the file
  {
    Trainer t(c);
    EXPECT_TRUE(MoeLayerConfig(c).expert_bias);
    RunOptions o;
    o.out = DevNull();
    t.Run(o);
    double bias = 0;
    const Tensor& b = t.model().parameters().Get("blocks.1.moe.gate.expert_bias").value;
    for (int64_t i = 0; i < b.numel(); ++i) bias += std::abs(b.data<float>()[i]);
    EXPECT_GT(bias, 0.0);  // updated from the loads
  }
  EXPECT_TRUE(std::filesystem::exists(c.out + "/expert_load.svg"));
  std::vector<StepMetrics> straight = ReadMetrics(c.out + "/metrics.jsonl");
  ASSERT_EQ(straight.size(), 6u);
  for (const auto& m : straight) {
    ASSERT_EQ(m.expert_load.size(), 1u);
    int64_t routed = 0;
    for (int64_t l : m.expert_load[0]) routed += l;
    EXPECT_EQ(routed, 8 * 16 * 2);  // every token routed twice
    ASSERT_EQ(m.drop_rate.size(), 1u);
    EXPECT_GE(m.drop_rate[0], 0.0);
    EXPECT_GT(m.aux_loss, 0.0);
  }
  EXPECT_NE(ReadTextFile(c.out + "/expert_load.svg").find("MoE layer 0"), std::string::npos);
  {
    Trainer t(c);
    RunOptions o;
    o.out = DevNull();
    o.resume = c.out + "/checkpoints/step_00000003";
    t.Run(o);
  }
  std::vector<StepMetrics> again = ReadMetrics(c.out + "/metrics.jsonl");
  ASSERT_EQ(again.size(), 6u);
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(again[i].loss, straight[i].loss) << "step " << again[i].step;
    EXPECT_EQ(again[i].expert_load, straight[i].expert_load);
  }
}

TEST(MoeTrainerTest, MoeLayerConfigComesFromTheTrainConfig) {
  TrainConfig c;
  c.model.model_dim = 64;
  c.model.hidden_dim = 256;
  c.expert_hidden_dim = 128;
  c.num_experts = 8;
  c.top_k = 1;
  c.capacity_factor = 2.0;
  c.aux_loss_coef = 0.02;
  c.seed = 11;
  moe::LayerConfig l = MoeLayerConfig(c);
  EXPECT_EQ(l.model_dim, 64);
  EXPECT_EQ(l.hidden_dim, 128);
  EXPECT_EQ(l.num_experts, 8);
  EXPECT_EQ(l.top_k, 1);
  EXPECT_FLOAT_EQ(l.capacity_factor, 2.0f);
  EXPECT_FLOAT_EQ(l.aux_loss_coef, 0.02f);
  EXPECT_EQ(l.seed, 11u);
  c.moe_layer_config = "/nonexistent/layer.json";
  EXPECT_THROW(MoeLayerConfig(c), IoError);
}

}  // namespace
}  // namespace switchyard::train
