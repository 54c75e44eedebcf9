// One pre-norm transformer block of TransformerLm (train/model.h): its attention (GPT-2's fused
// tensor-parallel attention or the Hugging Face families' grouped-query attention, each with the
// softmax core or the context-parallel one), its FFN, and activation recomputation.
#include <cmath>
#include <utility>

#include "switchyard/train/model.h"
#include "train/parallel_for.h"

namespace switchyard::train {

// ---- Block ----

Block::Block(ParameterSet& params, const std::string& prefix, const ModelConfig& c,
             const std::function<std::unique_ptr<FeedForward>()>& make_ffn, uint64_t seed,
             const TensorParallelContext& tp, parallel::CommStats* tp_stats,
             const ContextParallelContext* cp)
    : recompute_(c.recompute),
      precision_(c.precision),
      norm1_(params, prefix + "norm1.", c.model_dim, c.norm, static_cast<float>(c.norm_eps)),
      cp_(cp != nullptr && (cp->group != nullptr || cp->flash) ? cp : nullptr),
      stats_(tp_stats) {
  SY_CHECK(tp.group != nullptr, "{}: a block needs its tensor-parallel group (one rank at tp 1)",
           prefix);
  // Registered in module order: norm1, attn, norm2, then the FFN.
  const float proj_std = c.init_std / std::sqrt(2.0f * static_cast<float>(c.num_layers));
  if (UsesGqaAttention(c)) {
    TpGqaOptions o;
    o.model_dim = c.model_dim;
    o.num_heads = c.num_heads;
    o.num_kv_heads = c.num_kv_heads;
    o.rope = c.position_embedding == PositionEmbedding::kRope;
    o.rope_theta = c.rope_theta;
    o.qkv_bias = c.attention_bias != AttentionBias::kNone;
    o.o_bias = c.attention_bias == AttentionBias::kAll;
    o.qk_norm = c.qk_norm;
    o.norm_eps = static_cast<float>(c.norm_eps);
    o.init_std = c.init_std;
    o.o_init_std = proj_std;
    o.seed = seed;
    gqa_ = std::make_unique<TensorParallelGqaAttention>(params, prefix + "attn.", o, *tp.group,
                                                        tp.options, tp_stats);
  } else {
    attn_ = std::make_unique<TensorParallelAttention>(params, prefix + "attn.", c.model_dim,
                                                      c.num_heads, c.init_std, proj_std, seed,
                                                      *tp.group, tp.options, tp_stats);
  }
  norm2_ = std::make_unique<Norm>(params, prefix + "norm2.", c.model_dim, c.norm,
                                  static_cast<float>(c.norm_eps));
  ffn_ = make_ffn();
  SY_CHECK(ffn_ != nullptr, "{}: no FFN", prefix);
}

ContextParallelAttention Block::Core(int64_t rows, int64_t batch_size) const {
  // rows: this rank's tokens of batch_size sequences (all of them on one rank).
  const int p = cp_->group != nullptr ? cp_->group->size() : 1;
  const int64_t seq = rows / batch_size * p;
  const int64_t heads = local_heads();
  ContextParallelOptions options = cp_->options;
  // One rank holds the sequence in order under either split; the plain one takes any length.
  if (p == 1 && seq % SequenceSplit::Multiple(options.split, 1) != 0) {
    options.split = SequenceSplitKind::kPlain;
  }
  if (cp_->group == nullptr) return ContextParallelAttention(heads, seq, options);
  return ContextParallelAttention(*cp_->group, heads, seq, options);
}

Tensor Block::ForwardAll(const Tensor& x, int64_t batch_size, const FeedForwardContext& context,
                         BlockCache* cache) const {
  bool save = context.save_for_backward;
  const int threads = context.threads;
  const bool bf16 = precision_ == Precision::kBFloat16;
  Tensor n1 = norm1_.Forward(x, save ? &cache->norm1 : nullptr, threads);
  if (save && bf16) cache->norm1.x = ToBFloat16(cache->norm1.x, threads);
  AttentionCache* ac = save ? &cache->attn : nullptr;
  Tensor h;
  if (gqa_ != nullptr) {
    h = GqaAttentionForward(n1, batch_size, context, save ? cache : nullptr);
  } else if (cp_ != nullptr) {
    // The projections on this rank's tokens (its heads, the tokens gathered over the tp group
    // with sequence parallelism), the core across the context-parallel group.
    ColumnParallelCache qc;
    const Tensor qkv = attn_->qkv().Forward(n1, &qc, threads, attn_->stats());
    const ContextParallelAttention core = Core(qkv.size(0), batch_size);
    ContextParallelCache scratch;  // the core fills one even when nothing is kept
    Tensor att = core.Forward(qkv, batch_size, save ? &cache->cp_attn : &scratch, threads, stats_);
    h = attn_->proj().Forward(att, nullptr, threads, attn_->stats());
    // The core keeps what it needs of qkv itself.
    if (save) *ac = AttentionCache{qc.x, Tensor(), Tensor(), att, batch_size};
  } else {
    h = attn_->Forward(n1, batch_size, threads, ac, precision_);
  }
  AddInPlaceParallel(h, x, threads);  // h = x + attn(norm1(x))
  Tensor n2 = norm2_->Forward(h, save ? &cache->norm2 : nullptr, threads);
  if (save && bf16) cache->norm2.x = ToBFloat16(cache->norm2.x, threads);
  cache->ffn = ffn_->Forward(n2, context);
  Tensor y = cache->ffn.y;
  cache->ffn.y = Tensor();            // the caller owns y; backward does not need it
  AddInPlaceParallel(y, h, threads);  // y = h + ffn(norm2(h))
  return y;
}

Tensor Block::BackwardAll(const BlockCache& cache, const Tensor& dy, float loss_scale,
                          int threads) const {
  Tensor dh =
      norm2_->Backward(cache.norm2, ffn_->Backward(cache.ffn, dy, loss_scale, threads), threads);
  AddInPlaceParallel(dh, dy, threads);
  Tensor da;
  if (gqa_ != nullptr) {
    da = GqaAttentionBackward(cache, dh, threads);
  } else if (cp_ != nullptr) {
    const AttentionCache& a = cache.attn;
    const ContextParallelAttention core = Core(a.att.size(0), a.batch_size);
    parallel::CommStats* tp_stats = attn_->stats();
    const Tensor datt = attn_->proj().Backward(RowParallelCache{a.att}, dh, threads, tp_stats);
    da = attn_->qkv().Backward(ColumnParallelCache{a.x},
                               core.Backward(cache.cp_attn, datt, threads, stats_), threads,
                               tp_stats);
  } else {
    da = attn_->Backward(cache.attn, dh, threads);
  }
  Tensor dx = norm1_.Backward(cache.norm1, da, threads);
  AddInPlaceParallel(dx, dh, threads);
  return dx;
}

// ---- Activation recomputation (Block) ----

Tensor Block::Forward(const Tensor& x, int64_t batch_size, const FeedForwardContext& context_in,
                      BlockCache* cache) const {
  SY_CHECK(cache != nullptr, "Block::Forward needs a cache");
  FeedForwardContext context = context_in;
  context.precision = precision_;
  if (!context.save_for_backward || recompute_ == Recompute::kNone) {
    return ForwardAll(x, batch_size, context, cache);
  }
  if (recompute_ == Recompute::kFull) {
    // Keep the input and the call's settings (step and token offset key the MoE routing draws,
    // so the forward in Backward routes the same way); nothing else.
    FeedForwardContext no_save = context;
    no_save.save_for_backward = false;
    BlockCache scratch;
    Tensor y = ForwardAll(x, batch_size, no_save, &scratch);
    cache->ffn = std::move(scratch.ffn);  // loss terms and routing statistics, no state
    cache->input = x;                     // blocks do not write their input
    cache->context = context;
    cache->batch_size = batch_size;
    return y;
  }
  Tensor y = ForwardAll(x, batch_size, context, cache);
  if (cp_ == nullptr) {  // selective: recomputed from qkv in Backward
    cache->attn.probs = Tensor();
    cache->attn.att = Tensor();
  }
  return y;
}

Tensor Block::GqaAttentionForward(const Tensor& n1, int64_t batch_size,
                                  const FeedForwardContext& context, BlockCache* cache) const {
  const int threads = context.threads;
  SY_CHECK(context.positions != nullptr, "attention: the model passes no positions");
  TpGqaCache scratch;
  Tensor qkv = gqa_->ProjectQkv(n1, *context.positions, cache != nullptr ? &cache->gqa : &scratch,
                                threads, precision_);
  const bool bf16 = precision_ == Precision::kBFloat16;
  Tensor att, probs;
  if (cp_ != nullptr) {
    const ContextParallelAttention core = Core(qkv.size(0), batch_size);
    ContextParallelCache cp_scratch;
    att = core.Forward(qkv, batch_size, cache != nullptr ? &cache->cp_attn : &cp_scratch, threads,
                       stats_);
    qkv = Tensor();  // the core keeps what it needs
  } else {
    if (bf16) qkv = ToBFloat16(qkv, threads);
    att = CausalAttentionForward(qkv, batch_size, local_heads(), threads,
                                 cache != nullptr ? &probs : nullptr);
  }
  if (bf16) att = ToBFloat16(att, threads);
  Tensor h = gqa_->o_proj().Forward(att, nullptr, threads, gqa_->stats());
  if (cache != nullptr) cache->attn = AttentionCache{Tensor(), qkv, probs, att, batch_size};
  return h;
}

Tensor Block::GqaAttentionBackward(const BlockCache& cache, const Tensor& dh, int threads) const {
  const AttentionCache& a = cache.attn;
  const Tensor datt = gqa_->o_proj().Backward(RowParallelCache{a.att}, dh, threads, gqa_->stats());
  Tensor dqkv;
  if (cp_ != nullptr) {
    dqkv = Core(a.att.size(0), a.batch_size).Backward(cache.cp_attn, datt, threads, stats_);
  } else {
    dqkv = CausalAttentionBackward(a.qkv, a.probs, datt, a.batch_size, local_heads(), threads);
  }
  return gqa_->ProjectQkvBackward(cache.gqa, dqkv, threads);
}

void Block::RecomputeAttentionCore(AttentionCache& a, int threads) const {
  Tensor att = CausalAttentionForward(a.qkv, a.batch_size, local_heads(), threads, &a.probs);
  a.att = a.qkv.dtype() == DType::kBFloat16 ? ToBFloat16(att, threads) : att;
}

Tensor Block::Backward(const BlockCache& cache, const Tensor& dy, float loss_scale,
                       int threads) const {
  if (cache.input.defined()) {  // full: the block's forward again, keeping everything
    BlockCache full;
    ForwardAll(cache.input, cache.batch_size, cache.context, &full);
    return BackwardAll(full, dy, loss_scale, threads);
  }
  if (recompute_ == Recompute::kSelective && cp_ == nullptr && !cache.attn.probs.defined()) {
    BlockCache with_core = cache;
    RecomputeAttentionCore(with_core.attn, threads);
    return BackwardAll(with_core, dy, loss_scale, threads);
  }
  return BackwardAll(cache, dy, loss_scale, threads);
}

void Block::SavedTensors(const BlockCache& c, std::vector<Tensor>* out) const {
  out->insert(out->end(),
              {c.norm1.x, c.norm1.mean, c.norm1.rstd, c.attn.x, c.attn.qkv, c.attn.probs,
               c.attn.att, c.cp_attn.qkv, c.cp_attn.out, c.cp_attn.lse, c.norm2.x, c.norm2.mean,
               c.norm2.rstd, c.input, c.gqa.x, c.gqa.q_pre, c.gqa.k_pre});
  ffn_->SavedTensors(c.ffn, out);
}

}  // namespace switchyard::train
