#include "switchyard/train/model.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>

#include "switchyard/comm/self.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/train/gated_shared_moe.h"
#include "switchyard/train/weight_grad.h"
#include "train/parallel_for.h"

namespace switchyard::train {

using kernels::Trans;

Recompute RecomputeFromName(std::string_view name) {
  if (name == "none") return Recompute::kNone;
  if (name == "full") return Recompute::kFull;
  if (name == "selective") return Recompute::kSelective;
  throw InvalidArgument(
      fmt::format("recompute: expected 'none', 'full' or 'selective', got '{}'", name));
}

std::string_view RecomputeName(Recompute recompute) {
  switch (recompute) {
    case Recompute::kNone: return "none";
    case Recompute::kFull: return "full";
    case Recompute::kSelective: return "selective";
  }
  return "none";
}

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
  const int64_t kv = c.num_kv_heads == 0 ? c.num_heads : c.num_kv_heads;
  SY_REQUIRE(kv > 0 && c.num_heads % kv == 0, InvalidArgument,
             "model config: 'num_kv_heads' {} must divide 'num_heads' {}", c.num_kv_heads,
             c.num_heads);
  SY_REQUIRE(c.norm_eps > 0 && std::isfinite(c.norm_eps), InvalidArgument,
             "model config: 'norm_eps' must be a positive number, got {}", c.norm_eps);
  SY_REQUIRE(c.rope_theta > 0 && std::isfinite(c.rope_theta), InvalidArgument,
             "model config: 'rope_theta' must be a positive number, got {}", c.rope_theta);
  SY_REQUIRE(
      c.position_embedding != PositionEmbedding::kRope || (c.model_dim / c.num_heads) % 2 == 0,
      InvalidArgument,
      "model config: 'position_embedding' rope needs an even head dimension (model_dim / "
      "num_heads), got {}",
      c.model_dim / c.num_heads);
  SY_REQUIRE(c.pad_token_id >= -1 && c.pad_token_id < c.vocab_size, InvalidArgument,
             "model config: 'pad_token_id' {} is not a token of the vocabulary [0, {}) (-1: none)",
             c.pad_token_id, c.vocab_size);
  SY_REQUIRE(c.mlp_bias || c.mlp == MlpKind::kSwiGlu, InvalidArgument,
             "model config: 'mlp_bias' false needs 'mlp' swiglu (the gelu MLP has biases)");
  for (const int64_t layer : c.mlp_only_layers) {
    SY_REQUIRE(layer >= 0 && layer < c.num_layers, InvalidArgument,
               "model config: 'mlp_only_layers' entry {} is not a block of 'num_layers' {}", layer,
               c.num_layers);
  }
  SY_REQUIRE(c.gated_shared_expert_hidden >= 0, InvalidArgument,
             "model config: 'gated_shared_expert_hidden' must be >= 0, got {}",
             c.gated_shared_expert_hidden);
}

bool UsesGqaAttention(const ModelConfig& c) {
  return c.position_embedding == PositionEmbedding::kRope ||
         (c.num_kv_heads != 0 && c.num_kv_heads != c.num_heads) ||
         c.attention_bias != AttentionBias::kAll || c.qk_norm;
}

double TrainingFlopsPerToken(const ModelConfig& c, int64_t num_experts, int64_t top_k,
                             int64_t expert_hidden_dim) {
  const double m = static_cast<double>(c.model_dim);
  const double kv_dim = c.num_kv_heads == 0 ? m
                                            : m / static_cast<double>(c.num_heads) *
                                                  static_cast<double>(c.num_kv_heads);
  const double mlp_matrices = c.mlp == MlpKind::kSwiGlu ? 3 : 2;
  double matrix = static_cast<double>(c.vocab_size) * m;  // output head
  for (int64_t i = 0; i < c.num_layers; ++i) {
    matrix += 2 * m * m + 2 * m * kv_dim;  // q, k, v, output projection
    if (IsMoeBlock(c, i) && num_experts > 0) {
      double h = static_cast<double>(expert_hidden_dim > 0 ? expert_hidden_dim : c.hidden_dim);
      matrix +=
          static_cast<double>(num_experts) * m + static_cast<double>(top_k) * mlp_matrices * m * h;
      // The gated shared expert: its SwiGLU and the [1, M] gate.
      matrix += (3 * static_cast<double>(c.gated_shared_expert_hidden) + 1) * m *
                (c.gated_shared_expert_hidden > 0 ? 1 : 0);
    } else {
      matrix += mlp_matrices * m * static_cast<double>(c.hidden_dim);
    }
  }
  double attention = 12.0 * static_cast<double>(c.num_layers) * static_cast<double>(c.seq_len) * m;
  return 6 * matrix + attention;
}

