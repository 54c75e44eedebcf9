// The Hugging Face families' components in the model (docs/models.md): the tensor-parallel
// grouped-query attention and SwiGLU MLP against the plain layers of gqa_attention.h / swiglu.h
// (which hf_reference_test checks against PyTorch), the `arch` presets, and small Mixtral and
// OLMoE models trained in every layout (tp + sp, cp, pp, ep, ZeRO 3, recompute, bf16) against
// one rank.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "switchyard/comm/self.h"
#include "switchyard/core/rng.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/train/config.h"
#include "switchyard/train/gated_shared_moe.h"
#include "switchyard/train/gqa_attention.h"
#include "switchyard/train/hf_eval.h"
#include "switchyard/train/memory_estimate.h"
#include "switchyard/train/moe_feed_forward.h"
#include "switchyard/train/rope.h"
#include "switchyard/train/swiglu.h"
#include "switchyard/train/tensor_parallel_gqa.h"
#include "train/run_compare.h"
#include "train/temp_dir.h"
#include "train/tiny_run.h"

namespace switchyard::train {
namespace {

using testing::ExpectSameRun;
using testing::OnRanks;
using testing::SingleRank;
using testing::TempDir;

Tensor RandomTensor(Shape shape, uint64_t seed) {
  Tensor t = Tensor::Empty(shape);
  InitNormal(t, 1.0f, seed, "x");
  return t;
}

float MaxDiff(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape());
  float worst = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    worst = std::max(worst, std::abs(a.data<float>()[i] - b.data<float>()[i]));
  }
  return worst;
}

void AddInPlace(const Tensor& acc, const Tensor& x) {
  ASSERT_EQ(acc.shape(), x.shape());
  for (int64_t i = 0; i < acc.numel(); ++i) acc.data<float>()[i] += x.data<float>()[i];
}

// Copies every parameter of `from` into the parameter of `to` with the same name (both sets
// must have exactly the same names and shapes).
void CopyParameters(const ParameterSet& from, ParameterSet& to) {
  ASSERT_EQ(from.size(), to.size());
  for (const Parameter& p : from.all()) {
    Parameter* q = to.Find(p.name);
    ASSERT_NE(q, nullptr) << p.name;
    ASSERT_EQ(q->value.shape(), p.value.shape()) << p.name;
    q->value.CopyFrom(p.value);
  }
}

// The tensor-parallel attention over a one-rank group, around the softmax core, equals the plain
// GroupedQueryAttention (GQA, RoPE, q/k/v biases, QK-norm; names equal too), forward and backward.
TEST(ModelArchTest, TensorParallelGqaEqualsPlainLayer) {
  for (bool qk_norm : {false, true}) {
    GqaOptions plain{.model_dim = 16,
                     .num_heads = 4,
                     .num_kv_heads = 2,
                     .rope_theta = 1e4,
                     .rope = true,
                     .qkv_bias = !qk_norm,
                     .qk_norm = qk_norm,
                     .norm_eps = 1e-5f,
                     .seed = 7};
    ParameterSet ref_params;
    GroupedQueryAttention ref(ref_params, "attn.", plain);
    auto group = comm::CreateSelfCommunicator();
    ParameterSet params;
    TpGqaOptions o{.model_dim = 16,
                   .num_heads = 4,
                   .num_kv_heads = 2,
                   .rope = true,
                   .rope_theta = 1e4,
                   .qkv_bias = !qk_norm,
                   .o_bias = false,
                   .qk_norm = qk_norm,
                   .norm_eps = 1e-5f,
                   .seed = 3};
    TensorParallelGqaAttention tp(params, "attn.", o, *group, {});
    CopyParameters(ref_params, params);
    const int64_t batch = 2, seq = 5;
    const Tensor x = RandomTensor({batch * seq, 16}, 11);
    const std::vector<int64_t> positions = SequencePositions(batch, seq);
    GqaCache ref_cache;
    const Tensor want = ref.Forward(x, batch, positions, &ref_cache);
    TpGqaCache cache;
    const Tensor qkv = tp.ProjectQkv(x, positions, &cache, 1);
    Tensor probs;
    const Tensor att = CausalAttentionForward(qkv, batch, tp.local_heads(), 1, &probs);
    const Tensor got = tp.o_proj().Forward(att, nullptr);
    EXPECT_LT(MaxDiff(got, want), 1e-5f) << "qk_norm " << qk_norm;
    const Tensor dy = RandomTensor({batch * seq, 16}, 12);
    const Tensor dx_want = ref.Backward(ref_cache, dy);
    const Tensor datt = tp.o_proj().Backward(RowParallelCache{att}, dy);
    const Tensor dx = tp.ProjectQkvBackward(
        cache, CausalAttentionBackward(qkv, probs, datt, batch, tp.local_heads(), 1), 1);
    EXPECT_LT(MaxDiff(dx, dx_want), 1e-5f) << "qk_norm " << qk_norm;
    for (const Parameter& p : ref_params.all()) {
      EXPECT_LT(MaxDiff(params.Find(p.name)->grad, p.grad), 1e-4f) << p.name;
    }
  }
}

