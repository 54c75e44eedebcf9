#include "switchyard/train/model.h"

#include <cmath>

#include "switchyard/kernels/gemm.h"
#include "train/parallel_for.h"

namespace switchyard::train {

using kernels::Trans;

void ValidateModelConfig(const ModelConfig& c) {
  auto positive = [](const char* name, int64_t v) {
    SY_REQUIRE(v > 0, InvalidArgument, "model config: '{}' must be >= 1, got {}", name, v);
  };
  positive("vocab_size", c.vocab_size);
  positive("seq_len", c.seq_len);
  positive("model_dim", c.model_dim);
  positive("num_layers", c.num_layers);
  positive("num_heads", c.num_heads);
  positive("hidden_dim", c.hidden_dim);
  SY_REQUIRE(c.model_dim % c.num_heads == 0, InvalidArgument,
             "model config: num_heads {} must divide model_dim {}", c.num_heads, c.model_dim);
  SY_REQUIRE(c.vocab_size <= (int64_t{1} << 31) - 1, InvalidArgument,
             "model config: vocab_size {} does not fit int32 token ids", c.vocab_size);
  SY_REQUIRE(c.moe_every >= 0, InvalidArgument, "model config: 'moe_every' must be >= 0, got {}",
             c.moe_every);
  SY_REQUIRE(c.init_std > 0 && std::isfinite(c.init_std), InvalidArgument,
             "model config: 'init_std' must be a positive number, got {}", c.init_std);
}

double TrainingFlopsPerToken(const ModelConfig& c, int64_t num_experts, int64_t top_k,
                             int64_t expert_hidden_dim) {
  const double m = static_cast<double>(c.model_dim);
  double matrix = static_cast<double>(c.vocab_size) * m;  // output head
  for (int64_t i = 0; i < c.num_layers; ++i) {
    matrix += 4 * m * m;  // qkv + proj
    if (IsMoeBlock(c, i) && num_experts > 0) {
      double h = static_cast<double>(expert_hidden_dim > 0 ? expert_hidden_dim : c.hidden_dim);
      matrix += static_cast<double>(num_experts) * m + static_cast<double>(top_k) * 2 * m * h;
    } else {
      matrix += 2 * m * static_cast<double>(c.hidden_dim);
    }
  }
  double attention = 12.0 * static_cast<double>(c.num_layers) * static_cast<double>(c.seq_len) * m;
  return 6 * matrix + attention;
}

bool IsMoeBlock(const ModelConfig& c, int64_t i) {
  return c.moe_every > 0 && i % c.moe_every == c.moe_every - 1;
}

// ---- Block ----

Block::Block(ParameterSet& params, const std::string& prefix, const ModelConfig& c,
             const std::function<std::unique_ptr<FeedForward>()>& make_ffn, uint64_t seed)
    : norm1_(params, prefix + "norm1.", c.model_dim, c.norm),
      attn_(params, prefix + "attn.", c.model_dim, c.num_heads, c.init_std,
            c.init_std / std::sqrt(2.0f * static_cast<float>(c.num_layers)), seed),
      norm2_(params, prefix + "norm2.", c.model_dim, c.norm),
      ffn_(make_ffn()) {
  SY_CHECK(ffn_ != nullptr, "{}: no FFN", prefix);
}

namespace {

void AddInPlace(const Tensor& acc, const Tensor& x, int threads) {
  float* a = acc.data<float>();
  const float* b = x.data<float>();
  ParallelFor(acc.numel(), threads, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) a[i] += b[i];
  });
}

}  // namespace

Tensor Block::Forward(const Tensor& x, int64_t batch_size, const FeedForwardContext& context,
                      BlockCache* cache) const {
  SY_CHECK(cache != nullptr, "Block::Forward needs a cache");
  bool save = context.save_for_backward;
  const int threads = context.threads;
  Tensor h = attn_.Forward(norm1_.Forward(x, save ? &cache->norm1 : nullptr, threads), batch_size,
                           context.threads, save ? &cache->attn : nullptr);
  AddInPlace(h, x, threads);  // h = x + attn(norm1(x))
  cache->ffn = ffn_->Forward(norm2_.Forward(h, save ? &cache->norm2 : nullptr, threads), context);
  Tensor y = cache->ffn.y;
  cache->ffn.y = Tensor();    // the caller owns y; backward does not need it
  AddInPlace(y, h, threads);  // y = h + ffn(norm2(h))
  return y;
}