bool IsMoeBlock(const ModelConfig& c, int64_t i) {
  return c.moe_every > 0 && i % c.moe_every == c.moe_every - 1 &&
         std::find(c.mlp_only_layers.begin(), c.mlp_only_layers.end(), i) ==
             c.mlp_only_layers.end();
}

// ---- TransformerLm ----

struct ModelState {
  int chunk = 0;
  Tensor tokens;     // int32 [num_tokens] (padded with sequence parallelism, see Forward)
  Tensor positions;  // int32 [rows of this rank] positions of the rows x holds
  int64_t batch_size = 0;
  std::vector<BlockCache> blocks;  // the chunk's blocks, in order
  NormCache final_norm;
  Tensor h;        // [num_tokens, model_dim] final_norm output (gathered over tokens with SP)
  Tensor dlogits;  // [num_tokens, vocab_size / P] d(mean ce)/d(logits), this rank's columns
};

namespace {

// The global index (the one-rank order: sequence b, position t -> offset + b * seq + t) of each
// of `rows` rows from `row_begin` of a context-parallel rank's tokens [batch * local_len]. The
// MoE blocks route by it, so that drops, priorities and random draws are the one-rank run's.
// Rows a call without backward pads (positions >= seq, sequences >= real_batch) are numbered
// after every real token.
std::shared_ptr<const std::vector<int64_t>> ContextParallelTokenIndex(
    const SequenceSplit& split, int64_t offset, int64_t real_batch, int64_t seq, int64_t row_begin,
    int64_t rows) {
  auto index = std::make_shared<std::vector<int64_t>>(static_cast<size_t>(rows));
  const int64_t local = split.local_len(), padded = split.seq_len();
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t b = (row_begin + i) / local, t = split.Position((row_begin + i) % local);
    (*index)[static_cast<size_t>(i)] = b < real_batch && t < seq
                                           ? offset + b * seq + t
                                           : offset + real_batch * seq + b * padded + t;
  }
  return index;
}

ModelPartition CheckedPartition(ModelPartition partition, int64_t layers) {
  if (partition.chunks.empty()) partition.chunks.push_back({0, layers});
  std::vector<BlockRange> sorted = partition.chunks;
  std::sort(sorted.begin(), sorted.end(),
            [](const BlockRange& a, const BlockRange& b) { return a.begin < b.begin; });
  int64_t previous_end = 0;
  for (const BlockRange& r : sorted) {
    SY_REQUIRE(r.begin >= previous_end && r.begin < r.end && r.end <= layers, InvalidArgument,
               "model partition: block range [{}, {}) is empty, out of [0, {}) or overlaps "
               "another chunk",
               r.begin, r.end, layers);
    previous_end = r.end;
  }
  return partition;
}

// InvalidArgument unless `tokens` is int32 [batch_size >= 1, seq] with 1 <= seq <= seq_len and
// `targets` (when defined) int32 of the same shape.
void CheckChunkInputs(const Tensor& tokens, const Tensor& targets, int64_t seq_len) {
  SY_REQUIRE(
      tokens.defined() && tokens.dim() == 2 && tokens.size(1) >= 1 && tokens.size(1) <= seq_len,
      InvalidArgument, "tokens: expected int32 [batch_size, seq] with 1 <= seq <= {}, got {}",
      seq_len, tokens.defined() ? tokens.ToString() : "undefined");
  ExpectDType("tokens", tokens, DType::kInt32);
  SY_REQUIRE(tokens.size(0) >= 1, InvalidArgument, "tokens: batch_size must be >= 1, got {}",
             tokens.size(0));
  if (targets.defined()) {
    ExpectShape("targets", targets, {tokens.size(0), tokens.size(1)});
    ExpectDType("targets", targets, DType::kInt32);
  }
}

// Each sequence of `tokens` / `targets` [batch, seq] padded at its end to `seq_used` positions
// (token 0, target -1: ignored).
void PadSequences(int64_t seq_used, bool has_targets, Tensor* tokens, Tensor* targets) {
  const int64_t batch = tokens->size(0), seq = tokens->size(1);
  Tensor t = Tensor::Zeros({batch, seq_used}, DType::kInt32);
  Tensor g = Tensor::Empty({batch, seq_used}, DType::kInt32);
  std::fill_n(g.data<int32_t>(), g.numel(), -1);
  for (int64_t b = 0; b < batch; ++b) {
    std::copy_n(tokens->data<int32_t>() + b * seq, seq, t.data<int32_t>() + b * seq_used);
    if (has_targets) {
      std::copy_n(targets->data<int32_t>() + b * seq, seq, g.data<int32_t>() + b * seq_used);
    }
  }
  *tokens = t;
  if (has_targets) *targets = g;
}