TEST(ModelArchTest, TensorParallelSwiGluEqualsPlainLayer) {
  ParameterSet ref_params;
  SwiGluMlp ref(ref_params, "mlp.", 16, 24, 0.02f, 0.02f, 5);
  auto group = comm::CreateSelfCommunicator();
  ParameterSet params;
  TensorParallelSwiGlu tp(params, "mlp.", 16, 24, false, 0.5f, 0.5f, 9, *group, {});
  CopyParameters(ref_params, params);
  const Tensor x = RandomTensor({6, 16}, 1);
  SwiGluCache ref_cache;
  const Tensor want = ref.Forward(x, &ref_cache);
  FeedForwardOutput out = tp.Forward(x, FeedForwardContext{});
  EXPECT_LT(MaxDiff(out.y, want), 1e-5f);
  const Tensor dy = RandomTensor({6, 16}, 2);
  EXPECT_LT(MaxDiff(tp.Backward(out, dy, 1.0f, 1), ref.Backward(ref_cache, dy)), 1e-5f);
  for (const Parameter& p : ref_params.all()) {
    EXPECT_LT(MaxDiff(params.Find(p.name)->grad, p.grad), 1e-5f) << p.name;
  }
}

// The gated shared expert around an MoE FFN, over a one-rank group, equals the routed FFN plus
// the plain GatedSharedExpert (swiglu.h, checked against PyTorch by hf_reference_test), forward
// and backward, with the same names; and its gradients agree with finite differences.
TEST(ModelArchTest, GatedSharedExpertMoeEqualsPlainLayers) {
  moe::LayerConfig layer;
  layer.model_dim = 16;
  layer.hidden_dim = 12;
  layer.num_experts = 4;
  layer.top_k = 2;
  layer.gated = true;
  layer.activation = kernels::Activation::kSilu;
  layer.fc_bias = false;
  layer.dropless = true;
  // No loss terms: the objective of the finite differences below is sum(y * dy) alone.
  layer.aux_loss_coef = 0;
  layer.z_loss_coef = 0;
  ParameterSet ref_params;
  MoeFeedForward ref_moe(ref_params, "moe.", layer, 3);
  GatedSharedExpert ref_shared(ref_params, "moe.", 16, 20, 0.3f, 0.3f, 4);
  auto group = comm::CreateSelfCommunicator();
  ParameterSet params;
  GatedSharedExpertMoe ffn(std::make_unique<MoeFeedForward>(params, "moe.", layer, 3), params,
                           "moe.", 16, 20, 0.3f, 0.3f, 9, *group, {});
  CopyParameters(ref_params, params);
  const Tensor x = RandomTensor({6, 16}, 1);
  const Tensor dy = RandomTensor({6, 16}, 2);
  FeedForwardOutput routed = ref_moe.Forward(x, FeedForwardContext{});
  GatedSharedExpertCache shared_cache;
  Tensor want = ref_shared.Forward(x, &shared_cache);
  AddInPlace(want, routed.y);
  FeedForwardOutput out = ffn.Forward(x, FeedForwardContext{});
  EXPECT_LT(MaxDiff(out.y, want), 1e-6f);
  EXPECT_EQ(out.loss, routed.loss);
  Tensor dx_want = ref_moe.Backward(routed, dy, 1.0f, 1);
  AddInPlace(dx_want, ref_shared.Backward(shared_cache, dy));
  const Tensor dx = ffn.Backward(out, dy, 1.0f, 1);
  EXPECT_LT(MaxDiff(dx, dx_want), 1e-5f);
  for (const Parameter& p : ref_params.all()) {
    EXPECT_LT(MaxDiff(params.Find(p.name)->grad, p.grad), 1e-5f) << p.name;
  }
  // Finite differences of sum(y * dy) for the gate's weight, a shared-expert weight and the
  // input, in double precision sums of float32 forwards.
  params.ZeroGrad();
  FeedForwardOutput again = ffn.Forward(x, FeedForwardContext{});
  const Tensor dx0 = ffn.Backward(again, dy, 1.0f, 1);
  auto objective = [&]() {
    FeedForwardContext no_save;
    no_save.save_for_backward = false;
    const Tensor y = ffn.Forward(x, no_save).y;
    double s = 0;
    for (int64_t i = 0; i < y.numel(); ++i) s += double{y.data<float>()[i]} * dy.data<float>()[i];
    return s;
  };
  const float h = 1e-2f;
  auto central = [&](float* v) {
    const float keep = *v;
    *v = keep + h;
    const double plus = objective();
    *v = keep - h;
    const double minus = objective();
    *v = keep;
    return (plus - minus) / (2 * h);
  };
  Parameter& gate = params.Get("moe.shared_expert_gate.weight");
  for (int64_t j : {0, 5, 15}) {
    const double fd = central(gate.value.data<float>() + j);
    EXPECT_NEAR(gate.grad.data<float>()[j], fd, 2e-3 * (1 + std::abs(fd))) << "gate " << j;
  }
  Parameter& up = params.Get("moe.shared_expert.up_proj.weight");
  for (int64_t j : {0, 77, 319}) {
    const double fd = central(up.value.data<float>() + j);
    EXPECT_NEAR(up.grad.data<float>()[j], fd, 2e-3 * (1 + std::abs(fd))) << "up " << j;
  }
  // The input (far from routing ties: a small step keeps the experts chosen).
  Tensor& xm = const_cast<Tensor&>(x);
  for (int64_t j : {3, 40, 90}) {
    const double fd = central(xm.data<float>() + j);
    EXPECT_NEAR(dx0.data<float>()[j], fd, 2e-2 * (1 + std::abs(fd))) << "x " << j;
  }
}

