// A decoder-only transformer language model (GPT-2 layout, pre-norm):
//   x = embed(tokens) + pos_embed(positions)
//   for each block: x = x + attn(norm1(x)); x = x + ffn(norm2(x))
//   logits = final_norm(x) · head^T   (head = embed.weight when tied)
//   loss = mean cross-entropy(logits, targets) + sum over blocks of the FFN's auxiliary loss
// The FFN of block i is an MoE layer when IsMoeBlock(config, i) (GShard: every other block) and
// the dense MLP otherwise. MoE FFNs come from a FeedForwardFactory (feed_forward.h).
//
// Parameter names (PyTorch-style): "embed.weight" [vocab_size, model_dim],
// "pos_embed.weight" [seq_len, model_dim], "blocks.{i}.norm1.{weight,bias}",
// "blocks.{i}.attn.qkv.{weight,bias}", "blocks.{i}.attn.proj.{weight,bias}",
// "blocks.{i}.norm2.{weight,bias}", "blocks.{i}.mlp.fc{1,2}.{weight,bias}" or
// "blocks.{i}.moe.*", "final_norm.{weight,bias}", "head.weight" [vocab_size, model_dim]
// (untied only). RMSNorm has no bias.
//
// Thread-safety: Forward may run concurrently; Backward accumulates into the shared gradients.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "switchyard/core/tensor.h"
#include "switchyard/kernels/ops.h"
#include "switchyard/train/context_parallel.h"
#include "switchyard/train/feed_forward.h"
#include "switchyard/train/layers.h"
#include "switchyard/train/model_arch.h"
#include "switchyard/train/parameters.h"
#include "switchyard/train/tensor_parallel.h"
#include "switchyard/train/tensor_parallel_gqa.h"

