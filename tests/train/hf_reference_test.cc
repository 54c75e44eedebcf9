// The pieces composed as each Hugging Face family composes them, on the tiny directories of
// tests/models/make_tiny_hf.py, against the plain PyTorch forward the script writes
// (reference.safetensors: logits, ce_loss, aux_loss, loss). This is the end-to-end check of
// RoPE, GQA, QK-norm, q/k/v bias, RMSNorm eps, SwiGLU, the routers as MoE layer configurations,
// Qwen2-MoE's gated shared expert, dense layers among MoE layers, tied embeddings, the
// load-balancing loss and the parameter names and shapes, forward and backward (every
// parameter's gradient against autograd's). It needs PyTorch (python3-torch) for
// the reference and is skipped, saying so, without it.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
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
#include "train/tiny_hf.h"

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

struct Block {
  std::unique_ptr<Norm> in_norm, post_norm;
  std::unique_ptr<GroupedQueryAttention> attn;
  std::unique_ptr<SwiGluMlp> mlp;
  std::unique_ptr<GatedSharedExpert> shared;
  moe::LayerParams
      moe;  // MoE layers: router and stacked experts (fc1 = gate, fc3 = up, fc2 = down)
  // Forward caches.
  NormCache in_cache, post_cache;
  GqaCache attn_cache;
  SwiGluCache mlp_cache;
  GatedSharedExpertCache shared_cache;
  moe::LayerOutput moe_out;
  Tensor x;              // post_attention_layernorm's output, the MLP's input
  Tensor router_logits;  // [n, E]
};

void AddInto(const Tensor& acc, const Tensor& y) {
  for (int64_t i = 0; i < acc.numel(); ++i) acc.data<float>()[i] += y.data<float>()[i];
}

// a + b as a new tensor (the forward's residual stream: the norms' caches keep their inputs).
Tensor Sum(const Tensor& a, const Tensor& b) {
  Tensor y = a.Clone();
  AddInto(y, b);
  return y;
}

// The family's model on one rank, written with switchyard's pieces: forward, and the backward of
// loss = ce_loss + router_aux_loss_coef * aux_loss into Hugging Face-named gradients.
class TinyModel {
 public:
  explicit TinyModel(const std::string& dir)
      : c_(ReadModelConfig(dir)),
        reader_(dir),
        embed_(ps_, "model.embed_tokens.", c_.vocab_size, c_.hidden_size, 0.02f, 0),
        final_norm_(ps_, "model.norm.", c_.hidden_size, NormKind::kRmsNorm, Eps()),
        head_(ps_, "lm_head.", c_.hidden_size, c_.vocab_size, false, 0.02f, 0) {
    reader_.Validate(c_);
    const int64_t m = c_.hidden_size;
    blocks_.resize(static_cast<size_t>(c_.num_hidden_layers));
    for (int64_t l = 0; l < c_.num_hidden_layers; ++l) {
      const std::string p = fmt::format("model.layers.{}.", l);
      Block& b = blocks_[static_cast<size_t>(l)];
      b.in_norm = std::make_unique<Norm>(ps_, p + "input_layernorm.", m, NormKind::kRmsNorm, Eps());
      b.post_norm = std::make_unique<Norm>(ps_, p + "post_attention_layernorm.", m,
                                           NormKind::kRmsNorm, Eps());
      GqaOptions o;
      o.model_dim = m;
      o.num_heads = c_.num_attention_heads;
      o.num_kv_heads = c_.num_key_value_heads;
      o.head_dim = c_.head_dim;
      o.rope_theta = c_.rope_theta;
      o.qkv_bias = c_.qkv_bias;
      o.qk_norm = c_.qk_norm;
      o.norm_eps = Eps();
      b.attn = std::make_unique<GroupedQueryAttention>(ps_, p + "self_attn.", o);
      if (!c_.IsMoeLayer(l)) {
        b.mlp =
            std::make_unique<SwiGluMlp>(ps_, p + "mlp.", m, c_.intermediate_size, 0.02f, 0.02f, 0);
        continue;
      }
      if (c_.shared_expert_intermediate_size > 0) {
        b.shared = std::make_unique<GatedSharedExpert>(
            ps_, p + "mlp.", m, c_.shared_expert_intermediate_size, 0.02f, 0.02f, 0);
      }
      b.moe.gate_weight = reader_.ReadFloat32(RouterTensorName(c_, l), {c_.num_experts, m});
      b.moe.experts.fc1_weight = StackExperts(reader_, c_, l, ExpertMatrix::kGate);
      b.moe.experts.fc3_weight = StackExperts(reader_, c_, l, ExpertMatrix::kUp);
      b.moe.experts.fc2_weight = StackExperts(reader_, c_, l, ExpertMatrix::kDown);
    }
    for (Parameter& p : ps_.all()) {
      const bool tied = c_.tie_word_embeddings && p.name == "lm_head.weight";
      p.value.CopyFrom(
          reader_.ReadFloat32(tied ? "model.embed_tokens.weight" : p.name, p.value.shape()));
    }
  }

