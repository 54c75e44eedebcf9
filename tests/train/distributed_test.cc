// Distributed training against the single-rank trainer: every layout (ranks, ep, ZeRO stage,
// dispatcher) computes the same losses and parameters up to float summation order; checkpoints
// are layout-independent (a run saved on 4 ranks continues on 2 or 1 with the same next loss);
// resume in the same layout is bit for bit.
#include "switchyard/train/distributed.h"

#include <gtest/gtest.h>

#include <cmath>
#include <mutex>

#include "switchyard/comm/inprocess.h"
#include "switchyard/core/file_util.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/train/checkpoint.h"
#include "switchyard/train/zero.h"
#include "train/run_compare.h"
#include "train/temp_dir.h"
#include "train/tiny_run.h"

namespace switchyard::train {
namespace {

using testing::TempDir;
using testing::TinyMoeConfig;

using StepLosses = testing::RunRecord;
using testing::ExpectSameRun;
using testing::SingleRank;

// Values and gradients that stop being valid on a rank become NaN: a stale read would show.
StepLosses OnRanks(const TrainConfig& c, int steps) {
  return testing::OnRanks(c, steps, ZeroOptions{.poison_non_owned = true});
}

class DistributedTest : public ::testing::Test {
 protected:
  void SetUp() override { kernels::SetBlasThreads(1); }
  TempDir dir_;
};

TEST_F(DistributedTest, EveryLayoutMatchesOneRank) {
  TrainConfig base = TinyMoeConfig(dir_);
  const int kSteps = 3;
  StepLosses want = SingleRank(base, kSteps);
  // The reference must exercise what is compared: at every step drops happen, both loss terms
  // are on and clipping scales the gradients (norm above grad_clip); every expert gets tokens in
  // the first step (later the routing skews fast at this learning rate, and an expert left
  // without tokens is part of the comparison too).
  ASSERT_EQ(want.expert_load.size(), static_cast<size_t>(kSteps));
  for (int s = 0; s < kSteps; ++s) {
    EXPECT_GT(want.drop_rate[s], 0) << "step " << s;
    EXPECT_GT(want.aux_loss[s], 0) << "step " << s;
    EXPECT_GT(want.z_loss[s], 0) << "step " << s;
    EXPECT_GT(want.grad_norm[s], base.grad_clip) << "step " << s;
  }
  ASSERT_EQ(want.expert_load[0].size(), 4u);
  for (size_t e = 0; e < 4; ++e) {
    EXPECT_GT(want.expert_load[0][e], 0) << "expert " << e << " in step 0";
  }
  struct Layout {
    int ranks, ep, zero;
    const char* dispatch;
    int overlap = 1;
  };
  const Layout layouts[] = {
      {1, 0, 0, "alltoall"},
      {2, 0, 0, "alltoall"},
      {4, 0, 0, "alltoall"},
      {4, 2, 0, "alltoall"},
      {4, 4, 1, "alltoall"},
      {4, 4, 2, "alltoall"},
      {4, 4, 3, "alltoall"},
      {4, 2, 3, "alltoallv"},
      {4, 0, 2, "allgather"},
      {2, 0, 1, "alltoallv"},
      // Tutel's a2a-FFN overlap in the MoE blocks.
      {4, 0, 0, "alltoall", 2},
      {4, 2, 1, "alltoallv", 3},
  };
  for (const Layout& l : layouts) {
    TrainConfig c = base;
    c.ranks = l.ranks;
    c.ep = l.ep;
    c.zero_stage = l.zero;
    c.dispatch = l.dispatch;
    c.overlap_degree = l.overlap;
    std::string what = fmt::format("ranks {} ep {} zero {} {} overlap {}", l.ranks, l.ep, l.zero,
                                   l.dispatch, l.overlap);
    ExpectSameRun(want, OnRanks(c, kSteps), what);
  }
}

struct TpLayout {
  int ranks, tp;
  bool sp = false, overlap = false;
  int ep = 0, zero = 0;
  const char* dispatch = "alltoall";
  const char* arrangement = "auto";
  int etp = 1;
};

std::string Describe(const TpLayout& l) {
  return fmt::format("ranks {} tp {}{}{} ep {} zero {} {} {} etp {}", l.ranks, l.tp,
                     l.sp ? " sp" : "", l.overlap ? " overlap" : "", l.ep, l.zero, l.dispatch,
                     l.arrangement, l.etp);
}

TrainConfig WithLayout(TrainConfig c, const TpLayout& l) {
  c.ranks = l.ranks;
  c.tp = l.tp;
  c.sequence_parallel = l.sp;
  c.tp_comm_overlap = l.overlap;
  c.ep = l.ep;
  c.zero_stage = l.zero;
  c.dispatch = l.dispatch;
  c.arrangement = l.arrangement;
  c.etp = l.etp;
  return c;
}

// Tensor parallelism (attention heads, MLP, vocab-parallel embedding and loss), with and without
// sequence parallelism and comm-GEMM overlap, alone and with data parallelism and ZeRO: several
// optimizer steps give the one-rank run's losses, gradient norms and parameters.
TEST_F(DistributedTest, TensorParallelDenseMatchesOneRank) {
  TrainConfig base = TinyMoeConfig(dir_);
  base.model.moe_every = 0;
  base.model.num_heads = 4;
  base.model.tied_head = false;  // the untied head is vocab-parallel too
  const int kSteps = 3;
  StepLosses want = SingleRank(base, kSteps);
  const TpLayout layouts[] = {
      {2, 2},
      {4, 4},
      {2, 2, true},
      {4, 4, true, true},
      {4, 2, false, false, 0, 1},
      {4, 2, true, true, 0, 3},
  };
  for (const TpLayout& l : layouts) {
    const StepLosses got = OnRanks(WithLayout(base, l), kSteps);
    ExpectSameRun(want, got, Describe(l));
    // The run was tensor parallel: rank 0 held a shard of fc1 and its layers communicated.
    EXPECT_EQ(got.tp_size, l.tp) << Describe(l);
    EXPECT_EQ(got.fc1_shape, (Shape{base.model.hidden_dim / l.tp, base.model.model_dim}))
        << Describe(l);
    // Bytes on the wire (bus convention, float32) per step, the closed form of
    // docs/tensor_parallel.md: per layer 4 all-reduces of [n, d] (attention and MLP, forward and
    // backward), or 4 all-gathers + 4 reduce-scatters with sequence parallelism (the same volume);
    // the embedding and the head one each; the loss 3 floats per token.
    const double p = l.tp, n = static_cast<double>(base.batch_size / (l.ranks / l.tp)) *
                               static_cast<double>(base.model.seq_len);
    const double d = static_cast<double>(base.model.model_dim);
    const double layers = static_cast<double>(base.model.num_layers);
    const double per_step =
        (p - 1) / p * 4 * n * d * (8 * layers + 4) + 2 * (p - 1) / p * 4 * 3 * n;
    EXPECT_DOUBLE_EQ(got.tp_bytes, kSteps * per_step) << Describe(l);
  }
  // Tied head.
  base.model.tied_head = true;
  want = SingleRank(base, kSteps);
  ExpectSameRun(want, OnRanks(WithLayout(base, TpLayout{4, 2, true}), kSteps), "tied head tp 2 sp");
}

// MoE blocks beside tensor parallelism, in both arrangements: DeepSpeed (expert groups inside the
// data-parallel ranks of each tp rank, tokens de-duplicated over tp before the exchange) and
// Megatron (sequence-parallel tokens, expert-TP x EP x expert-DP folded over all ranks).
TEST_F(DistributedTest, TensorParallelWithExpertsMatchesOneRank) {
  TrainConfig base = TinyMoeConfig(dir_);
  base.model.num_heads = 4;
  const int kSteps = 3;
  StepLosses want = SingleRank(base, kSteps);
  const TpLayout layouts[] = {
      {2, 2, false, false, 1},
      {4, 2},
      {4, 2, false, false, 2, 2, "alltoallv"},
      {4, 2, false, false, 0, 0, "allgather"},
      {2, 2, true},
      {4, 2, true, true},
      {4, 4, true, false, 2},
      {4, 2, true, false, 2, 1, "alltoallv", "megatron", 2},
  };
  for (const TpLayout& l : layouts) {
    ExpectSameRun(want, OnRanks(WithLayout(base, l), kSteps), Describe(l));
  }
}

// Gradient accumulation: a dense model's steps do not depend on the micro-batch count (up to
// float summation order); with MoE blocks each micro-batch is routed on its own, and W ranks
// (data and tensor parallel) equal one rank with the same micro-batches.
TEST_F(DistributedTest, MicrobatchesAccumulateGradients) {
  TrainConfig dense = TinyMoeConfig(dir_);
  dense.model.moe_every = 0;
  const int kSteps = 3;
  StepLosses one = SingleRank(dense, kSteps);
  TrainConfig four = dense;
  four.microbatches = 4;
  ExpectSameRun(one, SingleRank(four, kSteps), "dense, 4 micro-batches");

  TrainConfig moe = TinyMoeConfig(dir_);
  moe.model.num_heads = 4;
  moe.microbatches = 2;
  StepLosses want = SingleRank(moe, kSteps);
  // Routing per micro-batch differs from the whole batch's (capacity, drops): the runs are not
  // the same, which is what makes the multi-rank comparison below meaningful.
  TrainConfig whole = moe;
  whole.microbatches = 1;
  const StepLosses whole_run = SingleRank(whole, 1);
  EXPECT_NE(want.drop_rate[0], whole_run.drop_rate[0]);
  EXPECT_GT(std::abs(want.loss[0] - whole_run.loss[0]), 1e-4);
  for (const TpLayout& l : {TpLayout{2, 1}, TpLayout{4, 1, false, false, 2, 1},
                            TpLayout{4, 2, true, true}, TpLayout{4, 2}}) {
    ExpectSameRun(want, OnRanks(WithLayout(moe, l), kSteps), "2 micro-batches " + Describe(l));
  }
}

struct PpLayout {
  int ranks, pp;
  const char* schedule = "1f1b";
  int virtual_stages = 1;
  int tp = 1;
  bool sp = false;
  int zero = 0;
};

std::string Describe(const PpLayout& l) {
  return fmt::format("ranks {} pp {} {} v {} tp {}{} zero {}", l.ranks, l.pp, l.schedule,
                     l.virtual_stages, l.tp, l.sp ? " sp" : "", l.zero);
}

TrainConfig WithLayout(TrainConfig c, const PpLayout& l) {
  c.ranks = l.ranks;
  c.pp = l.pp;
  c.pipeline_schedule = l.schedule;
  c.virtual_stages = l.virtual_stages;
  c.tp = l.tp;
  c.sequence_parallel = l.sp;
  c.zero_stage = l.zero;
  return c;
}

// Pipeline parallelism: every schedule kind, 2 and 4 stages, interleaved chunks, with data
// parallelism (experts spread over the data-parallel ranks of each stage), tensor parallelism
// and ZeRO, tied and untied heads: several optimizer steps equal one rank with the same
// micro-batches.
TEST_F(DistributedTest, PipelineMatchesOneRank) {
  TrainConfig base = TinyMoeConfig(dir_);
  base.model.num_layers = 4;  // blocks 1 and 3 are MoE blocks
  base.model.num_heads = 4;
  base.microbatches = 4;
  const int kSteps = 3;
  for (bool tied : {true, false}) {
    base.model.tied_head = tied;
    StepLosses want = SingleRank(base, kSteps);
    std::vector<PpLayout> layouts = {
        {2, 2, "fthenb"},
        {2, 2, "1f1b"},
        {2, 2, "zb-h1"},
        {4, 4, "1f1b"},
        {2, 2, "interleaved", 2},
        {4, 2, "1f1b", 1, 1, false, 1},
        {4, 2, "interleaved", 2, 2, true},
    };
    if (!tied) layouts = {{4, 4, "fthenb"}, {4, 4, "zb-h1"}, {4, 2, "zb-h1", 1, 2, false, 3}};
    for (const PpLayout& l : layouts) {
      ExpectSameRun(want, OnRanks(WithLayout(base, l), kSteps),
                    Describe(l) + (tied ? " tied" : " untied"));
    }
  }
}

// Interleaved 1F1B on 4 stages: 8 blocks in 8 virtual stages (2 chunks per rank), with the MoE
// blocks spread over them.
TEST_F(DistributedTest, InterleavedPipelineOnFourStagesMatchesOneRank) {
  TrainConfig base = TinyMoeConfig(dir_);
  base.model.num_layers = 8;
  base.model.num_heads = 4;
  base.microbatches = 4;
  const int kSteps = 2;
  StepLosses want = SingleRank(base, kSteps);
  for (const PpLayout& l : {PpLayout{4, 4, "interleaved", 2}, PpLayout{4, 4, "zb-h1"}}) {
    ExpectSameRun(want, OnRanks(WithLayout(base, l), kSteps), Describe(l) + " 8 blocks");
  }
}

// Bytes the context-parallel attention puts on the wire per step and rank (bus convention,
// float32; docs/context_parallel.md): per layer and pass a = (batch / dp) x (seq_len / cp) x
// (model_dim / tp) x 4 bytes, Ulysses 8 (cp - 1) / cp a (all-to-all of q, k, v, att and their
// gradients), ring 6 (cp - 1) a (K/V blocks forward and backward, dK/dV blocks backward); every
// rank holds num_layers / pp layers.
double CpBytesPerStep(const TrainConfig& c) {
  const double p = static_cast<double>(c.cp);
  const double dp = static_cast<double>(c.ranks / (c.tp * c.cp * c.pp));
  const double a = static_cast<double>(c.batch_size) / dp * static_cast<double>(c.model.seq_len) /
                   p * static_cast<double>(c.model.model_dim / c.tp) * 4;
  const double per_layer = c.cp_algo == "ulysses" ? 8 * (p - 1) / p * a : 6 * (p - 1) * a;
  return static_cast<double>(c.model.num_layers / c.pp) * per_layer;
}

// Context parallelism: each sequence's positions split over cp ranks (zigzag), attention across
// them by ring attention or Ulysses, alone, with data parallelism and with pipeline stages; with
// MoE blocks whose capacity does not bind (the cp ranks' token order differs from one rank's, so
// capacity drops would be decided on other tokens). The attention's bytes per step are the closed
// form of CpBytesPerStep.
TEST_F(DistributedTest, ContextParallelMatchesOneRank) {
  TrainConfig base = TinyMoeConfig(dir_);
  base.model.moe_every = 0;
  base.model.num_heads = 4;
  const int kSteps = 3;
  struct CpLayout {
    int ranks, cp;
    const char* algo;
    int pp = 1;
  };
  auto with = [](TrainConfig c, const CpLayout& l) {
    c.ranks = l.ranks;
    c.cp = l.cp;
    c.cp_algo = l.algo;
    c.pp = l.pp;
    if (l.pp > 1) c.microbatches = 2;
    return c;
  };
  StepLosses want = SingleRank(base, kSteps);
  for (const CpLayout& l :
       {CpLayout{2, 2, "ring"}, CpLayout{2, 2, "ulysses"}, CpLayout{4, 4, "ring"},
        CpLayout{4, 2, "ring"}, CpLayout{4, 4, "ulysses"}}) {
    const std::string what = fmt::format("ranks {} cp {} {}", l.ranks, l.cp, l.algo);
    const StepLosses got = OnRanks(with(base, l), kSteps);
    ExpectSameRun(want, got, what);
    EXPECT_DOUBLE_EQ(got.cp_bytes, kSteps * CpBytesPerStep(with(base, l))) << what;
    EXPECT_EQ(got.tp_bytes, 0) << what;
  }
  TrainConfig two = base;
  two.microbatches = 2;
  const StepLosses pipelined = OnRanks(with(base, CpLayout{4, 2, "ring", 2}), kSteps);
  ExpectSameRun(SingleRank(two, kSteps), pipelined, "ranks 4 cp 2 pp 2");
  EXPECT_DOUBLE_EQ(pipelined.cp_bytes,
                   kSteps * CpBytesPerStep(with(base, CpLayout{4, 2, "ring", 2})));
  TrainConfig moe = TinyMoeConfig(dir_);
  moe.model.num_heads = 4;
  moe.capacity_factor = 4.0;  // no drops
  want = SingleRank(moe, kSteps);
  for (double d : want.drop_rate) EXPECT_EQ(d, 0.0);
  ExpectSameRun(want, OnRanks(with(moe, CpLayout{4, 2, "ring"}), kSteps), "moe ranks 4 cp 2");
}

// The attention core of context_parallel.h on one rank (attention_core "flash": a log-sum-exp per
// row instead of the [seq, seq] probabilities) trains as the softmax core.
TEST_F(DistributedTest, FlashCoreOnOneRankMatchesSoftmaxCore) {
  TrainConfig base = TinyMoeConfig(dir_);
  base.model.moe_every = 0;
  base.model.num_heads = 4;
  const int kSteps = 3;
  const StepLosses want = SingleRank(base, kSteps);
  TrainConfig flash = base;
  flash.attention_core = "flash";
  ExpectSameRun(want, SingleRank(flash, kSteps), "flash core, one rank");
  flash.ranks = 2;
  flash.tp = 2;
  ExpectSameRun(want, OnRanks(flash, kSteps), "flash core, tp 2");
}

// Context parallelism with tensor parallelism: each tp rank's heads (Megatron's column-parallel
// QKV, row-parallel output projection) run the context-parallel core over its cp group; with
// sequence parallelism each tp rank holds a tp-th of its cp rank's tokens; with data parallelism
// and MoE blocks in both arrangements. Losses, gradient norms and parameters equal the one-rank
// run's over several steps; the tensor- and context-parallel bytes per step are the closed forms
// with the cp rank's tokens.
TEST_F(DistributedTest, ContextWithTensorParallelMatchesOneRank) {
  TrainConfig base = TinyMoeConfig(dir_);
  base.model.moe_every = 0;
  base.model.num_heads = 4;
  base.model.tied_head = false;
  const int kSteps = 3;
  struct Layout {
    int ranks, tp, cp;
    const char* algo;
    bool sp = false, overlap = false;
    int zero = 0;
  };
  auto with = [](TrainConfig c, const Layout& l) {
    c.ranks = l.ranks;
    c.tp = l.tp;
    c.cp = l.cp;
    c.cp_algo = l.algo;
    c.sequence_parallel = l.sp;
    c.tp_comm_overlap = l.overlap;
    c.zero_stage = l.zero;
    return c;
  };
  auto name = [](const Layout& l) {
    return fmt::format("ranks {} tp {} cp {} {}{}{} zero {}", l.ranks, l.tp, l.cp, l.algo,
                       l.sp ? " sp" : "", l.overlap ? " overlap" : "", l.zero);
  };
  const StepLosses want = SingleRank(base, kSteps);
  for (const Layout& l :
       {Layout{4, 2, 2, "ring"}, Layout{4, 2, 2, "ulysses"}, Layout{4, 2, 2, "ring", true},
        Layout{4, 2, 2, "ulysses", true, true}, Layout{8, 2, 2, "ring", false, false, 1}}) {
    const TrainConfig c = with(base, l);
    const StepLosses got = OnRanks(c, kSteps);
    ExpectSameRun(want, got, name(l));
    EXPECT_EQ(got.tp_size, l.tp) << name(l);
    EXPECT_DOUBLE_EQ(got.cp_bytes, kSteps * CpBytesPerStep(c)) << name(l);
    // The tensor-parallel closed form of TensorParallelDenseMatchesOneRank over the n tokens a
    // cp rank holds.
    const double p = l.tp, n = static_cast<double>(base.batch_size / (l.ranks / l.tp / l.cp)) *
                               static_cast<double>(base.model.seq_len / l.cp);
    const double d = static_cast<double>(base.model.model_dim);
    const double layers = static_cast<double>(base.model.num_layers);
    EXPECT_DOUBLE_EQ(got.tp_bytes, kSteps * ((p - 1) / p * 4 * n * d * (8 * layers + 4) +
                                             2 * (p - 1) / p * 4 * 3 * n))
        << name(l);
  }
  // An odd number of sequences per step: with sequence parallelism the tp ranks' halves of a cp
  // rank's tokens then cut through a sequence (3 sequences x 8 positions, 12 rows per tp rank),
  // so the second tp rank's rows start in the middle of one (its positions must say so).
  TrainConfig odd = base;
  odd.batch_size = 3;
  const StepLosses want_odd = SingleRank(odd, kSteps);
  for (const Layout& l : {Layout{4, 2, 2, "ring", true}, Layout{4, 2, 2, "ulysses", true}}) {
    ExpectSameRun(want_odd, OnRanks(with(odd, l), kSteps), "batch 3 " + name(l));
  }
  // MoE blocks (no drops: the cp ranks' token order is not one rank's), DeepSpeed and Megatron.
  TrainConfig moe = TinyMoeConfig(dir_);
  moe.model.num_heads = 4;
  moe.capacity_factor = 4.0;
  const StepLosses want_moe = SingleRank(moe, kSteps);
  for (const Layout& l : {Layout{4, 2, 2, "ring"}, Layout{4, 2, 2, "ulysses", true}}) {
    ExpectSameRun(want_moe, OnRanks(with(moe, l), kSteps), "moe " + name(l));
  }
}

// PR-MoE's residual MLP and DeepSeek's shared expert in the MoE blocks: dense parameters
// replicated over the ranks, their gradients reduced like the gate's. Several optimizer steps on
// W ranks give the one-rank run's losses and parameters.
TEST_F(DistributedTest, ResidualAndSharedExpertsMatchOneRank) {
  TrainConfig base = TinyMoeConfig(dir_);
  base.moe_layer_config = dir_ / "variants.json";
  WriteTextFileAtomic(base.moe_layer_config,
                      R"({"residual_moe": true, "shared_expert_hidden": 16})");
  const moe::LayerConfig layer = MoeLayerConfig(base);
  ASSERT_TRUE(layer.residual_moe);
  ASSERT_EQ(layer.shared_expert_hidden, 16);
  const int kSteps = 3;
  const StepLosses want = SingleRank(base, kSteps);
  ASSERT_TRUE(want.model.contains("blocks.1.moe.residual_mlp.fc1.weight"));
  ASSERT_TRUE(want.model.contains("blocks.1.moe.shared_experts.fc1.weight"));
  ASSERT_TRUE(want.model.contains("blocks.1.moe.coefficient.weight"));
  struct Layout {
    int ranks, ep, zero;
    const char* dispatch;
  };
  for (const Layout& l :
       {Layout{2, 0, 0, "alltoall"}, Layout{4, 2, 1, "alltoallv"}, Layout{4, 0, 3, "allgather"}}) {
    TrainConfig c = base;
    c.ranks = l.ranks;
    c.ep = l.ep;
    c.zero_stage = l.zero;
    c.dispatch = l.dispatch;
    ExpectSameRun(want, OnRanks(c, kSteps),
                  fmt::format("ranks {} ep {} zero {} {}", l.ranks, l.ep, l.zero, l.dispatch));
  }
}

// PR-MoE's pyramid: experts_per_block gives each MoE block its own number of experts. The model
// holds them with those shapes, and on 2 ranks (ep 2: every count a multiple of ep, so the
// blocks share one set of process groups) training equals the one-rank run.
TEST_F(DistributedTest, PyramidExpertCountsPerBlock) {
  TrainConfig base = TinyMoeConfig(dir_);
  base.model.num_layers = 4;  // MoE blocks 1 and 3
  base.experts_per_block = {2, 4};
  ValidateTrainConfig(base);
  EXPECT_EQ(BlockExperts(base, 1), 2);
  EXPECT_EQ(BlockExperts(base, 3), 4);
  const int kSteps = 2;
  const StepLosses want = SingleRank(base, kSteps);
  ASSERT_TRUE(want.model.contains("blocks.1.moe.experts.fc1.weight"));
  EXPECT_EQ(want.model.at("blocks.1.moe.experts.fc1.weight").size(0), 2);
  EXPECT_EQ(want.model.at("blocks.3.moe.experts.fc1.weight").size(0), 4);
  EXPECT_EQ(want.model.at("blocks.3.moe.gate.weight").size(0), 4);
  EXPECT_EQ(want.expert_load[0].size(), 2u);  // block 1's loads
  TrainConfig c = base;
  c.ranks = 2;
  ExpectSameRun(want, OnRanks(c, kSteps), "pyramid on 2 ranks");

  // Blocks whose experts would split over the ep ranks differently cannot share the groups.
  c.ranks = 4;
  try {
    TrainParallelOptions(c, 4);
    ADD_FAILURE() << "experts_per_block [2, 4] on ep 4 was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'experts_per_block' [2, 4] with 'ep' 4"),
              std::string::npos)
        << e.what();
  }
  // One count per MoE block.
  TrainConfig wrong = base;
  wrong.experts_per_block = {2, 4, 8};
  try {
    ValidateTrainConfig(wrong);
    ADD_FAILURE() << "three counts for two MoE blocks were accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'experts_per_block' has 3 entries, expected one per MoE "
                                         "block: 2"),
              std::string::npos)
        << e.what();
  }
}