// `tokens` / `targets` [rows, seq] padded with whole sequences to `batch` rows (token 0,
// target -1: ignored).
void PadBatch(int64_t batch, bool has_targets, Tensor* tokens, Tensor* targets) {
  const int64_t seq = tokens->size(1);
  Tensor t = Tensor::Zeros({batch, seq}, DType::kInt32);
  std::copy_n(tokens->data<int32_t>(), tokens->numel(), t.data<int32_t>());
  *tokens = t;
  if (has_targets) {
    Tensor g = Tensor::Empty({batch, seq}, DType::kInt32);
    std::fill_n(g.data<int32_t>(), g.numel(), -1);
    std::copy_n(targets->data<int32_t>(), targets->numel(), g.data<int32_t>());
    *targets = g;
  }
}

// The logits [batch * seq, vocab] of every position in sequence order from each context-parallel
// rank's `logits` [n, vocab] of its positions (sequences of `seq_used` positions, the padding
// after `seq` dropped). Collective over `group`.
Tensor UnshardLogits(comm::Communicator& group, SequenceSplitKind split, const Tensor& logits,
                     int64_t batch, int64_t seq, int64_t seq_used) {
  const int cps = group.size();
  const int64_t n = logits.size(0), vocab = logits.size(1);
  Tensor parts = Tensor::Empty({cps * n, vocab});
  group.AllGather(logits, parts).Wait();
  Tensor full = Tensor::Empty({batch * seq_used, vocab});
  for (int q = 0; q < cps; ++q) {
    SequenceSplit(split, seq_used, cps, q).Unshard(parts.Slice(q * n, (q + 1) * n), full, batch);
  }
  Tensor out = Tensor::Empty({batch * seq, vocab});
  for (int64_t b = 0; b < batch; ++b) {
    std::copy_n(full.data<float>() + b * seq_used * vocab, seq * vocab,
                out.data<float>() + b * seq * vocab);
  }
  return out;
}

// The position in its sequence of each of the n rows the blocks' attention sees (this rank's
// tokens, gathered over tp; a context-parallel rank's global positions), for RoPE; zeros for a
// grouped-query attention without RoPE; null for GPT-2's attention, which takes none.
std::shared_ptr<const std::vector<int64_t>> AttentionPositions(const ModelConfig& c,
                                                               const SequenceSplit* cp_split,
                                                               int64_t n, int64_t local_seq,
                                                               int64_t seq) {
  if (!UsesGqaAttention(c)) return nullptr;
  auto positions = std::make_shared<std::vector<int64_t>>(static_cast<size_t>(n), 0);
  if (c.position_embedding != PositionEmbedding::kRope) return positions;
  for (int64_t i = 0; i < n; ++i) {
    (*positions)[static_cast<size_t>(i)] =
        cp_split != nullptr ? cp_split->Position(i % local_seq) : i % seq;
  }
  return positions;
}

}  // namespace