  const ModelConfig& config() const { return c_; }

  // ids [B][T] -> logits [B * T, V] and the losses.
  void Forward(const std::vector<std::vector<int32_t>>& ids) {
    const int64_t batch = static_cast<int64_t>(ids.size());
    const int64_t seq = static_cast<int64_t>(ids[0].size()), n = batch * seq;
    std::vector<int32_t> flat, targets;
    for (const auto& row : ids) {
      for (size_t t = 0; t < row.size(); ++t) {
        flat.push_back(row[t]);
        targets.push_back(t + 1 < row.size() ? row[t + 1] : -1);
      }
    }
    ids_ = Tensor::FromVector(flat, {n});
    targets_ = Tensor::FromVector(targets, {n});
    Tensor h = embed_.Forward(ids_);
    const std::vector<int64_t> positions = SequencePositions(batch, seq);
    std::vector<Tensor> router_logits;
    for (int64_t l = 0; l < c_.num_hidden_layers; ++l) {
      Block& b = blocks_[static_cast<size_t>(l)];
      h = Sum(h,
              b.attn->Forward(b.in_norm->Forward(h, &b.in_cache), batch, positions, &b.attn_cache));
      b.x = b.post_norm->Forward(h, &b.post_cache);
      if (b.mlp) {
        h = Sum(h, b.mlp->Forward(b.x, &b.mlp_cache));
        continue;
      }
      moe::ForwardOptions fo;
      fo.training = false;
      b.moe_out = moe::MoeLayer(RoutedExperts(c_)).Forward(b.moe, b.x, fo);
      h = Sum(h, b.moe_out.y);
      if (b.shared) h = Sum(h, b.shared->Forward(b.x, &b.shared_cache));
      b.router_logits = Linear_(b.x, b.moe.gate_weight);
      router_logits.push_back(b.router_logits);
    }
    final_in_ = final_norm_.Forward(h, &final_cache_);
    logits = head_.Forward(final_in_);
    ce_loss = SoftmaxCrossEntropy(logits, targets_, &dlogits_).loss;
    sums_ = moe::RouterLoadSums(c_.num_experts, c_.num_experts_per_tok);
    for (const Tensor& rl : router_logits) {
      sums_.Add(moe::ComputeRouterLoadSums(rl, c_.num_experts_per_tok));
    }
    aux_loss = c_.is_moe() ? moe::RouterLoadLoss(sums_) : 0.0;
    loss = ce_loss + c_.router_aux_loss_coef * aux_loss;
  }

  // d loss / d parameter under Hugging Face's names.
  std::map<std::string, Tensor> Backward() {
    ps_.ZeroGrad();
    std::map<std::string, Tensor> grads;
    Tensor dh = final_norm_.Backward(final_cache_, head_.Backward(final_in_, dlogits_));
    const auto coef = static_cast<float>(c_.router_aux_loss_coef);
    for (int64_t l = c_.num_hidden_layers - 1; l >= 0; --l) {
      Block& b = blocks_[static_cast<size_t>(l)];
      Tensor dx;
      if (b.mlp) {
        dx = b.mlp->Backward(b.mlp_cache, dh);
      } else {
        moe::LayerGradients g = moe::MoeLayer(RoutedExperts(c_)).Backward(b.moe, b.moe_out, dh);
        dx = g.x;
        if (b.shared) AddInto(dx, b.shared->Backward(b.shared_cache, dh));
        // The load-balancing loss through this layer's router logits = x Wg^T.
        const int64_t n = b.x.size(0), e_num = c_.num_experts, m = c_.hidden_size;
        Tensor dl = Tensor::Zeros({n, e_num});
        moe::RouterLoadLossBackward(b.router_logits, sums_, coef, dl);
        for (int64_t t = 0; t < n; ++t) {
          for (int64_t e = 0; e < e_num; ++e) {
            const float d = dl.data<float>()[t * e_num + e];
            for (int64_t j = 0; j < m; ++j) {
              g.params.gate_weight.data<float>()[e * m + j] += d * b.x.data<float>()[t * m + j];
              dx.data<float>()[t * m + j] += d * b.moe.gate_weight.data<float>()[e * m + j];
            }
          }
        }
        grads[RouterTensorName(c_, l)] = g.params.gate_weight;
        const ExpertMatrix which[] = {ExpertMatrix::kGate, ExpertMatrix::kUp, ExpertMatrix::kDown};
        const Tensor* stacked[] = {&g.params.experts.fc1_weight, &g.params.experts.fc3_weight,
                                   &g.params.experts.fc2_weight};
        for (int w = 0; w < 3; ++w) {
          const int64_t size = stacked[w]->numel() / e_num;
          for (int64_t e = 0; e < e_num; ++e) {
            Tensor one = Tensor::Empty({size});
            std::copy_n(stacked[w]->data<float>() + e * size, size, one.data<float>());
            grads[ExpertTensorName(c_, l, e, which[w])] = one;
          }
        }
      }
      AddInto(dh, b.post_norm->Backward(b.post_cache, dx));
      AddInto(dh, b.in_norm->Backward(b.in_cache, b.attn->Backward(b.attn_cache, dh)));
    }
    embed_.Backward(ids_, dh);
    for (Parameter& p : ps_.all()) grads[p.name] = p.grad;
    if (c_.pad_token_id) {  // nn.Embedding's padding_idx: the lookup adds nothing to that row
      Tensor& g = grads["model.embed_tokens.weight"];
      std::fill_n(g.data<float>() + *c_.pad_token_id * c_.hidden_size, c_.hidden_size, 0.0f);
    }
    if (c_.tie_word_embeddings) {  // one matrix: the embedding's and the head's gradients add
      AddInto(grads["model.embed_tokens.weight"], grads["lm_head.weight"]);
      grads.erase("lm_head.weight");
    }
    return grads;
  }