TEST_F(DistributedTest, ZeroShardsTheOptimizerState) {
  TrainConfig c = TinyMoeConfig(dir_);
  c.ranks = 4;
  std::vector<int64_t> elements(4);
  for (int stage = 0; stage <= 3; ++stage) {
    c.zero_stage = stage;
    std::mutex mu;
    comm::RunInProcess(4, [&](comm::Communicator& world) {
      RankTrainer rt(c, world, world.size());
      rt.trainer().Step();
      if (world.rank() == 1) {
        std::lock_guard<std::mutex> lock(mu);
        elements[stage] = rt.buffer().optimizer_state_elements();
      }
    });
  }
  EXPECT_GT(elements[0], 0);
  for (int stage = 1; stage <= 3; ++stage) {
    // Dense state / 4; the experts' (one expert per rank, no replicas) is not divided.
    EXPECT_LT(elements[stage], elements[0] * 6 / 10) << "stage " << stage;
  }
}

// Saves a checkpoint after `steps` steps of layout `c` and returns the loss of the next step.
double SaveAfterAndStep(const TrainConfig& c, int steps, const std::string& ckpt_dir) {
  double next = NAN;
  std::mutex mu;
  comm::RunInProcess(static_cast<int>(c.ranks), [&](comm::Communicator& world) {
    RankTrainer rt(c, world, world.size());
    for (int s = 0; s < steps; ++s) rt.trainer().Step();
    CheckpointData d = rt.trainer().Snapshot();
    if (world.rank() == 0) SaveCheckpoint(ckpt_dir, d);
    double l = rt.trainer().Step().loss;
    if (world.rank() == 0) {
      std::lock_guard<std::mutex> lock(mu);
      next = l;
    }
  });
  return next;
}