// pad_token_id: the padding token's embedding row gets no gradient from the lookup; other rows
// and the same model without it do.
TEST(ModelArchTest, PadTokenRowGetsNoGradient) {
  ModelConfig c;
  c.vocab_size = 16;
  c.seq_len = 8;
  c.model_dim = 8;
  c.num_layers = 1;
  c.num_heads = 2;
  c.hidden_dim = 16;
  c.tied_head = false;
  Tensor tokens = Tensor::Empty({2, 8}, DType::kInt32);
  Tensor targets = Tensor::Empty({2, 8}, DType::kInt32);
  for (int64_t i = 0; i < 16; ++i) {
    tokens.data<int32_t>()[i] = static_cast<int32_t>(i % 5);  // token 3 appears
    targets.data<int32_t>()[i] = static_cast<int32_t>((i + 1) % 5);
  }
  auto row_norm = [](const TransformerLm& m, int64_t row) {
    const Parameter* e = m.parameters().Find("embed.weight");
    double s = 0;
    for (int64_t j = 0; j < 8; ++j) s += std::abs(e->grad.data<float>()[row * 8 + j]);
    return s;
  };
  for (int64_t pad : {-1, 3}) {
    c.pad_token_id = pad;
    TransformerLm model(c, 1);
    model.Backward(model.Forward(tokens, targets, ForwardOptions{}));
    EXPECT_GT(row_norm(model, 2), 0.0) << "pad " << pad;
    if (pad == 3) {
      EXPECT_EQ(row_norm(model, 3), 0.0);
    } else {
      EXPECT_GT(row_norm(model, 3), 0.0);
    }
  }
}