namespace switchyard::train {

// Activation recomputation (docs/training.md "Activation recomputation"): what a block keeps for
// backward. kFull keeps only each block's input and runs the block's forward again in backward
// (MoE blocks included: same routing draws, collectives repeated); kSelective keeps everything but
// the attention core's probabilities and output, recomputed from qkv in backward (Megatron's
// selective recomputation).
enum class Recompute : uint8_t { kNone, kFull, kSelective };
// "none" | "full" | "selective"; InvalidArgument naming the key `recompute` otherwise.
Recompute RecomputeFromName(std::string_view name);
std::string_view RecomputeName(Recompute recompute);

struct ModelConfig {
  int64_t vocab_size = 256;  // byte-level tokens
  int64_t seq_len = 64;      // context length (learned position embeddings)
  int64_t model_dim = 128;
  int64_t num_layers = 4;
  int64_t num_heads = 4;
  int64_t hidden_dim = 512;  // dense FFN hidden size
  NormKind norm = NormKind::kLayerNorm;
  kernels::Activation activation = kernels::Activation::kGelu;
  bool tied_head = true;
  // Block i has an MoE FFN iff moe_every > 0, i % moe_every == moe_every - 1 (moe_every 2:
  // blocks 1, 3, ...; 1: every block; 0: a dense model) and i is not in mlp_only_layers.
  int64_t moe_every = 0;
  float init_std = 0.02f;  // N(0, init_std^2); residual projections use init_std / sqrt(2 L)
  // The Hugging Face families' components (docs/models.md). The defaults are GPT-2's; any other
  // value of the attention keys makes every block's attention TensorParallelGqaAttention
  // ("attn.{q,k,v,o}_proj.*", "attn.{q,k}_norm.weight") instead of the fused "attn.qkv" /
  // "attn.proj" (UsesGqaAttention).
  PositionEmbedding position_embedding = PositionEmbedding::kLearned;
  double rope_theta = 10000.0;
  int64_t num_kv_heads = 0;  // 0: num_heads (multi-head attention)
  double norm_eps = 1e-5;    // every norm's eps (Norm::kEps; RMSNorm's rms_norm_eps)
  AttentionBias attention_bias = AttentionBias::kAll;
  bool qk_norm = false;  // OLMoE: RMSNorm over the whole projected q and k
  // swiglu: dense blocks "mlp.{gate,up,down}_proj.*" and gated SiLU experts (moe::LayerConfig
  // gated, activation silu, fc_bias = mlp_bias).
  MlpKind mlp = MlpKind::kGelu;
  bool mlp_bias = true;
  // The padding token: its embedding row gets no gradient from the lookup (nn.Embedding's
  // padding_idx; a tied head still trains it). -1: none.
  int64_t pad_token_id = -1;
  // Qwen2-MoE: every MoE block adds sigmoid(x . w_g) * SwiGLU(x) of this hidden size
  // (GatedSharedExpertMoe, train/gated_shared_moe.h). 0: none.
  int64_t gated_shared_expert_hidden = 0;
  // Blocks that stay dense though moe_every makes them MoE blocks (Hugging Face's
  // mlp_only_layers; moe_every is its decoder_sparse_step).
  std::vector<int64_t> mlp_only_layers;
  // How a training step computes, not what the model is (a checkpoint resumes under any value).
  Recompute recompute = Recompute::kNone;
  Precision precision = Precision::kFloat32;  // bf16: mixed precision (mixed_precision.h)
};

// Throws InvalidArgument naming the field and what was expected.
void ValidateModelConfig(const ModelConfig& config);

// Floating-point operations of one training step (forward + backward) per token, as computed:
// 6 x (the matrix parameters every token multiplies: attention, FFN, output head) plus the
// attention products over the full seq_len x seq_len score matrix (12 x seq_len x model_dim per
// layer). An MoE block counts its gate and top_k experts of expert_hidden_dim (num_experts 0:
// treated as dense). Embedding lookups, norms and element-wise work are not counted.
double TrainingFlopsPerToken(const ModelConfig& config, int64_t num_experts = 0, int64_t top_k = 0,
                             int64_t expert_hidden_dim = 0);
bool IsMoeBlock(const ModelConfig& config, int64_t block_index);
// Whether the blocks' attention is TensorParallelGqaAttention (any attention key away from
// GPT-2's: RoPE, num_kv_heads below num_heads, attention_bias other than all, qk_norm).
bool UsesGqaAttention(const ModelConfig& config);

// The tensor-parallel layout of a model (docs/tensor_parallel.md). The model is built from the
// tensor-parallel layers only, whatever P: the embedding and the output head are vocab-parallel
// (the loss VocabParallelCrossEntropy), each block's attention TensorParallelAttention and its
// dense MLP TensorParallelFeedForward; the norms, the position embedding and the residual stream
// are replicated, or sharded along tokens with options.sequence_parallel. Over one rank those
// layers are the single-rank layers bit for bit. Every rank of the group passes the same tokens
// and targets. Parameters keep their single-rank names with the shapes of their shards
// (Parameter::tp_shard, set for P > 1).
struct TensorParallelContext {
  // The tp group; null: the model builds its layers over a one-rank group of its own. With one
  // rank the options are ignored (nothing to shard or overlap).
  comm::Communicator* group = nullptr;
  TensorParallelOptions options;
};

// Context parallelism (docs/context_parallel.md): with a group of P > 1 ranks each rank holds
// seq / P positions of every sequence (the split of `options`) and the attention core runs across
// the group (Ulysses or ring attention); everything else works on the rank's tokens. Every rank
// of the group passes the same tokens and targets. With tensor parallelism the core runs on each
// tp rank's heads (Ulysses: num_heads / tp must divide by P), between the column- and
// row-parallel projections; with sequence parallelism too, each tp rank holds 1 / tp of its cp
// rank's tokens.
struct ContextParallelContext {
  comm::Communicator* group = nullptr;  // null or one rank: no context parallelism
  ContextParallelOptions options;
  // Without context parallelism: run the core of context_parallel.h anyway (a log-sum-exp per
  // row kept for backward, no [seq, seq] probabilities) instead of CausalAttentionForward.
  bool flash = false;
};

struct BlockCache {
  NormCache norm1;
  AttentionCache attn;
  TpGqaCache gqa;  // UsesGqaAttention: the projections' cache (attn holds qkv, probs, att)
  ContextParallelCache cp_attn;  // context parallelism: the attention core's cache
  NormCache norm2;
  FeedForwardOutput ffn;  // with Recompute::kFull: the statistics only (no state)
  // Recompute::kFull: the block's input and the forward's settings, to run it again in backward.
  Tensor input;
  FeedForwardContext context;
  int64_t batch_size = 0;
};

// One pre-norm transformer block: "<prefix>norm1.", "<prefix>attn.", "<prefix>norm2." and the
// FFN, which `make_ffn` builds (registering its own parameters) after the block's norm2, so that
// parameters are registered in module order.
class Block {
 public:
  // `tp` splits the attention over its group (a group is needed: one rank at tp 1); it must
  // outlive the block.
  Block(ParameterSet& params, const std::string& prefix, const ModelConfig& config,
        const std::function<std::unique_ptr<FeedForward>()>& make_ffn, uint64_t seed,
        const TensorParallelContext& tp, parallel::CommStats* tp_stats = nullptr,
        const ContextParallelContext* cp = nullptr);

