// The pieces composed as each Hugging Face family composes them, on the tiny directories of
// tests/models/make_tiny_hf.py, against the plain PyTorch forward the script writes
// (reference.safetensors: logits, ce_loss, aux_loss, loss). This is the end-to-end check of
// RoPE, GQA, QK-norm, q/k/v bias, RMSNorm eps, SwiGLU, the routers as MoE layer configurations,
// Qwen2-MoE's gated shared expert, dense layers among MoE layers, tied embeddings, the
// load-balancing loss and the parameter names and shapes. It needs PyTorch (python3-torch) for
// the reference and is skipped, saying so, without it.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <vector>

#include "switchyard/core/file_util.h"
#include "switchyard/core/safetensors.h"
#include "switchyard/moe/layer.h"
#include "switchyard/moe/router_load_loss.h"
#include "switchyard/train/gqa_attention.h"
#include "switchyard/train/hf_checkpoint.h"
#include "switchyard/train/hf_config.h"
#include "switchyard/train/layers.h"
#include "switchyard/train/rope.h"
#include "switchyard/train/swiglu.h"
#include "train/temp_dir.h"

namespace switchyard::train::hf {
namespace {

// The family's routed experts as an MoE layer configuration (docs/models.md, "Routers").
moe::LayerConfig RoutedExperts(const ModelConfig& c) {
  moe::LayerConfig l;
  l.model_dim = c.hidden_size;
  l.hidden_dim = c.moe_intermediate_size;
  l.num_experts = c.num_experts;
  l.top_k = c.num_experts_per_tok;
  l.score_function =
      c.norm_topk_prob ? moe::ScoreFunction::kSoftmaxAfterTopK : moe::ScoreFunction::kSoftmax;
  l.normalize_gate = c.norm_topk_prob;
  l.dropless = true;
  l.gated = true;
  l.activation = kernels::Activation::kSilu;
  l.fc_bias = false;
  l.aux_loss = moe::AuxLoss::kNone;  // the family's loss is over all layers (router_load_loss.h)
  moe::ValidateConfig(l);
  return l;
}

// Stacks expert `matrix` of every expert of `layer` into [E, rows, cols].
Tensor StackExperts(const CheckpointReader& r, const ModelConfig& c, int64_t layer,
                    ExpertMatrix matrix) {
  const int64_t m = c.hidden_size, h = c.moe_intermediate_size;
  const Shape one = matrix == ExpertMatrix::kDown ? Shape{m, h} : Shape{h, m};
  Tensor out = Tensor::Empty({c.num_experts, one[0], one[1]});
  for (int64_t e = 0; e < c.num_experts; ++e) {
    Tensor t = r.ReadFloat32(ExpertTensorName(c, layer, e, matrix), one);
    std::copy_n(t.data<float>(), t.numel(), out.data<float>() + e * t.numel());
  }
  return out;
}

struct Result {
  Tensor logits;  // [B * T, V]
  double ce_loss = 0, aux_loss = 0, loss = 0;
};

// The family's forward on one rank, written with switchyard's pieces.
Result Forward(const std::string& dir, const std::vector<std::vector<int32_t>>& ids) {
  const ModelConfig c = ReadModelConfig(dir);
  const CheckpointReader reader(dir);
  reader.Validate(c);
  const int64_t batch = static_cast<int64_t>(ids.size()), seq = static_cast<int64_t>(ids[0].size());
  const int64_t m = c.hidden_size;
  const auto eps = static_cast<float>(c.rms_norm_eps);
  ParameterSet ps;
  Embedding embed(ps, "model.embed_tokens.", c.vocab_size, m, 0.02f, 0);
  struct Block {
    std::unique_ptr<Norm> in_norm, post_norm;
    std::unique_ptr<GroupedQueryAttention> attn;
    std::unique_ptr<SwiGluMlp> mlp;
    std::unique_ptr<GatedSharedExpert> shared;
  };
  std::vector<Block> blocks(static_cast<size_t>(c.num_hidden_layers));
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    Block& b = blocks[static_cast<size_t>(l)];
    b.in_norm = std::make_unique<Norm>(ps, p + "input_layernorm.", m, NormKind::kRmsNorm, eps);
    b.post_norm =
        std::make_unique<Norm>(ps, p + "post_attention_layernorm.", m, NormKind::kRmsNorm, eps);
    GqaOptions o;
    o.model_dim = m;
    o.num_heads = c.num_attention_heads;
    o.num_kv_heads = c.num_key_value_heads;
    o.head_dim = c.head_dim;
    o.rope_theta = c.rope_theta;
    o.qkv_bias = c.qkv_bias;
    o.qk_norm = c.qk_norm;
    o.norm_eps = eps;
    b.attn = std::make_unique<GroupedQueryAttention>(ps, p + "self_attn.", o);
    if (!c.IsMoeLayer(l)) {
      b.mlp = std::make_unique<SwiGluMlp>(ps, p + "mlp.", m, c.intermediate_size, 0.02f, 0.02f, 0);
    } else if (c.shared_expert_intermediate_size > 0) {
      b.shared = std::make_unique<GatedSharedExpert>(
          ps, p + "mlp.", m, c.shared_expert_intermediate_size, 0.02f, 0.02f, 0);
    }
  }
  Norm final_norm(ps, "model.norm.", m, NormKind::kRmsNorm, eps);
  Linear head(ps, "lm_head.", m, c.vocab_size, false, 0.02f, 0);
  for (Parameter& p : ps.all()) {
    const std::string& name = c.tie_word_embeddings && p.name == "lm_head.weight"
                                  ? std::string("model.embed_tokens.weight")
                                  : p.name;
    p.value.CopyFrom(reader.ReadFloat32(name, p.value.shape()));
  }