TransformerLm::TransformerLm(ModelConfig config, uint64_t seed, FeedForwardFactory moe_factory,
                             TensorParallelContext tp, ModelPartition partition,
                             ContextParallelContext cp)
    : config_(std::move(config)), tp_(tp), cp_(cp) {
  const ModelConfig& c = config_;
  ValidateModelConfig(c);
  if (tp_.group == nullptr) {
    // tp 1: the same layers over a one-rank group (their pairs return their arguments).
    own_tp_group_ = comm::CreateSelfCommunicator("tp (one rank)");
    tp_.group = own_tp_group_.get();
  }
  if (tp_.group->size() == 1) tp_.options = {};  // nothing to shard or overlap
  if (context_parallel()) {
    core_ = cp_;
    SY_REQUIRE(cp_.options.algorithm != CpAlgorithm::kUlysses ||
                   c.num_heads % (static_cast<int64_t>(tp_size()) * cp_size()) == 0,
               InvalidArgument,
               "Ulysses attention splits each tensor-parallel rank's heads over the "
               "context-parallel ranks: num_heads {} does not divide by tp {} x cp {}",
               c.num_heads, tp_size(), cp_size());
  } else if (cp_.flash) {
    // The same core on this rank alone, without a group (ring attention: nothing travels).
    core_ = ContextParallelContext{
        nullptr, {CpAlgorithm::kRing, SequenceSplitKind::kZigzag, /*causal=*/true}, true};
  }
  SY_REQUIRE(c.precision == Precision::kFloat32 || !context_parallel(), InvalidArgument,
             "'precision' bf16 is not supported with context parallelism yet (cp {}): use "
             "'precision' fp32 there",
             cp_size());
  SY_REQUIRE(c.precision == Precision::kFloat32 || !tp_.options.comm_overlap, InvalidArgument,
             "'precision' bf16 with tp_comm_overlap (tp {}): the overlap rings run float32 "
             "GEMMs only; use 'precision' fp32 or turn tp_comm_overlap off",
             tp_size());
  SY_REQUIRE(c.recompute != Recompute::kSelective || !context_parallel(), InvalidArgument,
             "'recompute' selective with context parallelism (cp {}): the context-parallel "
             "attention core already recomputes its probabilities in backward; use 'recompute' "
             "none or full",
             context_parallel() ? cp_.group->size() : 1);
  partition_ = CheckedPartition(std::move(partition), c.num_layers);
  bool has_embedding = false, has_head = false;
  for (int i = 0; i < num_chunks(); ++i) {
    has_embedding |= chunk_has_embedding(i);
    has_head |= chunk_has_head(i);
  }
  if (has_embedding) {
    embed_ = std::make_unique<VocabParallelEmbedding>(params_, "embed.", c.vocab_size, c.model_dim,
                                                      c.init_std, seed, *tp_.group, tp_.options);
    if (c.position_embedding == PositionEmbedding::kLearned) {
      pos_embed_ = std::make_unique<Embedding>(params_, "pos_embed.", c.seq_len, c.model_dim,
                                               c.init_std * 0.5f, seed);
    }
  }
  float out_std = c.init_std / std::sqrt(2.0f * static_cast<float>(c.num_layers));
  blocks_.resize(static_cast<size_t>(c.num_layers));
  std::vector<bool> held(static_cast<size_t>(c.num_layers), false);
  for (const BlockRange& r : partition_.chunks) {
    for (int64_t i = r.begin; i < r.end; ++i) held[static_cast<size_t>(i)] = true;
  }
  for (int64_t i = 0; i < c.num_layers; ++i) {
    if (!held[static_cast<size_t>(i)]) continue;
    std::string prefix = fmt::format("blocks.{}.", i);
    auto make_ffn = [&]() -> std::unique_ptr<FeedForward> {
      if (!IsMoeBlock(c, i) && c.mlp == MlpKind::kSwiGlu) {
        return std::make_unique<TensorParallelSwiGlu>(params_, prefix + "mlp.", c.model_dim,
                                                      c.hidden_dim, c.mlp_bias, c.init_std, out_std,
                                                      seed, *tp_.group, tp_.options, &tp_stats_);
      }
      if (!IsMoeBlock(c, i)) {
        return std::make_unique<TensorParallelFeedForward>(
            params_, prefix + "mlp.", c.model_dim, c.hidden_dim, c.activation, c.init_std, out_std,
            seed, *tp_.group, tp_.options, &tp_stats_);
      }
      SY_REQUIRE(moe_factory != nullptr, InvalidArgument,
                 "block {} is an MoE block (moe_every {}) but no MoE FFN factory was given", i,
                 c.moe_every);
      auto ffn = moe_factory(i, prefix + "moe.", params_, seed);
      SY_CHECK(ffn != nullptr && ffn->is_moe(), "MoE factory returned no MoE FFN for block {}", i);
      if (c.gated_shared_expert_hidden == 0) return ffn;
      return std::make_unique<GatedSharedExpertMoe>(
          std::move(ffn), params_, prefix + "moe.", c.model_dim, c.gated_shared_expert_hidden,
          c.init_std, out_std, seed, *tp_.group, tp_.options, &tp_stats_);
    };
    blocks_[static_cast<size_t>(i)] =
        std::make_unique<Block>(params_, prefix, c, make_ffn, seed, tp_, &tp_stats_,
                                core_.group != nullptr || core_.flash ? &core_ : nullptr);
  }
  if (!has_head) return;
  final_norm_ = std::make_unique<Norm>(params_, "final_norm.", c.model_dim, c.norm,
                                       static_cast<float>(c.norm_eps));
  const TpShard rows{TpShard::Dim::kRows};
  // The head's weight, drawn as the single-rank tensor and cut to this rank's vocabulary rows
  // (one rank: the whole tensor, not marked as a shard).
  auto add_head = [&](const std::string& name, float std) -> Parameter& {
    Tensor w = Tensor::Empty({c.vocab_size, c.model_dim});
    InitNormal(w, std, seed, name);
    w = ShardOf(name, w, rows, tp_.group->rank(), tp_.group->size());
    Parameter& p = params_.Add(name, w, {.weight_decay = true});
    p.tp_shard = tp_size() > 1 ? rows : TpShard{};
    return p;
  };
  if (!c.tied_head) {
    head_ = &add_head("head.weight", c.init_std);
  } else if (has_embedding) {
    head_ = &embed_->weight();
  } else {
    head_ = &add_head("embed.weight", c.init_std);  // the embedding's initial value (Embedding)
    head_->tied_copy = true;
  }
}