Tensor Block::Backward(const BlockCache& cache, const Tensor& dy, float loss_scale,
                       int threads) const {
  Tensor dh =
      norm2_.Backward(cache.norm2, ffn_->Backward(cache.ffn, dy, loss_scale, threads), threads);
  AddInPlace(dh, dy, threads);
  Tensor dx = norm1_.Backward(cache.norm1, attn_.Backward(cache.attn, dh, threads), threads);
  AddInPlace(dx, dh, threads);
  return dx;
}

// ---- TransformerLm ----

struct ModelState {
  Tensor tokens;     // int32 [num_tokens]
  Tensor positions;  // int32 [num_tokens]
  int64_t batch_size = 0;
  std::vector<BlockCache> blocks;
  NormCache final_norm;
  Tensor h;        // [num_tokens, model_dim] final_norm output
  Tensor dlogits;  // [num_tokens, vocab_size] d(mean ce)/d(logits)
};

TransformerLm::TransformerLm(ModelConfig config, uint64_t seed, FeedForwardFactory moe_factory)
    : config_(std::move(config)) {
  const ModelConfig& c = config_;
  ValidateModelConfig(c);
  embed_ =
      std::make_unique<Embedding>(params_, "embed.", c.vocab_size, c.model_dim, c.init_std, seed);
  pos_embed_ = std::make_unique<Embedding>(params_, "pos_embed.", c.seq_len, c.model_dim,
                                           c.init_std * 0.5f, seed);
  float out_std = c.init_std / std::sqrt(2.0f * static_cast<float>(c.num_layers));
  for (int64_t i = 0; i < c.num_layers; ++i) {
    std::string prefix = fmt::format("blocks.{}.", i);
    auto make_ffn = [&]() -> std::unique_ptr<FeedForward> {
      if (!IsMoeBlock(c, i)) {
        return std::make_unique<DenseFeedForward>(params_, prefix + "mlp.", c.model_dim,
                                                  c.hidden_dim, c.activation, c.init_std, out_std,
                                                  seed);
      }
      SY_REQUIRE(moe_factory != nullptr, InvalidArgument,
                 "block {} is an MoE block (moe_every {}) but no MoE FFN factory was given", i,
                 c.moe_every);
      auto ffn = moe_factory(i, prefix + "moe.", params_, seed);
      SY_CHECK(ffn != nullptr && ffn->is_moe(), "MoE factory returned no MoE FFN for block {}", i);
      return ffn;
    };
    blocks_.push_back(std::make_unique<Block>(params_, prefix, c, make_ffn, seed));
  }
  final_norm_ = std::make_unique<Norm>(params_, "final_norm.", c.model_dim, c.norm);
  if (c.tied_head) {
    head_ = &embed_->weight();
  } else {
    Tensor w = Tensor::Empty({c.vocab_size, c.model_dim});
    InitNormal(w, c.init_std, seed, "head.weight");
    head_ = &params_.Add("head.weight", w, {.weight_decay = true});
  }
}

TransformerLm::~TransformerLm() = default;

int64_t TransformerLm::num_moe_blocks() const {
  int64_t n = 0;
  for (const auto& b : blocks_) n += b->ffn().is_moe() ? 1 : 0;
  return n;
}

std::vector<int64_t> TransformerLm::experts_per_moe_block() const {
  std::vector<int64_t> out;
  for (const auto& b : blocks_) {
    if (b->ffn().is_moe()) out.push_back(b->ffn().num_experts());
  }
  return out;
}