// Loads `path` into layout `c` and returns the loss of the next step.
double ResumeAndStep(const TrainConfig& c, const std::string& path) {
  double next = NAN;
  std::mutex mu;
  CheckpointData d = LoadCheckpoint(path);
  comm::RunInProcess(static_cast<int>(c.ranks), [&](comm::Communicator& world) {
    RankTrainer rt(c, world, world.size());
    rt.trainer().Restore(d);
    double l = rt.trainer().Step().loss;
    if (world.rank() == 0) {
      std::lock_guard<std::mutex> lock(mu);
      next = l;
    }
  });
  return next;
}

TEST_F(DistributedTest, CheckpointsMoveBetweenLayouts) {
  TrainConfig c = TinyMoeConfig(dir_);
  c.ranks = 4;
  c.ep = 4;
  const std::string ck = dir_ / "ck";
  const double continued = SaveAfterAndStep(c, 2, ck);
  ASSERT_TRUE(std::isfinite(continued));

  // Experts are saved by global id with the full [E, ...] shapes.
  CheckpointData d = LoadCheckpoint(ck);
  EXPECT_EQ(d.model.at("blocks.1.moe.experts.fc1.weight").shape(), (Shape{4, 48, 32}));
  EXPECT_EQ(d.optimizer.at("blocks.1.moe.experts.fc2.weight.exp_avg").shape(), (Shape{4, 32, 48}));

  // Same layout: bit for bit.
  EXPECT_EQ(ResumeAndStep(c, ck), continued);
  // Other layouts: the same next loss up to summation order.
  struct Layout {
    int ranks, ep, zero;
  };
  for (Layout l : {Layout{2, 2, 0}, Layout{2, 2, 3}, Layout{4, 2, 1}, Layout{1, 1, 0}}) {
    TrainConfig o = c;
    o.ranks = l.ranks;
    o.ep = l.ep;
    o.zero_stage = l.zero;
    EXPECT_NEAR(ResumeAndStep(o, ck), continued, 2e-5 * std::abs(continued))
        << "ranks " << l.ranks << " ep " << l.ep << " zero " << l.zero;
  }
  // And the single-rank trainer loads it too.
  TrainConfig one = c;
  one.ranks = 1;
  Trainer t(one);
  t.Restore(d);
  EXPECT_NEAR(t.Step().loss, continued, 2e-5 * std::abs(continued));
}