TransformerLm::~TransformerLm() = default;

const BlockRange& TransformerLm::Chunk(int chunk) const {
  SY_REQUIRE(chunk >= 0 && chunk < num_chunks(), InvalidArgument,
             "model chunk {}: this rank holds chunks 0..{}", chunk, num_chunks() - 1);
  return partition_.chunks[static_cast<size_t>(chunk)];
}

bool TransformerLm::chunk_has_embedding(int chunk) const { return Chunk(chunk).begin == 0; }
bool TransformerLm::chunk_has_head(int chunk) const {
  return Chunk(chunk).end == config_.num_layers;
}

int64_t TransformerLm::num_moe_blocks() const {
  int64_t n = 0;
  for (const auto& b : blocks_) n += b != nullptr && b->ffn().is_moe() ? 1 : 0;
  return n;
}

std::vector<int64_t> TransformerLm::experts_per_moe_block() const {
  std::vector<int64_t> out;
  for (const auto& b : blocks_) {
    if (b != nullptr && b->ffn().is_moe()) out.push_back(b->ffn().num_experts());
  }
  return out;
}

parallel::CommStats TransformerLm::TakeTensorParallelStats() {
  return std::exchange(tp_stats_, parallel::CommStats{});
}

Tensor TransformerLm::Logits(const Tensor& h_full, int threads) const {
  const int64_t n = h_full.size(0), d = config_.model_dim, lv = head_->value.size(0);
  Tensor logits = Tensor::Empty({n, lv});
  if (config_.precision == Precision::kBFloat16) {
    Tensor hb = ToBFloat16(h_full, threads), wb = ToBFloat16(head_->value, threads);
    ParallelGemmBFloat16(Trans::kNo, Trans::kYes, n, lv, d, 1.0f, hb.data<BFloat16>(), d,
                         wb.data<BFloat16>(), d, 0.0f, logits.data<float>(), lv, threads);
    return logits;
  }
  ParallelGemm(Trans::kNo, Trans::kYes, n, lv, d, 1.0f, h_full.data<float>(), d,
               head_->value.data<float>(), d, 0.0f, logits.data<float>(), lv, threads);
  return logits;
}

LmOutput TransformerLm::Forward(const Tensor& tokens, const Tensor& targets,
                                const ForwardOptions& options, bool keep_logits) {
  SY_REQUIRE(num_chunks() == 1 && chunk_has_embedding(0) && chunk_has_head(0), InvalidArgument,
             "Forward runs the whole model; this rank holds {} chunk(s) of it (use ForwardChunk)",
             num_chunks());
  return ForwardChunk(0, tokens, targets, Tensor(), options, keep_logits);
}

void TransformerLm::Backward(const LmOutput& forward, float loss_scale, int threads) {
  BackwardChunk(forward, Tensor(), loss_scale, threads);
}

int64_t TransformerLm::ActivationRows(const Tensor& tokens) const {
  SY_REQUIRE(tokens.defined() && tokens.dim() == 2, InvalidArgument,
             "tokens: expected [batch_size, seq], got {}",
             tokens.defined() ? tokens.ToString() : "undefined");
  const int64_t p = tp_size();
  int64_t batch = tokens.size(0), seq = tokens.size(1);
  if (context_parallel()) {  // this rank's positions of the (padded) sequence, as Forward
    const int64_t multiple = SequenceSplit::Multiple(cp_.options.split, cp_size());
    seq = (seq + multiple - 1) / multiple * multiple / cp_size();
  }
  if (!tp_.options.sequence_parallel) return batch * seq;
  while ((batch * seq) % p != 0) ++batch;
  return batch * seq / p;
}