// `arch` sets the family's values of the keys no source sets; an explicit key wins; gpt changes
// nothing.
ResolvedTrainConfig Resolve(const TrainConfig& defaults, std::map<std::string, std::string> flags) {
  TrainConfigSources sources;
  sources.defaults = defaults;
  sources.flags = std::move(flags);
  return ResolveTrainConfig(sources);
}

TEST(ModelArchTest, ArchPresetsSetFamilyDefaults) {
  TrainConfig defaults;
  ResolvedTrainConfig gpt = Resolve(defaults, {{"arch", "gpt"}});
  nlohmann::json a = nlohmann::json::parse(TrainConfigToJson(gpt.config));
  nlohmann::json b = nlohmann::json::parse(TrainConfigToJson(defaults));
  EXPECT_EQ(a, b);
  ResolvedTrainConfig mixtral = Resolve(defaults, {{"arch", "mixtral"}, {"rope_theta", "500"}});
  const TrainConfig& m = mixtral.config;
  EXPECT_EQ(m.model.norm, NormKind::kRmsNorm);
  EXPECT_TRUE(m.model.position_embedding == PositionEmbedding::kRope);
  EXPECT_EQ(m.model.rope_theta, 500.0);  // the flag, not the preset's 1e6
  EXPECT_TRUE(m.model.mlp == MlpKind::kSwiGlu);
  EXPECT_TRUE(m.model.attention_bias == AttentionBias::kNone);
  EXPECT_FALSE(m.model.tied_head);
  EXPECT_TRUE(m.hf_router);
  EXPECT_TRUE(m.norm_topk_prob);
  EXPECT_EQ(m.model.moe_every, 1);
  EXPECT_EQ(m.model.num_kv_heads, defaults.model.num_heads / 4);
  const moe::LayerConfig layer = MoeLayerConfig(m);
  EXPECT_TRUE(layer.gated);
  EXPECT_FALSE(layer.fc_bias);
  EXPECT_TRUE(layer.dropless);
  EXPECT_EQ(layer.score_function, moe::ScoreFunction::kSoftmaxAfterTopK);
  // Hugging Face's loss over the concatenated layers; the per-layer gshard stays selectable.
  EXPECT_EQ(m.aux_loss, "hf_concat");
  EXPECT_EQ(layer.aux_loss, moe::AuxLoss::kHfConcat);
  EXPECT_EQ(gpt.config.aux_loss, "gshard");
  EXPECT_EQ(Resolve(defaults, {{"arch", "olmoe"}, {"aux_loss", "gshard"}}).config.aux_loss,
            "gshard");
  const TrainConfig olmoe = Resolve(defaults, {{"arch", "olmoe"}}).config;
  EXPECT_TRUE(olmoe.model.qk_norm);
  EXPECT_FALSE(olmoe.norm_topk_prob);
  EXPECT_EQ(MoeLayerConfig(olmoe).score_function, moe::ScoreFunction::kSoftmax);
  EXPECT_FALSE(MoeLayerConfig(olmoe).normalize_gate);
  const TrainConfig qwen = Resolve(defaults, {{"arch", "qwen2_moe"}}).config;
  EXPECT_TRUE(qwen.model.attention_bias == AttentionBias::kQkv);
  EXPECT_EQ(qwen.model.norm_eps, 1e-6);
  EXPECT_EQ(qwen.model.gated_shared_expert_hidden, defaults.model.hidden_dim);
  EXPECT_EQ(m.model.gated_shared_expert_hidden, 0);
}