  FeedForward& ffn() const { return *ffn_; }

  // x [batch_size * seq_len, model_dim] (this rank's rows of it with sequence parallelism;
  // batch_size counts whole sequences). `cache` receives the FFN's output statistics and, with
  // context.save_for_backward, what Backward needs.
  // What is kept follows the config's `recompute` and `precision`; context.precision is set by
  // the block from its config.
  Tensor Forward(const Tensor& x, int64_t batch_size, const FeedForwardContext& context,
                 BlockCache* cache) const;
  Tensor Backward(const BlockCache& cache, const Tensor& dy, float loss_scale, int threads) const;
  // Appends every tensor `cache` keeps for Backward (FFN state as FeedForward::SavedTensors).
  void SavedTensors(const BlockCache& cache, std::vector<Tensor>* out) const;

 private:
  // The block without recomputation: fills all of `cache` when context.save_for_backward.
  Tensor ForwardAll(const Tensor& x, int64_t batch_size, const FeedForwardContext& context,
                    BlockCache* cache) const;
  Tensor BackwardAll(const BlockCache& cache, const Tensor& dy, float loss_scale,
                     int threads) const;
  // Selective recomputation: the attention core's probs and att from the kept qkv.
  void RecomputeAttentionCore(AttentionCache& attn, int threads) const;
  // UsesGqaAttention: the projections, the core (cp_'s or the softmax core) and o_proj; `cache`
  // null when nothing is kept.
  Tensor GqaAttentionForward(const Tensor& n1, int64_t batch_size,
                             const FeedForwardContext& context, BlockCache* cache) const;
  Tensor GqaAttentionBackward(const BlockCache& cache, const Tensor& dh, int threads) const;