LmOutput TransformerLm::ForwardChunk(int chunk, const Tensor& tokens_in, const Tensor& targets_in,
                                     const Tensor& x_in, const ForwardOptions& options,
                                     bool keep_logits) {
  const ModelConfig& c = config_;
  const BlockRange range = Chunk(chunk);
  const bool first = chunk_has_embedding(chunk), last = chunk_has_head(chunk);
  const bool has_targets = last && targets_in.defined();
  CheckChunkInputs(tokens_in, has_targets ? targets_in : Tensor(), c.seq_len);
  const int64_t real_batch = tokens_in.size(0), seq = tokens_in.size(1);
  SY_REQUIRE(!options.save_for_backward || !last || has_targets, InvalidArgument,
             "Forward: save_for_backward needs targets");
  const bool sp = tp_.options.sequence_parallel;  // false at tp 1
  const int64_t p = tp_size();
  Tensor tokens = tokens_in, targets = targets_in;
  int64_t batch = real_batch;
  // Context parallelism: each sequence padded at its end to what the split accepts (calls
  // without backward; causal attention leaves the real tokens unchanged).
  int64_t seq_used = seq;
  if (context_parallel()) {
    const int64_t multiple = SequenceSplit::Multiple(cp_.options.split, cp_size());
    if (seq % multiple != 0) {
      SY_REQUIRE(!options.save_for_backward, InvalidArgument,
                 "context parallelism: sequences of {} tokens do not split over {} ranks (a "
                 "multiple of {} is needed): choose seq_len accordingly",
                 seq, cp_size(), multiple);
      seq_used = (seq + multiple - 1) / multiple * multiple;
      PadSequences(seq_used, has_targets, &tokens, &targets);
    }
  }
  // Sequence parallelism splits the tokens this rank's tp group holds (with context parallelism
  // its cp rank's share of every sequence) evenly over the group: a training call must bring a
  // multiple of P; other calls get ignored padding sequences (token 0, target -1).
  const int64_t local_seq = seq_used / cp_size();
  if (sp && (batch * local_seq) % p != 0) {
    SY_REQUIRE(!options.save_for_backward, InvalidArgument,
               "sequence parallelism: the batch's {} sequences x {} tokens{} = {} tokens do not "
               "divide by the tensor-parallel size {}: choose batch_size and seq_len so that each "
               "data-parallel rank's tokens do",
               real_batch, seq,
               context_parallel() ? fmt::format(" / cp {}", cp_size()) : std::string(),
               real_batch * local_seq, p);
    while ((batch * local_seq) % p != 0) ++batch;
    PadBatch(batch, has_targets, &tokens, &targets);
  }
  // Context parallelism: this rank's positions of every sequence.
  std::optional<SequenceSplit> cp_split;
  if (context_parallel()) {
    cp_split.emplace(cp_.options.split, seq_used, cp_size(), cp_.group->rank());
    tokens = cp_split->Shard(tokens.Reshape({batch * seq_used}), batch);
    if (has_targets) targets = cp_split->Shard(targets.Reshape({batch * seq_used}), batch);
  }
  const int64_t n = cp_split ? batch * cp_split->local_len() : batch * seq;
  // The rows this rank's residual stream holds: all n, or its n / P with sequence parallelism.
  const int64_t row_begin = sp ? tp_.group->rank() * (n / p) : 0;
  const int64_t rows = sp ? n / p : n;

  auto state = std::make_shared<ModelState>();
  state->chunk = chunk;
  state->tokens = tokens.Reshape({n});
  state->batch_size = batch;
  Tensor x;
  if (first) {
    state->positions = Tensor::Empty({rows}, DType::kInt32);
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t position =
          cp_split ? cp_split->Position((row_begin + i) % local_seq) : (row_begin + i) % seq;
      state->positions.data<int32_t>()[i] = static_cast<int32_t>(position);
    }
    x = embed_->Forward(state->tokens, &tp_stats_);
    if (pos_embed_ != nullptr) {
      AddInPlaceParallel(x, pos_embed_->Forward(state->positions), options.threads);
    }
  } else {
    ExpectShape("chunk input activation", x_in, {rows, c.model_dim});
    ExpectDType("chunk input activation", x_in, DType::kFloat32);
    x = x_in;  // blocks do not write their input
  }

  FeedForwardContext ctx;
  ctx.global_token_offset = options.global_token_offset + row_begin;
  if (cp_split) {
    ctx.token_index = ContextParallelTokenIndex(*cp_split, options.global_token_offset, real_batch,
                                                seq, row_begin, rows);
  }
  ctx.positions = AttentionPositions(c, cp_split ? &*cp_split : nullptr, n, local_seq, seq);
  ctx.step = options.step;
  ctx.training = options.training;
  ctx.save_for_backward = options.save_for_backward;
  ctx.threads = options.threads;
  ctx.concat_totals = options.concat_totals;

  LmOutput out;
  state->blocks.resize(static_cast<size_t>(range.end - range.begin));
  int64_t moe_blocks = 0;
  double ffn_loss = 0;
  for (int64_t i = range.begin; i < range.end; ++i) {
    BlockCache& cache = state->blocks[static_cast<size_t>(i - range.begin)];
    const Block& block = *blocks_[static_cast<size_t>(i)];
    if (observer_ != nullptr) observer_->BeforeBlock(i, /*backward=*/false);
    x = block.Forward(x, batch, ctx, &cache);
    if (observer_ != nullptr) observer_->AfterBlock(i, /*backward=*/false);
    ffn_loss += cache.ffn.loss;
    if (block.ffn().is_moe()) {
      ++moe_blocks;
      out.aux_loss += cache.ffn.aux_loss;
      out.z_loss += cache.ffn.z_loss;
      out.routing.push_back(cache.ffn.routing);
      out.routing_blocks.push_back(i);
    }
  }
  if (moe_blocks > 0) {
    out.aux_loss /= static_cast<double>(moe_blocks);
    out.z_loss /= static_cast<double>(moe_blocks);
  }
  out.loss = ffn_loss;
  if (!last) {
    out.activation = x;
    if (options.save_for_backward) out.state = state;
    return out;
  }
  Tensor h = final_norm_->Forward(x, options.save_for_backward ? &state->final_norm : nullptr,
                                  options.threads);
  // The head is column-parallel over the vocabulary: h enters the tensor-parallel region.
  h = EnterTensorParallel(*tp_.group, tp_.options, h, &tp_stats_);
  Tensor logits = Logits(h, options.threads);  // this rank's vocabulary columns
  if (has_targets) {
    Tensor* dlogits = options.save_for_backward ? &state->dlogits : nullptr;
    const CrossEntropyResult ce =
        VocabParallelLoss(*tp_.group, logits, targets.Reshape({n}), c.vocab_size, dlogits, 1.0f,
                          options.threads, &tp_stats_);
    out.ce_loss = ce.loss;
    out.count = ce.count;
  }
  out.loss = out.ce_loss + ffn_loss;
  if (keep_logits || !has_targets) {
    logits = GatherColumns(*tp_.group, logits, &tp_stats_);
    if (cp_split)
      logits = UnshardLogits(*cp_.group, cp_.options.split, logits, batch, seq, seq_used);
    out.logits = batch == real_batch ? logits : logits.Slice(0, real_batch * seq);
  }
  if (options.save_for_backward) {
    state->h = h;
    if (c.precision == Precision::kBFloat16) {  // the head's GEMM operands, kept as bfloat16
      state->h = ToBFloat16(h, options.threads);
      state->dlogits = ToBFloat16(state->dlogits, options.threads);
    }
    out.state = state;
  }
  return out;
}