  std::vector<int32_t> flat, targets;
  for (const auto& row : ids) {
    for (size_t t = 0; t < row.size(); ++t) {
      flat.push_back(row[t]);
      targets.push_back(t + 1 < row.size() ? row[t + 1] : -1);
    }
  }
  const int64_t n = batch * seq;
  Tensor h = embed.Forward(Tensor::FromVector(flat, {n}));
  const std::vector<int64_t> positions = SequencePositions(batch, seq);
  std::vector<Tensor> router_logits;
  auto add = [](Tensor& acc, const Tensor& y) {
    for (int64_t i = 0; i < acc.numel(); ++i) acc.data<float>()[i] += y.data<float>()[i];
  };
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    Block& b = blocks[static_cast<size_t>(l)];
    add(h, b.attn->Forward(b.in_norm->Forward(h, nullptr), batch, positions, nullptr));
    Tensor x = b.post_norm->Forward(h, nullptr);
    if (!c.IsMoeLayer(l)) {
      add(h, b.mlp->Forward(x, nullptr));
      continue;
    }
    moe::LayerParams lp;
    lp.gate_weight = reader.ReadFloat32(RouterTensorName(c, l), {c.num_experts, m});
    lp.experts.fc1_weight = StackExperts(reader, c, l, ExpertMatrix::kGate);
    lp.experts.fc3_weight = StackExperts(reader, c, l, ExpertMatrix::kUp);
    lp.experts.fc2_weight = StackExperts(reader, c, l, ExpertMatrix::kDown);
    moe::ForwardOptions fo;
    fo.training = false;
    fo.save_for_backward = false;
    add(h, moe::MoeLayer(RoutedExperts(c)).Forward(lp, x, fo).y);
    if (b.shared) add(h, b.shared->Forward(x, nullptr));
    Tensor logits = Tensor::Zeros({n, c.num_experts});
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t e = 0; e < c.num_experts; ++e) {
        double s = 0;
        for (int64_t j = 0; j < m; ++j) {
          s += double(x.data<float>()[t * m + j]) * lp.gate_weight.data<float>()[e * m + j];
        }
        logits.data<float>()[t * c.num_experts + e] = static_cast<float>(s);
      }
    }
    router_logits.push_back(logits);
  }
  Result r;
  r.logits = head.Forward(final_norm.Forward(h, nullptr));
  r.ce_loss = SoftmaxCrossEntropy(r.logits, Tensor::FromVector(targets, {n}), nullptr).loss;
  if (!router_logits.empty())
    r.aux_loss = moe::RouterLoadLoss(router_logits, c.num_experts_per_tok);
  r.loss = r.ce_loss + c.router_aux_loss_coef * r.aux_loss;
  return r;
}

class HfReference : public ::testing::TestWithParam<const char*> {
 protected:
  static void SetUpTestSuite() {
    dir_ = std::make_unique<testing::TempDir>();
    const std::string cmd = std::string(SY_SYSTEM_PYTHON3) + " -c 'import torch' > /dev/null 2>&1";
    has_torch_ = std::system(cmd.c_str()) == 0;
    if (!has_torch_) return;
    const std::string make = std::string(SY_SYSTEM_PYTHON3) + " " + SY_MAKE_TINY_HF + " --out " +
                             dir_->path() + " --max-shard-bytes 30000 > " + dir_->path() +
                             "/log.txt 2>&1";
    made_ = std::system(make.c_str()) == 0;
  }
  static void TearDownTestSuite() { dir_.reset(); }

  static std::unique_ptr<testing::TempDir> dir_;
  static bool has_torch_;
  static bool made_;
};
std::unique_ptr<testing::TempDir> HfReference::dir_;
bool HfReference::has_torch_ = false;
bool HfReference::made_ = false;

TEST_P(HfReference, LogitsAndLossesEqualThePyTorchForward) {
  if (!has_torch_) GTEST_SKIP() << "PyTorch is not importable by " << SY_SYSTEM_PYTHON3;
  ASSERT_TRUE(made_) << ReadTextFile(*dir_ / "log.txt");
  const std::string dir = *dir_ / GetParam();
  nlohmann::json tokens = nlohmann::json::parse(ReadTextFile(dir + "/tokens.json"));
  const auto ids = tokens["input_ids"].get<std::vector<std::vector<int32_t>>>();
  const TensorMap ref = ReadSafetensors(dir + "/reference.safetensors");
  const Result got = Forward(dir, ids);
  const Tensor& want = ref.at("logits");
  ASSERT_EQ(want.numel(), got.logits.numel());
  double worst = 0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    worst = std::max(worst, double(std::abs(got.logits.data<float>()[i] - want.data<float>()[i])));
  }
  EXPECT_LE(worst, 2e-5) << GetParam() << ": largest |logit difference|";
  EXPECT_NEAR(got.ce_loss, ref.at("ce_loss").data<float>()[0], 2e-6) << GetParam();
  EXPECT_NEAR(got.aux_loss, ref.at("aux_loss").data<float>()[0], 2e-6) << GetParam();
  EXPECT_NEAR(got.loss, ref.at("loss").data<float>()[0], 2e-6) << GetParam();
}

INSTANTIATE_TEST_SUITE_P(Families, HfReference,
                         ::testing::Values("mixtral", "qwen2_moe", "olmoe", "llama", "qwen2"),
                         [](const ::testing::TestParamInfo<const char*>& param_info) {
                           return std::string(param_info.param);
                         });

}  // namespace
}  // namespace switchyard::train::hf