// mlp_only_layers (Hugging Face's semantics with moe_every as decoder_sparse_step): block i is an
// MoE block iff (i + 1) % moe_every == 0 and i is not listed; the dense blocks get the dense MLP's
// parameters, the MoE blocks the experts and the gated shared expert with Hugging Face's names.
TEST(ModelArchTest, MlpOnlyLayersAndSharedExpertParameters) {
  ModelConfig c;
  c.num_layers = 6;
  c.moe_every = 2;
  c.mlp_only_layers = {3};
  c.mlp = MlpKind::kSwiGlu;
  c.mlp_bias = false;
  c.gated_shared_expert_hidden = 24;
  std::vector<bool> moe;
  for (int64_t i = 0; i < c.num_layers; ++i) moe.push_back(IsMoeBlock(c, i));
  EXPECT_EQ(moe, (std::vector<bool>{false, true, false, false, false, true}));
  TrainConfig t;
  t.model = c;
  EXPECT_EQ(NumMoeBlocks(t.model), 2);
  t.model.mlp_only_layers = {6};
  EXPECT_THROW(ValidateModelConfig(t.model), InvalidArgument);
  moe::LayerConfig layer;
  layer.model_dim = c.model_dim;
  layer.hidden_dim = 32;
  layer.num_experts = 4;
  layer.top_k = 2;
  layer.gated = true;
  layer.activation = kernels::Activation::kSilu;
  layer.fc_bias = false;
  TransformerLm model(c, 1, MoeFeedForwardFactory(layer));
  const ParameterSet& p = model.parameters();
  EXPECT_NE(p.Find("blocks.3.mlp.gate_proj.weight"), nullptr);
  EXPECT_EQ(p.Find("blocks.3.moe.gate.weight"), nullptr);
  EXPECT_NE(p.Find("blocks.5.moe.experts.fc1.weight"), nullptr);
  ASSERT_NE(p.Find("blocks.5.moe.shared_expert.gate_proj.weight"), nullptr);
  EXPECT_EQ(p.Find("blocks.5.moe.shared_expert.up_proj.weight")->value.shape(), (Shape{24, 128}));
  EXPECT_EQ(p.Find("blocks.5.moe.shared_expert.down_proj.weight")->value.shape(), (Shape{128, 24}));
  EXPECT_EQ(p.Find("blocks.5.moe.shared_expert_gate.weight")->value.shape(), (Shape{1, 128}));
  EXPECT_EQ(p.Find("blocks.1.moe.shared_expert.up_proj.bias"), nullptr);
}

// The memory estimate counts what the model holds: blocks that mlp_only_layers keeps dense and
// the gated shared expert change its parameter bytes (values and gradients, 8 per value on one
// rank at ZeRO 0) by exactly the parameters they change in the model.
TEST(ModelArchTest, MemoryEstimateCountsDenseBlocksAndSharedExpert) {
  TrainConfig t;
  t.model.num_layers = 4;
  t.model.moe_every = 1;
  t.model.model_dim = 32;
  t.model.num_heads = 2;
  t.model.hidden_dim = 48;
  t.model.mlp = MlpKind::kSwiGlu;
  t.model.mlp_bias = false;
  t.num_experts = 4;
  t.top_k = 2;
  t.expert_hidden_dim = 16;
  t.ranks = 1;
  auto count = [](const TrainConfig& c) {
    TransformerLm model(c.model, 1, MoeFeedForwardFactory(MoeLayerConfig(c)));
    int64_t n = 0;
    for (const Parameter& p : model.parameters().all()) n += p.value.numel();
    return n;
  };
  auto estimate = [](const TrainConfig& c) { return EstimateRankMemory(c).parameter_bytes; };
  TrainConfig dense_blocks = t;
  dense_blocks.model.mlp_only_layers = {0, 2};
  TrainConfig shared = dense_blocks;
  shared.model.gated_shared_expert_hidden = 24;
  EXPECT_EQ(estimate(dense_blocks) - estimate(t), 8 * (count(dense_blocks) - count(t)));
  EXPECT_EQ(estimate(shared) - estimate(dense_blocks), 8 * (count(shared) - count(dense_blocks)));
  EXPECT_GT(EstimateRankMemory(shared).activation_bytes,
            EstimateRankMemory(dense_blocks).activation_bytes);
}

// A small model of the family: the tiny MoE run's sizes with 4 heads (2 kv heads), MoE in
// every block.
// qwen2_moe: its gated shared expert (the preset's, hidden_dim wide) and block 0 dense
// (mlp_only_layers), so that a pipeline stage holds no experts.
TrainConfig Family(const TempDir& dir, const char* arch) {
  TrainConfig base = testing::TinyMoeConfig(dir);
  base.model.num_heads = 4;
  std::map<std::string, std::string> flags = {{"arch", arch}, {"num_kv_heads", "2"}};
  if (std::string(arch) == "qwen2_moe") flags["mlp_only_layers"] = "0";
  return Resolve(base, flags).config;
}