int64_t TransformerLm::SavedActivationBytes(const LmOutput& forward) const {
  if (forward.state == nullptr) return 0;
  const ModelState& s = *forward.state;
  std::vector<Tensor> kept{s.final_norm.x, s.final_norm.mean, s.final_norm.rstd, s.h, s.dlogits};
  const BlockRange range = Chunk(s.chunk);
  for (int64_t i = range.begin; i < range.end; ++i) {
    blocks_[static_cast<size_t>(i)]->SavedTensors(s.blocks[static_cast<size_t>(i - range.begin)],
                                                  &kept);
  }
  // Each storage once (a tensor may be kept by two caches, e.g. the last block's output).
  std::vector<const void*> seen;
  int64_t bytes = 0;
  for (const Tensor& t : kept) {
    if (!t.defined() || t.numel() == 0) continue;
    if (std::find(seen.begin(), seen.end(), t.raw()) != seen.end()) continue;
    seen.push_back(t.raw());
    bytes += static_cast<int64_t>(t.nbytes());
  }
  return bytes;
}

FeedForwardTimes TransformerLm::TakeMoeTimes() {
  FeedForwardTimes t;
  for (auto& b : blocks_) {
    if (b != nullptr && b->ffn().is_moe()) t += b->ffn().TakeTimes();
  }
  return t;
}