  Tensor logits;  // [B * T, V]
  double ce_loss = 0, aux_loss = 0, loss = 0;

 private:
  float Eps() const { return static_cast<float>(c_.rms_norm_eps); }
  // x [n, m] · w^T, w [e, m], in double.
  static Tensor Linear_(const Tensor& x, const Tensor& w) {
    const int64_t n = x.size(0), m = x.size(1), e_num = w.size(0);
    Tensor y = Tensor::Zeros({n, e_num});
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t e = 0; e < e_num; ++e) {
        double s = 0;
        for (int64_t j = 0; j < m; ++j) {
          s += double(x.data<float>()[t * m + j]) * w.data<float>()[e * m + j];
        }
        y.data<float>()[t * e_num + e] = static_cast<float>(s);
      }
    }
    return y;
  }

  ModelConfig c_;
  CheckpointReader reader_;
  ParameterSet ps_;
  Embedding embed_;
  Norm final_norm_;
  Linear head_;
  std::vector<Block> blocks_;
  Tensor ids_, targets_, final_in_, dlogits_;
  NormCache final_cache_;
  moe::RouterLoadSums sums_;
};

class HfReference : public ::testing::TestWithParam<const char*> {
 protected:
  static void SetUpTestSuite() { hf_.Make("--max-shard-bytes 30000"); }
  static void TearDownTestSuite() { hf_.dir.reset(); }

  static testing::TinyHfDirs hf_;
};
testing::TinyHfDirs HfReference::hf_;

TEST_P(HfReference, LogitsAndLossesEqualThePyTorchForward) {
  ASSERT_NO_FATAL_FAILURE(hf_.RequireMade());
  const std::string dir = *hf_.dir / GetParam();
  nlohmann::json tokens = nlohmann::json::parse(ReadTextFile(dir + "/tokens.json"));
  const auto ids = tokens["input_ids"].get<std::vector<std::vector<int32_t>>>();
  const TensorMap ref = ReadSafetensors(dir + "/reference.safetensors");
  TinyModel model(dir);
  model.Forward(ids);
  const Tensor& want = ref.at("logits");
  ASSERT_EQ(want.numel(), model.logits.numel());
  double worst = 0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    worst =
        std::max(worst, double(std::abs(model.logits.data<float>()[i] - want.data<float>()[i])));
  }
  EXPECT_LE(worst, 2e-5) << GetParam() << ": largest |logit difference|";
  EXPECT_NEAR(model.ce_loss, ref.at("ce_loss").data<float>()[0], 2e-6) << GetParam();
  EXPECT_NEAR(model.aux_loss, ref.at("aux_loss").data<float>()[0], 2e-6) << GetParam();
  EXPECT_NEAR(model.loss, ref.at("loss").data<float>()[0], 2e-6) << GetParam();

  // d loss / d every parameter, against PyTorch's autograd.
  const std::map<std::string, Tensor> grads = model.Backward();
  EXPECT_EQ(grads.size(), ParameterTable(model.config()).size());
  for (const TensorSpec& spec : ParameterTable(model.config())) {
    auto it = ref.find("grad." + spec.name);
    ASSERT_NE(it, ref.end()) << spec.name;
    ASSERT_EQ(grads.count(spec.name), 1u) << spec.name;
    const Tensor& g = grads.at(spec.name);
    ASSERT_EQ(g.numel(), it->second.numel()) << spec.name;
    for (int64_t i = 0; i < g.numel(); ++i) {
      const float w = it->second.data<float>()[i];
      ASSERT_NEAR(g.data<float>()[i], w, 1e-5 + 1e-3 * std::abs(w)) << spec.name << "[" << i << "]";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Families, HfReference,
                         ::testing::Values("mixtral", "qwen2_moe", "olmoe", "llama", "qwen2"),
                         [](const ::testing::TestParamInfo<const char*>& param_info) {
                           return std::string(param_info.param);
                         });

}  // namespace
}  // namespace switchyard::train::hf