struct Layout {
  int ranks = 1, tp = 1;
  bool sp = false;
  int cp = 1, pp = 1, ep = 0, zero = 0;
  const char* recompute = "none";
};

std::string Describe(const Layout& l) {
  return fmt::format("ranks {} tp {}{} cp {} pp {} ep {} zero {} recompute {}", l.ranks, l.tp,
                     l.sp ? " sp" : "", l.cp, l.pp, l.ep, l.zero, l.recompute);
}

TrainConfig WithLayout(TrainConfig c, const Layout& l) {
  c.ranks = l.ranks;
  c.tp = l.tp;
  c.sequence_parallel = l.sp;
  c.cp = l.cp;
  c.pp = l.pp;
  c.ep = l.ep;
  c.zero_stage = l.zero;
  c.model.recompute = RecomputeFromName(l.recompute);
  return c;
}

class FamilyLayoutTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override { kernels::SetBlasThreads(1); }
  TempDir dir_;
};

TEST_P(FamilyLayoutTest, EveryLayoutMatchesOneRank) {
  TrainConfig base = Family(dir_, GetParam());
  base.microbatches = 2;  // what pp needs; every layout runs the same micro-batches
  const int kSteps = 2;
  const testing::RunRecord want = SingleRank(base, kSteps);
  for (double loss : want.loss) EXPECT_TRUE(std::isfinite(loss));
  const Layout layouts[] = {
      {.ranks = 2, .tp = 2},
      {.ranks = 2, .tp = 2, .sp = true},
      {.ranks = 2, .cp = 2},
      {.ranks = 2, .pp = 2},
      {.ranks = 2, .ep = 2},
      {.ranks = 4, .ep = 2, .zero = 3},
      {.ranks = 4, .tp = 2, .sp = true, .ep = 2, .zero = 1},
      {.ranks = 2, .tp = 2, .recompute = "full"},
      {.ranks = 1, .recompute = "selective"},
      // tp 4 over 2 kv heads: each kv head replicated on two ranks.
      {.ranks = 4, .tp = 4},
      {.ranks = 4, .tp = 4, .sp = true},
  };
  for (const Layout& l : layouts) {
    ExpectSameRun(want, OnRanks(WithLayout(base, l), kSteps), GetParam() + (" " + Describe(l)));
  }
  // bf16 mixed precision at tp 2 + sp against bf16 on one rank, with the bounds of
  // MixedPrecisionTest.TensorParallelMatchesOneRank (precision_test.cc): the bfloat16 operands
  // are the same values in either layout, only float32 partial sums add in another order, which
  // can move a later bfloat16 rounding by one unit (so parameters after Adam steps are not
  // compared); closer to the one-rank bf16 run than fp32 is (bf16 is really in use).
  TrainConfig bf16 = base;
  bf16.model.precision = Precision::kBFloat16;
  const testing::RunRecord want_bf16 = SingleRank(bf16, kSteps);
  const testing::RunRecord got =
      OnRanks(WithLayout(bf16, {.ranks = 2, .tp = 2, .sp = true}), kSteps);
  for (int s = 0; s < kSteps; ++s) {
    const double gap = std::abs(got.loss[s] - want_bf16.loss[s]);
    EXPECT_LE(gap, 1e-4 * want_bf16.loss[s]) << GetParam() << " bf16 step " << s;
    EXPECT_LT(gap, std::abs(want.loss[s] - want_bf16.loss[s])) << GetParam() << " bf16 step " << s;
    EXPECT_NEAR(got.grad_norm[s], want_bf16.grad_norm[s], 5e-3 * want_bf16.grad_norm[s])
        << GetParam() << " bf16 step " << s;
  }
}

// aux_loss hf_concat (Hugging Face's loss over every MoE block's router rows of a micro-batch)
// in training: a small Mixtral (two MoE blocks, so the concatenation is not one layer's) with a
// coefficient large enough to move the gradients.
class HfConcatTrainTest : public ::testing::Test {
 protected:
  void SetUp() override { kernels::SetBlasThreads(1); }
  TempDir dir_;
};