  Recompute recompute_ = Recompute::kNone;
  Precision precision_ = Precision::kFloat32;
  Norm norm1_;
  std::unique_ptr<TensorParallelAttention> attn_;    // GPT-2's fused qkv, or
  std::unique_ptr<TensorParallelGqaAttention> gqa_;  // UsesGqaAttention
  int64_t local_heads() const { return gqa_ ? gqa_->local_heads() : attn_->local_heads(); }
  // The core of context_parallel.h over cp_->group between attn_'s projections; null: the
  // projections' own softmax core.
  const ContextParallelContext* cp_ = nullptr;
  parallel::CommStats* stats_ = nullptr;  // the core's bytes (Traffic::kContext)
  ContextParallelAttention Core(int64_t rows, int64_t batch_size) const;
  std::unique_ptr<Norm> norm2_;
  std::unique_ptr<FeedForward> ffn_;
};

// Which blocks this rank holds, for pipeline parallelism: consecutive ranges [begin, end) of
// blocks, the model chunks, in the order the rank runs them (train/pipeline.h maps virtual stages
// to chunks). The chunk starting at block 0 also holds the embeddings, the chunk ending at
// num_layers the final norm and the output head; with a tied head and the embedding on another
// rank, the head's chunk holds its own copy of "embed.weight" (Parameter::tied_copy), kept equal
// by summing the two copies' gradients. Empty: one chunk, the whole model.
struct BlockRange {
  int64_t begin = 0;
  int64_t end = 0;
};
struct ModelPartition {
  std::vector<BlockRange> chunks;
};

struct ForwardOptions {
  bool training = true;
  bool save_for_backward = true;
  uint64_t step = 0;                // keys the MoE layers' random draws
  int64_t global_token_offset = 0;  // global index of this rank's first token
  int threads = 1;
  // aux_loss hf_concat: the micro-batch's concatenation sums, filled in by the caller before
  // the backward (FeedForwardContext::concat_totals); null: each MoE block's own rows.
  std::shared_ptr<const ConcatAuxTotals> concat_totals;
};

struct ModelState;  // activations kept for Backward (opaque)

struct LmOutput {
  double loss = 0;      // ce_loss + the FFNs' auxiliary loss terms (the training objective)
  double ce_loss = 0;   // mean cross-entropy over counted tokens (nats)
  double aux_loss = 0;  // mean over MoE blocks of l_aux (before coefficients; 0 when dense)
  double z_loss = 0;    // mean over MoE blocks of the router z-loss
  int64_t count = 0;    // tokens counted in ce_loss
  std::vector<RoutingStats> routing;    // one per MoE block (of the chunk), in block order
  std::vector<int64_t> routing_blocks;  // the transformer block index of each routing entry
  Tensor logits;                        // [batch_size * seq_len, vocab_size] (keep_logits only)
  // A chunk without the head: its output activation, the next chunk's input (ForwardChunk).
  Tensor activation;
  std::shared_ptr<const ModelState> state;
};

// Called around each transformer block's forward and backward pass, in the order the passes run
// (blocks in reverse order in backward): ZeRO-3 gathers a block's parameters just before and
// gives them back after; the gradient reduction of a block's parameters starts after its
// backward (the trainer's ParamGradBuffer).
class BlockObserver {
 public:
  virtual ~BlockObserver() = default;
  virtual void BeforeBlock(int64_t block, bool backward) = 0;
  virtual void AfterBlock(int64_t block, bool backward) = 0;
};

class TransformerLm {
 public:
  // Validates the config. A model with MoE blocks needs `moe_factory` (InvalidArgument without);
  // its FFNs must take and return the layout of `tp` (sequence shards with sequence_parallel).
  // With a tensor-parallel group, sizes that must divide by P are checked here (InvalidArgument
  // naming the layer): vocab_size, num_heads, hidden_dim.
  // `partition`: the chunks this rank holds (InvalidArgument for empty, overlapping, unordered
  // or out-of-range ranges); the factory is called only for the MoE blocks held.
  TransformerLm(ModelConfig config, uint64_t seed, FeedForwardFactory moe_factory = nullptr,
                TensorParallelContext tp = {}, ModelPartition partition = {},
                ContextParallelContext cp = {});
  ~TransformerLm();
  TransformerLm(const TransformerLm&) = delete;
  TransformerLm& operator=(const TransformerLm&) = delete;

  const ModelConfig& config() const { return config_; }
  ParameterSet& parameters() { return params_; }
  const ParameterSet& parameters() const { return params_; }
  // MoE blocks held by this rank.
  int64_t num_moe_blocks() const;
  // Experts of each MoE block held, in block order.
  std::vector<int64_t> experts_per_moe_block() const;
  const ModelPartition& partition() const { return partition_; }
  int num_chunks() const { return static_cast<int>(partition_.chunks.size()); }
  bool chunk_has_embedding(int chunk) const;
  bool chunk_has_head(int chunk) const;