// Tensor-parallel checkpoints hold the single-rank tensors: saved at tp 2 they resume at tp 1 and
// tp 4 (and with or without sequence parallelism) with the same next loss, and the reverse.
TEST_F(DistributedTest, CheckpointsMoveBetweenTensorParallelSizes) {
  TrainConfig base = TinyMoeConfig(dir_);
  base.model.num_heads = 4;
  base.model.tied_head = false;
  const TrainConfig tp2 = WithLayout(base, TpLayout{4, 2, true, false, 2, 1});
  const std::string ck = dir_ / "ck_tp2";
  const double continued = SaveAfterAndStep(tp2, 2, ck);
  ASSERT_TRUE(std::isfinite(continued));
  CheckpointData d = LoadCheckpoint(ck);
  EXPECT_EQ(d.model.at("embed.weight").shape(), (Shape{256, 32}));
  EXPECT_EQ(d.model.at("head.weight").shape(), (Shape{256, 32}));
  EXPECT_EQ(d.model.at("blocks.0.attn.qkv.weight").shape(), (Shape{96, 32}));
  EXPECT_EQ(d.model.at("blocks.0.attn.proj.weight").shape(), (Shape{32, 32}));
  EXPECT_EQ(d.optimizer.at("blocks.0.mlp.fc2.weight.exp_avg").shape(), (Shape{32, 48}));
  EXPECT_EQ(d.optimizer.at("blocks.0.attn.qkv.bias.exp_avg_sq").shape(), (Shape{96}));
  EXPECT_EQ(ResumeAndStep(tp2, ck), continued);  // same layout: bit for bit
  for (const TpLayout& l :
       {TpLayout{1, 1}, TpLayout{4, 4, true}, TpLayout{2, 2}, TpLayout{4, 2, false, false, 2, 3}}) {
    EXPECT_NEAR(ResumeAndStep(WithLayout(base, l), ck), continued, 2e-5 * std::abs(continued))
        << Describe(l);
  }
  // The reverse: saved on one rank, resumed at tp 2 and 4.
  const TrainConfig one = WithLayout(base, TpLayout{1, 1});
  const std::string ck1 = dir_ / "ck_tp1";
  const double continued1 = SaveAfterAndStep(one, 2, ck1);
  for (const TpLayout& l : {TpLayout{2, 2, true, true}, TpLayout{4, 4}}) {
    EXPECT_NEAR(ResumeAndStep(WithLayout(base, l), ck1), continued1, 2e-5 * std::abs(continued1))
        << Describe(l);
  }
}