TrainConfig HfConcatMixtral(const TempDir& dir) {
  TrainConfig c = Family(dir, "mixtral");
  c.aux_loss = "hf_concat";
  c.aux_loss_coef = 0.5;
  c.microbatches = 2;
  return c;
}

// The concatenation needs E columns in every block's rows: a pyramid is refused by key.
TEST_F(HfConcatTrainTest, HfConcatRefusesExpertsPerBlock) {
  TrainConfig c = HfConcatMixtral(dir_);
  c.experts_per_block = {4, 8};
  try {
    ValidateTrainConfig(c);
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'experts_per_block'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("hf_concat"), std::string::npos) << e.what();
  }
  c.aux_loss = "gshard";
  EXPECT_NO_THROW(ValidateTrainConfig(c));
}

// The training loss of each micro-batch is eval's aux_loss on the same rows and weights (eval
// computes the convention on its own, with a wrapper of the MoE blocks: hf_eval.h); the step
// reports the mean over the micro-batches, and loss - ce_loss = coef x aux (+ the blocks' z-loss
// terms).
TEST_F(HfConcatTrainTest, HfConcatTrainingLossEqualsEval) {
  const TrainConfig c = HfConcatMixtral(dir_);
  Trainer t(c);
  std::vector<Batch> seen;
  t.set_batch_observer(
      [&](int64_t, const std::vector<int64_t>&, const std::vector<Batch>& b) { seen = b; });
  TensorMap weights;
  for (const auto& [name, value] : t.model().parameters().Values()) weights[name] = value.Clone();
  const StepMetrics m = t.Step();
  ASSERT_EQ(seen.size(), 2u);
  double want = 0;
  for (const Batch& b : seen) {
    want += hf::EvaluateModel(c, weights, b.tokens, c.aux_loss_coef, false).aux_loss / 2;
  }
  EXPECT_NEAR(m.aux_loss, want, 1e-6 * want);
  // The z-loss term is each block's (m.z_loss their mean); the aux term is counted once.
  const double z_term = c.z_loss_coef * m.z_loss * static_cast<double>(NumMoeBlocks(c.model));
  EXPECT_NEAR(m.loss - m.ce_loss, c.aux_loss_coef * want + z_term, 1e-6);
  EXPECT_GT(want, 1.0);  // about k = 2 when balanced
}

// The trainer's gradient of the aux term (its gradient with aux_loss_coef 0.5 minus with 0, same
// weights and batch, no clipping) equals eval's (hf_eval.h's wrapper: an independent
// implementation with two passes) averaged over the step's micro-batches, for every parameter:
// the totals reach every block's backward, the later block's counts included.
TEST_F(HfConcatTrainTest, HfConcatGradientEqualsEval) {
  TrainConfig c = HfConcatMixtral(dir_);
  c.grad_clip = 0;
  auto train_grads = [&](double coef, std::vector<Batch>* seen, TensorMap* weights) {
    TrainConfig tc = c;
    tc.aux_loss_coef = coef;
    Trainer t(tc);
    t.set_batch_observer(
        [&](int64_t, const std::vector<int64_t>&, const std::vector<Batch>& b) { *seen = b; });
    for (const auto& [name, v] : t.model().parameters().Values()) (*weights)[name] = v.Clone();
    t.Step();
    TensorMap g;
    for (const Parameter& p : t.model().parameters().all()) {
      if (p.grad.defined()) g[p.name] = p.grad.Clone();
    }
    return g;
  };
  std::vector<Batch> seen;
  TensorMap weights;
  const TensorMap with = train_grads(c.aux_loss_coef, &seen, &weights);
  const TensorMap without = train_grads(0.0, &seen, &weights);
  ASSERT_EQ(seen.size(), 2u);
  TensorMap want;
  for (const Batch& b : seen) {
    const hf::EvalResult e1 = hf::EvaluateModel(c, weights, b.tokens, c.aux_loss_coef, true);
    const hf::EvalResult e0 = hf::EvaluateModel(c, weights, b.tokens, 0.0, true);
    for (const auto& [name, g1] : e1.grads) {
      Tensor& w = want[name];
      if (!w.defined()) w = Tensor::Zeros(g1.shape());
      for (int64_t i = 0; i < g1.numel(); ++i) {
        w.data<float>()[i] += (g1.data<float>()[i] - e0.grads.at(name).data<float>()[i]) / 2;
      }
    }
  }
  double largest = 0;
  for (const auto& [name, w] : want) {
    ASSERT_TRUE(with.count(name) && without.count(name)) << name;
    for (int64_t i = 0; i < w.numel(); ++i) {
      const double got = with.at(name).data<float>()[i] - without.at(name).data<float>()[i];
      const double expected = w.data<float>()[i];
      largest = std::max(largest, std::abs(expected));
      EXPECT_NEAR(got, expected, 2e-6 + 1e-3 * std::abs(expected)) << name << " [" << i << "]";
    }
  }
  EXPECT_GT(largest, 1e-3);  // the aux term moves the gradients
}