  // tokens, targets: int32 [batch_size, seq] with 1 <= seq <= config.seq_len; tokens in
  // [0, vocab_size), targets in [0, vocab_size) or < 0 (ignored). targets may be undefined
  // (no loss; logits are kept). With save_for_backward the output can be passed to Backward.
  // Sequence parallelism needs batch_size * seq to divide by P for a training call
  // (InvalidArgument); other calls are padded with ignored sequences (causal attention: the
  // real tokens' logits do not change; MoE capacity sees the padding).
  // The whole model: needs a partition of one chunk holding every block.
  LmOutput Forward(const Tensor& tokens, const Tensor& targets, const ForwardOptions& options,
                   bool keep_logits = false);
  // Accumulates loss_scale * d(loss)/d(parameters) into the gradients.
  void Backward(const LmOutput& forward, float loss_scale = 1.0f, int threads = 1);
  // One chunk (pipeline parallelism). `tokens` [batch_size, seq] are the micro-batch's (every
  // chunk needs its shape and positions); `x` is the previous chunk's activation (undefined for
  // the embedding's chunk); `targets` are used by the head's chunk (as Forward). The output holds
  // the loss fields for the head's chunk, else `activation`; MoE fields for the chunk's blocks.
  LmOutput ForwardChunk(int chunk, const Tensor& tokens, const Tensor& targets, const Tensor& x,
                        const ForwardOptions& options, bool keep_logits = false);
  // Rows of the activation a chunk takes and gives for `tokens` [batch_size, seq]: the tokens, or
  // with sequence parallelism this rank's share of them (after the padding Forward describes).
  int64_t ActivationRows(const Tensor& tokens) const;
  // Accumulates the chunk's parameter gradients; `dy` is the gradient of its activation
  // (undefined for the head's chunk, which starts from its loss, scaled by loss_scale). Returns
  // the gradient of its input x (undefined for the embedding's chunk).
  Tensor BackwardChunk(const LmOutput& forward, const Tensor& dy, float loss_scale, int threads);
  // After the optimizer step: hands each MoE block the pairs each expert kept in the step, summed
  // over every micro-batch and rank (one vector per MoE block of the whole model, in block order,
  // NumMoeBlocks of the config; a partitioned model uses its blocks' entries; see
  // FeedForward::EndStep).
  void EndStep(const std::vector<std::vector<int64_t>>& global_expert_loads);
  // Hands every MoE block of this rank the router trace (FeedForward::SetRouterTrace).
  void SetRouterTrace(RouterTrace* trace);
  // Bytes of the activations `forward` keeps for Backward (each storage counted once): the
  // blocks' caches (a dense FFN's state; an MoE FFN's state is not visible here and not counted),
  // the final norm's, the head's input and d(loss)/d(logits). Deterministic for a config and
  // batch shape: what recomputation and mixed precision save.
  int64_t SavedActivationBytes(const LmOutput& forward) const;
  // The MoE FFNs' time since the last call, summed over blocks (FeedForward::TakeTimes).
  FeedForwardTimes TakeMoeTimes();
  // Tensor-parallel size (1 without a group) and the bytes the tensor- and context-parallel
  // layers moved since the last call (Traffic::kTensor, Traffic::kContext), then restarts.
  int tp_size() const { return tp_.group->size(); }
  int cp_size() const { return context_parallel() ? cp_.group->size() : 1; }
  parallel::CommStats TakeTensorParallelStats();
  // Calls `observer` around every block's forward and backward from now on (null: none). It
  // must outlive its use.
  void SetBlockObserver(BlockObserver* observer) { observer_ = observer; }

 private:
  bool context_parallel() const { return cp_.group != nullptr && cp_.group->size() > 1; }
  Tensor Logits(const Tensor& h_full, int threads) const;
  const BlockRange& Chunk(int chunk) const;

  ModelConfig config_;
  std::unique_ptr<comm::Communicator> own_tp_group_;  // tp 1 without a group given: one rank
  TensorParallelContext tp_;                          // group never null
  ContextParallelContext cp_;
  // The attention core the blocks run: cp_, or with cp_.flash and no context parallelism the
  // core on this rank alone (no group); none (group null, flash false): the softmax core.
  ContextParallelContext core_;
  parallel::CommStats tp_stats_;
  ModelPartition partition_;
  ParameterSet params_;
  std::unique_ptr<VocabParallelEmbedding> embed_;
  std::unique_ptr<Embedding> pos_embed_;        // learned position embeddings only
  std::vector<std::unique_ptr<Block>> blocks_;  // [num_layers], null for blocks not held
  std::unique_ptr<Norm> final_norm_;
  Parameter* head_ = nullptr;  // embed.weight (tied, or its copy) or head.weight
  BlockObserver* observer_ = nullptr;
};

}  // namespace switchyard::train