LmOutput TransformerLm::Forward(const Tensor& tokens, const Tensor& targets,
                                const ForwardOptions& options, bool keep_logits) {
  const ModelConfig& c = config_;
  SY_REQUIRE(
      tokens.defined() && tokens.dim() == 2 && tokens.size(1) >= 1 && tokens.size(1) <= c.seq_len,
      InvalidArgument, "tokens: expected int32 [batch_size, seq] with 1 <= seq <= {}, got {}",
      c.seq_len, tokens.defined() ? tokens.ToString() : "undefined");
  ExpectDType("tokens", tokens, DType::kInt32);
  const int64_t batch = tokens.size(0), seq = tokens.size(1), n = batch * seq;
  SY_REQUIRE(batch >= 1, InvalidArgument, "tokens: batch_size must be >= 1, got {}", batch);
  bool has_targets = targets.defined();
  if (has_targets) {
    ExpectShape("targets", targets, {batch, seq});
    ExpectDType("targets", targets, DType::kInt32);
  }
  SY_REQUIRE(!options.save_for_backward || has_targets, InvalidArgument,
             "Forward: save_for_backward needs targets");

  auto state = std::make_shared<ModelState>();
  state->tokens = tokens.Reshape({n});
  state->positions = Tensor::Empty({n}, DType::kInt32);
  for (int64_t i = 0; i < n; ++i)
    state->positions.data<int32_t>()[i] = static_cast<int32_t>(i % seq);
  state->batch_size = batch;

  Tensor x = embed_->Forward(state->tokens);
  AddInPlace(x, pos_embed_->Forward(state->positions), options.threads);

  FeedForwardContext ctx;
  ctx.global_token_offset = options.global_token_offset;
  ctx.step = options.step;
  ctx.training = options.training;
  ctx.save_for_backward = options.save_for_backward;
  ctx.threads = options.threads;

  LmOutput out;
  state->blocks.resize(blocks_.size());
  int64_t moe_blocks = 0;
  double ffn_loss = 0;
  for (size_t i = 0; i < blocks_.size(); ++i) {
    BlockCache& cache = state->blocks[i];
    x = blocks_[i]->Forward(x, batch, ctx, &cache);
    ffn_loss += cache.ffn.loss;
    if (blocks_[i]->ffn().is_moe()) {
      ++moe_blocks;
      out.aux_loss += cache.ffn.aux_loss;
      out.z_loss += cache.ffn.z_loss;
      out.routing.push_back(cache.ffn.routing);
    }
  }
  if (moe_blocks > 0) {
    out.aux_loss /= static_cast<double>(moe_blocks);
    out.z_loss /= static_cast<double>(moe_blocks);
  }
  Tensor h = final_norm_->Forward(x, options.save_for_backward ? &state->final_norm : nullptr,
                                  options.threads);
  Tensor logits = Tensor::Empty({n, c.vocab_size});
  ParallelGemm(Trans::kNo, Trans::kYes, n, c.vocab_size, c.model_dim, 1.0f, h.data<float>(),
               c.model_dim, head_->value.data<float>(), c.model_dim, 0.0f, logits.data<float>(),
               c.vocab_size, options.threads);
  if (has_targets) {
    CrossEntropyResult ce = SoftmaxCrossEntropy(
        logits, targets.Reshape({n}), options.save_for_backward ? &state->dlogits : nullptr, 1.0f,
        options.threads);
    out.ce_loss = ce.loss;
    out.count = ce.count;
  }
  out.loss = out.ce_loss + ffn_loss;
  if (keep_logits || !has_targets) out.logits = logits;
  if (options.save_for_backward) {
    state->h = h;
    out.state = state;
  }
  return out;
}

FeedForwardTimes TransformerLm::TakeMoeTimes() {
  FeedForwardTimes t;
  for (auto& b : blocks_) {
    if (b->ffn().is_moe()) t += b->ffn().TakeTimes();
  }
  return t;
}

void TransformerLm::EndStep(const std::vector<std::vector<int64_t>>& global_expert_loads) {
  SY_REQUIRE(static_cast<int64_t>(global_expert_loads.size()) == num_moe_blocks(), InvalidArgument,
             "EndStep: expected loads of {} MoE blocks, got {}", num_moe_blocks(),
             global_expert_loads.size());
  size_t i = 0;
  for (const auto& b : blocks_) {
    if (b->ffn().is_moe()) b->ffn().EndStep(global_expert_loads[i++]);
  }
}

void TransformerLm::Backward(const LmOutput& forward, float loss_scale, int threads) {
  SY_REQUIRE(forward.state != nullptr, InvalidArgument,
             "Backward: the forward pass was run without save_for_backward");
  const ModelState& s = *forward.state;
  const ModelConfig& c = config_;
  const int64_t n = s.tokens.numel();
  Tensor dlogits = s.dlogits;
  if (loss_scale != 1.0f) {
    dlogits = dlogits.Clone();
    float* d = dlogits.data<float>();
    for (int64_t i = 0; i < dlogits.numel(); ++i) d[i] *= loss_scale;
  }
  Tensor dh = Tensor::Empty({n, c.model_dim});
  ParallelGemm(Trans::kNo, Trans::kNo, n, c.model_dim, c.vocab_size, 1.0f, dlogits.data<float>(),
               c.vocab_size, head_->value.data<float>(), c.model_dim, 0.0f, dh.data<float>(),
               c.model_dim, threads);
  ParallelGemm(Trans::kYes, Trans::kNo, c.vocab_size, c.model_dim, n, 1.0f, dlogits.data<float>(),
               c.vocab_size, s.h.data<float>(), c.model_dim, 1.0f, head_->grad.data<float>(),
               c.model_dim, threads);
  Tensor dx = final_norm_->Backward(s.final_norm, dh, threads);
  for (size_t i = blocks_.size(); i-- > 0;) {
    dx = blocks_[i]->Backward(s.blocks[i], dx, loss_scale, threads);
  }
  embed_->Backward(s.tokens, dx);
  pos_embed_->Backward(s.positions, dx);
}

}  // namespace switchyard::train