TEST_F(DistributedTest, ZeroCheckpointResumesBitForBit) {
  TrainConfig c = TinyMoeConfig(dir_);
  c.ranks = 4;
  c.ep = 2;
  c.zero_stage = 3;
  const std::string ck = dir_ / "ck3";
  const double continued = SaveAfterAndStep(c, 2, ck);
  EXPECT_EQ(ResumeAndStep(c, ck), continued);
}

TEST_F(DistributedTest, BadLayoutsAreClearErrors) {
  TrainConfig c = TinyMoeConfig(dir_);
  c.ranks = 4;
  c.ep = 3;
  EXPECT_THROW(
      {
        try {
          TrainParallelOptions(c, 4);
        } catch (const InvalidArgument& e) {
          EXPECT_NE(std::string(e.what()).find("'ep' 3 must divide the number of ranks 4"),
                    std::string::npos)
              << e.what();
          throw;
        }
      },
      InvalidArgument);
  c.ep = 2;
  c.num_experts = 3;
  EXPECT_THROW(TrainParallelOptions(c, 4), InvalidArgument);
  c.num_experts = 4;
  c.dispatch = "broadcast";
  EXPECT_THROW(ValidateTrainConfig(c), InvalidArgument);
  c.dispatch = "alltoall";
  c.zero_stage = 4;
  EXPECT_THROW(ValidateTrainConfig(c), InvalidArgument);
}