void TransformerLm::EndStep(const std::vector<std::vector<int64_t>>& global_expert_loads) {
  int64_t total = 0;
  for (int64_t i = 0; i < config_.num_layers; ++i) total += IsMoeBlock(config_, i) ? 1 : 0;
  SY_REQUIRE(static_cast<int64_t>(global_expert_loads.size()) == total, InvalidArgument,
             "EndStep: expected loads of {} MoE blocks, got {}", total, global_expert_loads.size());
  size_t k = 0;
  for (int64_t i = 0; i < config_.num_layers; ++i) {
    if (!IsMoeBlock(config_, i)) continue;
    const auto& b = blocks_[static_cast<size_t>(i)];
    if (b != nullptr) b->ffn().EndStep(global_expert_loads[k]);
    ++k;
  }
}

void TransformerLm::SetRouterTrace(RouterTrace* trace) {
  for (int64_t i = 0; i < config_.num_layers; ++i) {
    const auto& b = blocks_[static_cast<size_t>(i)];
    if (IsMoeBlock(config_, i) && b != nullptr) b->ffn().SetRouterTrace(trace);
  }
}

Tensor TransformerLm::BackwardChunk(const LmOutput& forward, const Tensor& dy, float loss_scale,
                                    int threads) {
  SY_REQUIRE(forward.state != nullptr, InvalidArgument,
             "Backward: the forward pass was run without save_for_backward");
  const ModelState& s = *forward.state;
  const ModelConfig& c = config_;
  const BlockRange range = Chunk(s.chunk);
  Tensor dx;
  if (chunk_has_head(s.chunk)) {
    const int64_t n = s.tokens.numel(), lv = head_->value.size(0);
    const bool bf16 = s.dlogits.dtype() == DType::kBFloat16;
    Tensor dlogits = ToFloat32(s.dlogits, threads);
    if (loss_scale != 1.0f) {
      dlogits = bf16 ? dlogits : dlogits.Clone();
      float* d = dlogits.data<float>();
      for (int64_t i = 0; i < dlogits.numel(); ++i) d[i] *= loss_scale;
    }
    // The head over this rank's vocabulary columns: dh is a partial sum over the group.
    Tensor dh = Tensor::Empty({n, c.model_dim});
    // The head's weight gradient is a zero-bubble W when deferred (train/weight_grad.h); dlogits
    // and h are not written after this, so the work shares them.
    if (bf16) {
      Tensor db = ToBFloat16(dlogits, threads), wb = ToBFloat16(head_->value, threads);
      ParallelGemmBFloat16(Trans::kNo, Trans::kNo, n, c.model_dim, lv, 1.0f, db.data<BFloat16>(),
                           lv, wb.data<BFloat16>(), c.model_dim, 0.0f, dh.data<float>(),
                           c.model_dim, threads);
      RunOrDeferWeightGrad([head = head_, lv, n, d = c.model_dim, threads, db, h = s.h] {
        ParallelGemmBFloat16(Trans::kYes, Trans::kNo, lv, d, n, 1.0f, db.data<BFloat16>(), lv,
                             h.data<BFloat16>(), d, 1.0f, head->grad.data<float>(), d, threads);
      });
    } else {
      ParallelGemm(Trans::kNo, Trans::kNo, n, c.model_dim, lv, 1.0f, dlogits.data<float>(), lv,
                   head_->value.data<float>(), c.model_dim, 0.0f, dh.data<float>(), c.model_dim,
                   threads);
      RunOrDeferWeightGrad([head = head_, lv, n, d = c.model_dim, threads, dlogits, h = s.h] {
        ParallelGemm(Trans::kYes, Trans::kNo, lv, d, n, 1.0f, dlogits.data<float>(), lv,
                     h.data<float>(), d, 1.0f, head->grad.data<float>(), d, threads);
      });
    }
    dh = EnterTensorParallelBackward(*tp_.group, tp_.options, dh, &tp_stats_);
    dx = final_norm_->Backward(s.final_norm, dh, threads);
  } else {
    SY_REQUIRE(dy.defined(), InvalidArgument,
               "BackwardChunk: chunk {} ends before the head and needs its output's gradient",
               s.chunk);
    dx = dy;  // blocks do not write the gradient they are given
  }
  for (int64_t i = range.end; i-- > range.begin;) {
    if (observer_ != nullptr) observer_->BeforeBlock(i, /*backward=*/true);
    dx = blocks_[static_cast<size_t>(i)]->Backward(s.blocks[static_cast<size_t>(i - range.begin)],
                                                   dx, loss_scale, threads);
    if (observer_ != nullptr) observer_->AfterBlock(i, /*backward=*/true);
  }
  if (!chunk_has_embedding(s.chunk)) return dx;
  embed_->Backward(s.tokens, dx, &tp_stats_, c.pad_token_id);
  if (pos_embed_ != nullptr) pos_embed_->Backward(s.positions, dx);
  return Tensor();
}

}  // namespace switchyard::train