// hf_concat in every layout the brief of the convention names (tp 2 with and without sequence
// parallelism, cp 2, pp 2 with 1F1B over 2 micro-batches — the counts travel between the stages
// with the activations and the totals with the gradients —, ep 2, ep 2 with ZeRO 3, full and
// selective recomputation) against one rank.
TEST_F(HfConcatTrainTest, HfConcatEveryLayoutMatchesOneRank) {
  const TrainConfig base = HfConcatMixtral(dir_);
  const int kSteps = 2;
  const testing::RunRecord want = SingleRank(base, kSteps);
  const Layout layouts[] = {
      {.ranks = 2, .tp = 2},
      {.ranks = 2, .tp = 2, .sp = true},
      {.ranks = 2, .cp = 2},
      {.ranks = 2, .pp = 2},
      {.ranks = 2, .ep = 2},
      {.ranks = 4, .ep = 2, .zero = 3},
      {.ranks = 2, .tp = 2, .recompute = "full"},
      {.ranks = 2, .pp = 2, .recompute = "full"},
      {.ranks = 1, .recompute = "selective"},
  };
  for (const Layout& l : layouts) {
    ExpectSameRun(want, OnRanks(WithLayout(base, l), kSteps), "hf_concat " + Describe(l));
  }
  // The zero-bubble schedule (B split from W) and the interleaved one (two chunks per stage: the
  // sums pass stage 0, 1, 0, 1 forward and back) on four blocks.
  TrainConfig zb = WithLayout(base, {.ranks = 2, .pp = 2});
  zb.pipeline_schedule = parallel::ScheduleKind::kZeroBubbleH1;
  ExpectSameRun(want, OnRanks(zb, kSteps), "hf_concat pp 2 zb-h1");
  TrainConfig deep = base;
  deep.model.num_layers = 4;
  TrainConfig interleaved = WithLayout(deep, {.ranks = 2, .pp = 2});
  interleaved.pipeline_schedule = parallel::ScheduleKind::kInterleaved1F1B;
  interleaved.virtual_stages = 2;
  ExpectSameRun(SingleRank(deep, kSteps), OnRanks(interleaved, kSteps),
                "hf_concat pp 2 interleaved");
  // routing_scope per_rank: each data-parallel rank's forward is its own concatenation (Hugging
  // Face under DDP), which is one rank with dp times the micro-batches.
  TrainConfig per_rank = WithLayout(base, {.ranks = 2, .ep = 2});
  per_rank.routing_scope = parallel::BatchScope::kPerRank;
  TrainConfig split = base;
  split.microbatches = 2 * base.microbatches;
  const testing::RunRecord got = OnRanks(per_rank, kSteps);
  ExpectSameRun(SingleRank(split, kSteps), got, "hf_concat per_rank dp 2");
  EXPECT_GT(std::abs(got.aux_loss[0] - want.aux_loss[0]), 1e-6);  // fewer rows per concatenation
}

INSTANTIATE_TEST_SUITE_P(Families, FamilyLayoutTest,
                         ::testing::Values("mixtral", "olmoe", "qwen2_moe"));

}  // namespace
}  // namespace switchyard::train