TEST_F(DistributedTest, RunWritesTheRunDirectoryFromRankZero) {
  TrainConfig c = TinyMoeConfig(dir_);
  c.ranks = 4;
  c.steps = 4;
  c.log_every = 2;
  c.eval_every = 2;
  c.checkpoint_every = 2;
  c.sample_tokens = 10;
  DistributedRunOptions o;
  o.run.out = std::fopen("/dev/null", "w");
  RunSummary s =
      RunDistributedTraining(*comm::CreateInProcessLauncher(static_cast<int>(c.ranks)), c, o);
  std::fclose(o.run.out);
  EXPECT_EQ(s.steps, 4);
  EXPECT_TRUE(std::isfinite(s.final_val_ce_loss));
  EXPECT_EQ(s.sample.size(), 10u);
  for (const char* f : {"config.json", "metrics.jsonl", "loss.svg", "expert_load.svg",
                        "summary.json", "sample.txt", "checkpoints/latest"}) {
    EXPECT_TRUE(std::filesystem::exists(c.out + "/" + f)) << f;
  }
}

// Checkpoints of a pipelined run hold the whole model (every stage's parameters, experts by
// global id): saved at pp 2 they resume at pp 1 and pp 4 with the same next loss.
TEST_F(DistributedTest, CheckpointsMoveBetweenPipelineSizes) {
  TrainConfig base = TinyMoeConfig(dir_);
  base.model.num_layers = 4;
  base.microbatches = 4;
  const TrainConfig pp2 = WithLayout(base, PpLayout{4, 2});
  const std::string ck = dir_ / "ck_pp2";
  const double continued = SaveAfterAndStep(pp2, 2, ck);
  ASSERT_TRUE(std::isfinite(continued));
  CheckpointData d = LoadCheckpoint(ck);
  EXPECT_EQ(d.model.at("blocks.3.moe.experts.fc1.weight").shape(), (Shape{4, 48, 32}));
  EXPECT_EQ(d.model.count("blocks.0.attn.qkv.weight"), 1u);
  EXPECT_EQ(d.model.count("final_norm.weight"), 1u);
  EXPECT_EQ(ResumeAndStep(pp2, ck), continued);  // same layout: bit for bit
  for (const PpLayout& l :
       {PpLayout{1, 1}, PpLayout{4, 4, "fthenb"}, PpLayout{2, 2, "interleaved", 2}}) {
    EXPECT_NEAR(ResumeAndStep(WithLayout(base, l), ck), continued, 2e-5 * std::abs(continued))
        << Describe(l);
  }
}

}  // namespace
}  // namespace switchyard::train
