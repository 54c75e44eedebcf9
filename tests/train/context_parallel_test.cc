// Context-parallel attention on in-process ranks against single-rank full attention: outputs and
// the gradients of q, k and v for cp 2..4, Ulysses and ring, causal and not, plain and zigzag
// splits (CausalAttentionForward/Backward for the causal case, a plain reference otherwise); the
// bytes each call puts on the wire; the per-rank work of the two splits; the errors. MoE blocks
// under context parallelism: training runs with binding capacity and every order-dependent routing
// option against the one-rank run.
#include "switchyard/train/context_parallel.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "switchyard/comm/inprocess.h"
#include "switchyard/core/error.h"
#include "switchyard/core/file_util.h"
#include "switchyard/kernels/gemm.h"
#include "switchyard/train/layers.h"
#include "switchyard/train/model.h"
#include "testing/random.h"
#include "train/grad_check.h"
#include "train/run_compare.h"
#include "train/temp_dir.h"
#include "train/tiny_run.h"

namespace switchyard::train {
namespace {

using parallel::CommStats;
using parallel::Traffic;
using testing::RandomTensor;

constexpr double kRtol = 1e-4;
constexpr double kAtol = 2e-5;

::testing::AssertionResult AllClose(const std::string& what, const Tensor& got,
                                    const Tensor& want) {
  if (got.shape() != want.shape())
    return ::testing::AssertionFailure() << what << ": shapes differ";
  const float* g = got.data<float>();
  const float* w = want.data<float>();
  for (int64_t i = 0; i < got.numel(); ++i) {
    if (!(std::abs(g[i] - w[i]) <= kAtol + kRtol * std::abs(w[i])))
      return ::testing::AssertionFailure()
             << what << ": element " << i << " is " << g[i] << ", expected " << w[i];
  }
  return ::testing::AssertionSuccess();
}

// Plain attention (causal or not) over qkv [batch * seq, 3 * D]: att, and d(qkv) for datt.
void ReferenceAttention(const Tensor& qkv, const Tensor& datt, int64_t batch, int64_t heads,
                        bool causal, Tensor* att, Tensor* dqkv) {
  const int64_t rows = qkv.size(0), s = rows / batch, d = qkv.size(1) / 3, hd = d / heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  *att = Tensor::Zeros({rows, d});
  *dqkv = Tensor::Zeros({rows, 3 * d});
  const float* x = qkv.data<float>();
  const float* dy = datt.data<float>();
  float* y = att->data<float>();
  float* dx = dqkv->data<float>();
  std::vector<double> p(static_cast<size_t>(s)), dp(static_cast<size_t>(s));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < s; ++i) {
        const int64_t qi = (b * s + i) * 3 * d + h * hd;
        const int64_t keys = causal ? i + 1 : s;
        double m = -1e300, sum = 0;
        for (int64_t j = 0; j < keys; ++j) {
          const int64_t kj = (b * s + j) * 3 * d + d + h * hd;
          double dot = 0;
          for (int64_t c = 0; c < hd; ++c) dot += double(x[qi + c]) * x[kj + c];
          p[size_t(j)] = dot * scale;
          m = std::max(m, p[size_t(j)]);
        }
        for (int64_t j = 0; j < keys; ++j) sum += (p[size_t(j)] = std::exp(p[size_t(j)] - m));
        double pd = 0;
        for (int64_t j = 0; j < keys; ++j) {
          p[size_t(j)] /= sum;
          const int64_t vj = (b * s + j) * 3 * d + 2 * d + h * hd;
          const int64_t oi = (b * s + i) * d + h * hd;
          double dpj = 0;
          for (int64_t c = 0; c < hd; ++c) {
            y[oi + c] += static_cast<float>(p[size_t(j)] * x[vj + c]);
            dpj += double(dy[oi + c]) * x[vj + c];
            dx[vj + c] += static_cast<float>(p[size_t(j)] * dy[oi + c]);  // dv
          }
          dp[size_t(j)] = dpj;
          pd += p[size_t(j)] * dpj;
        }
        for (int64_t j = 0; j < keys; ++j) {
          const double ds = p[size_t(j)] * (dp[size_t(j)] - pd) * scale;
          const int64_t kj = (b * s + j) * 3 * d + d + h * hd;
          for (int64_t c = 0; c < hd; ++c) {
            dx[qi + c] += static_cast<float>(ds * x[kj + c]);
            dx[kj + c] += static_cast<float>(ds * x[qi + c]);
          }
        }
      }
}

struct Case {
  int cp;
  CpAlgorithm algorithm;
  SequenceSplitKind split;
  bool causal;
  int64_t seq_len;
  int64_t batch = 2;
  int64_t heads = 12;
  int64_t head_dim = 4;
  int threads = 1;
};

std::string Name(const Case& c) {
  return std::string(c.algorithm == CpAlgorithm::kRing ? "ring" : "ulysses") + " cp " +
         std::to_string(c.cp) + (c.split == SequenceSplitKind::kPlain ? " plain" : " zigzag") +
         (c.causal ? " causal" : " full") + " seq " + std::to_string(c.seq_len);
}

// Runs the case on cp in-process ranks against the single-rank reference; checks att, d(qkv) and
// the bytes on the wire against their closed forms.
void CheckAgainstFull(const Case& c) {
  SCOPED_TRACE(Name(c));
  const int64_t d = c.heads * c.head_dim, rows = c.batch * c.seq_len;
  const Tensor qkv = RandomTensor({rows, 3 * d}, 11);
  const Tensor datt = RandomTensor({rows, d}, 12);
  Tensor want_att, want_dqkv;
  if (c.causal) {
    Tensor probs;
    want_att = CausalAttentionForward(qkv, c.batch, c.heads, 1, &probs);
    want_dqkv = CausalAttentionBackward(qkv, probs, datt, c.batch, c.heads, 1);
  } else {
    ReferenceAttention(qkv, datt, c.batch, c.heads, false, &want_att, &want_dqkv);
  }
  const Tensor att = Tensor::Zeros({rows, d}), dqkv = Tensor::Zeros({rows, 3 * d});
  std::vector<CommStats> fwd(size_t(c.cp)), bwd(size_t(c.cp));
  comm::RunInProcess(c.cp, [&](comm::Communicator& group) {
    ContextParallelAttention attn(group, c.heads, c.seq_len, {c.algorithm, c.split, c.causal});
    const SequenceSplit& split = attn.split();
    ContextParallelCache cache;
    const Tensor out = attn.Forward(split.Shard(qkv, c.batch), c.batch, &cache, c.threads,
                                    &fwd[size_t(group.rank())]);
    split.Unshard(out, att, c.batch);  // disjoint rows per rank
    const Tensor dx =
        attn.Backward(cache, split.Shard(datt, c.batch), c.threads, &bwd[size_t(group.rank())]);
    split.Unshard(dx, dqkv, c.batch);
  });
  EXPECT_TRUE(AllClose("att", att, want_att));
  EXPECT_TRUE(AllClose("dq|dk|dv", dqkv, want_dqkv));
  // Bytes this rank sends (float32): per-rank activation [batch * seq / P, D] = a.
  const double p = c.cp, a = double(rows) / p * double(d) * 4;
  double want_fwd = 0, want_bwd = 0;
  if (c.algorithm == CpAlgorithm::kUlysses) {
    want_fwd = want_bwd = (p - 1) / p * 4 * a;  // q, k, v and att (forward); their gradients
  } else {
    want_fwd = (p - 1) * 2 * a;      // k | v blocks
    want_bwd = 2 * (p - 1) * 2 * a;  // k | v blocks and their gradients
  }
  for (int r = 0; r < c.cp; ++r) {
    EXPECT_DOUBLE_EQ(fwd[size_t(r)].Bytes(Traffic::kContext), want_fwd) << "rank " << r;
    EXPECT_DOUBLE_EQ(bwd[size_t(r)].Bytes(Traffic::kContext), want_bwd) << "rank " << r;
    EXPECT_DOUBLE_EQ(fwd[size_t(r)].TotalBytes(), want_fwd);
  }
}

class ContextParallelMatchesFull
    : public ::testing::TestWithParam<std::tuple<int, CpAlgorithm, SequenceSplitKind, bool>> {};

TEST_P(ContextParallelMatchesFull, OutputAndGradients) {
  const auto [cp, algorithm, split, causal] = GetParam();
  // Odd chunk lengths: plain 5 rows per rank (seq 15 at cp 3), zigzag chunks of 3.
  const int64_t seq = split == SequenceSplitKind::kPlain ? 5 * cp : 6 * cp;
  CheckAgainstFull({cp, algorithm, split, causal, seq});
}

std::string ParamName(
    const ::testing::TestParamInfo<std::tuple<int, CpAlgorithm, SequenceSplitKind, bool>>& info) {
  const auto& [cp, algorithm, split, causal] = info.param;
  return std::string(algorithm == CpAlgorithm::kRing ? "Ring" : "Ulysses") + "Cp" +
         std::to_string(cp) + (split == SequenceSplitKind::kPlain ? "Plain" : "Zigzag") +
         (causal ? "Causal" : "Full");
}

INSTANTIATE_TEST_SUITE_P(
    All, ContextParallelMatchesFull,
    ::testing::Combine(::testing::Values(2, 3, 4),
                       ::testing::Values(CpAlgorithm::kUlysses, CpAlgorithm::kRing),
                       ::testing::Values(SequenceSplitKind::kPlain, SequenceSplitKind::kZigzag),
                       ::testing::Bool()),
    ParamName);

// Chunks longer than the kernels' query tile, several threads, one sequence, cp 1.
TEST(ContextParallel, LongChunksAndThreads) {
  CheckAgainstFull({2, CpAlgorithm::kRing, SequenceSplitKind::kPlain, true, 150, 1, 2, 8, 2});
  CheckAgainstFull({2, CpAlgorithm::kRing, SequenceSplitKind::kZigzag, true, 284, 1, 2, 8, 2});
  CheckAgainstFull({2, CpAlgorithm::kUlysses, SequenceSplitKind::kZigzag, false, 140, 1, 2, 8, 2});
  CheckAgainstFull({1, CpAlgorithm::kRing, SequenceSplitKind::kZigzag, true, 70, 2, 3, 8, 2});
  CheckAgainstFull({1, CpAlgorithm::kUlysses, SequenceSplitKind::kPlain, false, 33, 2, 3, 8});
}

// The core on one rank without a group (a one-rank model's memory-lean core): the causal
// single-rank attention, whichever algorithm is asked for (one rank runs ring: nothing travels).
TEST(ContextParallel, OneRankWithoutGroup) {
  const int64_t batch = 2, seq = 70, heads = 3, d = heads * 8;
  const Tensor qkv = RandomTensor({batch * seq, 3 * d}, 21);
  const Tensor datt = RandomTensor({batch * seq, d}, 22);
  Tensor probs;
  const Tensor want_att = CausalAttentionForward(qkv, batch, heads, 1, &probs);
  const Tensor want_dqkv = CausalAttentionBackward(qkv, probs, datt, batch, heads, 1);
  for (const CpAlgorithm algorithm : {CpAlgorithm::kRing, CpAlgorithm::kUlysses}) {
    ContextParallelAttention attn(heads, seq, {algorithm, SequenceSplitKind::kZigzag, true});
    EXPECT_EQ(attn.options().algorithm, CpAlgorithm::kRing);
    ContextParallelCache cache;
    CommStats stats;
    EXPECT_TRUE(AllClose("att", attn.Forward(qkv, batch, &cache, 2, &stats), want_att));
    EXPECT_TRUE(AllClose("dqkv", attn.Backward(cache, datt, 2, &stats), want_dqkv));
    EXPECT_EQ(stats.TotalBytes(), 0);
  }
}

TEST(SequenceSplit, PositionsOfPlainAndZigzag) {
  const SequenceSplit plain(SequenceSplitKind::kPlain, 9, 3, 1);
  EXPECT_EQ(plain.local_len(), 3);
  EXPECT_EQ(plain.Positions(), (std::vector<int64_t>{3, 4, 5}));
  // 8 tokens, cp 2: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
  const SequenceSplit z0(SequenceSplitKind::kZigzag, 8, 2, 0);
  const SequenceSplit z1(SequenceSplitKind::kZigzag, 8, 2, 1);
  EXPECT_EQ(z0.Positions(), (std::vector<int64_t>{0, 1, 6, 7}));
  EXPECT_EQ(z1.Positions(), (std::vector<int64_t>{2, 3, 4, 5}));
  EXPECT_EQ(z0.Position(2), 6);
  EXPECT_THROW(z0.Position(4), InvalidArgument);
  // Shard then Unshard over every rank restores the tensor.
  const Tensor full = RandomTensor({2 * 12, 3}, 5), back = Tensor::Zeros({2 * 12, 3});
  for (int r = 0; r < 3; ++r) {
    const SequenceSplit s(SequenceSplitKind::kZigzag, 12, 3, r);
    const Tensor local = s.Shard(full, 2);
    ASSERT_EQ(local.size(0), 2 * 4);
    // Row 1 of sequence 1 on this rank is global position Position(1) of sequence 1.
    EXPECT_EQ(local.data<float>()[(4 + 1) * 3], full.data<float>()[(12 + s.Position(1)) * 3]);
    s.Unshard(local, back, 2);
  }
  EXPECT_TRUE(AllClose("shard/unshard", back, full));
}

template <typename F>
void ExpectInvalid(F&& f, const std::vector<std::string>& needles) {
  try {
    f();
    ADD_FAILURE() << "no InvalidArgument";
  } catch (const InvalidArgument& e) {
    const std::string what = e.what();
    for (const auto& n : needles) EXPECT_NE(what.find(n), std::string::npos) << what;
  }
}

TEST(SequenceSplit, LengthsThatDoNotDivideAreRejected) {
  ExpectInvalid([] { SequenceSplit(SequenceSplitKind::kPlain, 10, 3, 0); },
                {"sequence length 10", "3 equal chunks", "context-parallel group of 3"});
  ExpectInvalid([] { SequenceSplit(SequenceSplitKind::kZigzag, 9, 3, 0); },
                {"sequence length 9", "6 equal chunks", "zigzag"});
  ExpectInvalid([] { SequenceSplit(SequenceSplitKind::kZigzag, 12, 2, 2); }, {"rank 2"});
  EXPECT_EQ(SequenceSplit::Multiple(SequenceSplitKind::kZigzag, 3), 6);
  EXPECT_EQ(SequenceSplit::Multiple(SequenceSplitKind::kPlain, 3), 3);
  // The same check in the attention, on every rank.
  comm::RunInProcess(2, [](comm::Communicator& group) {
    ExpectInvalid([&] { ContextParallelAttention(group, 4, 10, {}); },
                  {"sequence length 10", "4 equal chunks"});
  });
}

TEST(ContextParallel, UlyssesNeedsHeadsDivisibleByCp) {
  comm::RunInProcess(4, [](comm::Communicator& group) {
    ExpectInvalid(
        [&] {
          ContextParallelAttention(group, 6, 16,
                                   {CpAlgorithm::kUlysses, SequenceSplitKind::kPlain, true});
        },
        {"Ulysses", "6 heads", "context-parallel size 4"});
    // Ring attention has no such constraint.
    ContextParallelAttention ring(group, 6, 16, {CpAlgorithm::kRing, SequenceSplitKind::kPlain});
    EXPECT_EQ(ring.num_heads(), 6);
    // Shapes are checked.
    ContextParallelCache cache;
    ExpectInvalid([&] { (void)ring.Forward(Tensor::Zeros({2 * 4, 17}), 2, &cache); }, {"qkv"});
  });
}

// Score elements per rank for causal ring attention: the plain split gives rank r (r + 1) blocks
// of the rank's whole length n (ratio max/min = cp); the zigzag split gives every rank 2 cp + 1
// chunk pairs of n / 2 (balanced). Ulysses computes the whole triangle for its heads: balanced
// under both splits. Without the mask every rank computes cp n^2.
TEST(ContextParallel, ZigzagBalancesCausalWork) {
  constexpr int kCp = 4;
  constexpr int64_t kSeq = 32, kBatch = 1, kHeads = 4, kHeadDim = 2, kN = kSeq / kCp;
  const Tensor qkv = RandomTensor({kBatch * kSeq, 3 * kHeads * kHeadDim}, 3);
  auto run = [&](CpAlgorithm algo, SequenceSplitKind split, bool causal) {
    std::vector<CpWork> work(kCp);
    comm::RunInProcess(kCp, [&](comm::Communicator& group) {
      ContextParallelAttention attn(group, kHeads, kSeq, {algo, split, causal});
      ContextParallelCache cache;
      attn.Forward(attn.split().Shard(qkv, kBatch), kBatch, &cache, 1, nullptr,
                   &work[size_t(group.rank())]);
    });
    std::vector<int64_t> out;
    for (const CpWork& w : work) out.push_back(w.score_elements);
    return out;
  };
  const int64_t unit = kBatch * kHeads * kN * kN;
  EXPECT_EQ(run(CpAlgorithm::kRing, SequenceSplitKind::kPlain, true),
            (std::vector<int64_t>{1 * unit, 2 * unit, 3 * unit, 4 * unit}));
  const int64_t zig = (2 * kCp + 1) * unit / 4;
  EXPECT_EQ(run(CpAlgorithm::kRing, SequenceSplitKind::kZigzag, true),
            (std::vector<int64_t>(kCp, zig)));
  EXPECT_EQ(run(CpAlgorithm::kRing, SequenceSplitKind::kPlain, false),
            (std::vector<int64_t>(kCp, kCp * unit)));
  // Ulysses: heads / cp heads over the full sequence's chunk pairs.
  EXPECT_EQ(run(CpAlgorithm::kUlysses, SequenceSplitKind::kPlain, true),
            (std::vector<int64_t>(kCp, (kCp * (kCp + 1) / 2) * unit / kCp)));
  EXPECT_EQ(run(CpAlgorithm::kUlysses, SequenceSplitKind::kZigzag, true),
            (std::vector<int64_t>(kCp, zig)));
}

// The memory held per rank shrinks with cp (no [seq, seq] softmax is kept).
TEST(ContextParallel, PeakBytesShrinkWithCp) {
  constexpr int64_t kSeq = 256, kHeads = 4, kHeadDim = 8, kD = kHeads * kHeadDim;
  const Tensor qkv = RandomTensor({kSeq, 3 * kD}, 3);
  auto peak = [&](int cp) {
    std::vector<CpWork> work(static_cast<size_t>(cp));
    comm::RunInProcess(cp, [&](comm::Communicator& group) {
      ContextParallelAttention attn(group, kHeads, kSeq, {});
      ContextParallelCache cache;
      attn.Forward(attn.split().Shard(qkv, 1), 1, &cache, 1, nullptr, &work[size_t(group.rank())]);
    });
    return work[0].peak_bytes;
  };
  const int64_t p1 = peak(1), p2 = peak(2), p4 = peak(4);
  // At least the input, output and log-sum-exp; far below the full softmax (kHeads x kSeq^2).
  EXPECT_GE(p1, (4 * kSeq * kD + kHeads * kSeq) * 4);
  EXPECT_LT(p1, kHeads * kSeq * kSeq * 4);
  EXPECT_LT(p2, p1);
  EXPECT_LT(p4, p2);
}

// The model under context parallelism, for calls without backward (evaluation, generation):
// sequences whose length does not split over the cp ranks are padded at their end, and the
// logits gathered back in sequence order equal the one-rank model's (cp 2 and 3, ring and
// Ulysses, lengths 1, 7 and 11). A training call with such a length is refused, naming it.
TEST(ContextParallelModel, PadsSequencesThatDoNotSplitForCallsWithoutBackward) {
  ModelConfig config;
  config.seq_len = 12;
  config.model_dim = 24;
  config.num_layers = 2;
  config.num_heads = 6;
  config.hidden_dim = 32;
  ForwardOptions options;
  options.training = false;
  options.save_for_backward = false;
  for (const int64_t seq : {1, 7, 11}) {
    Tensor tokens = Tensor::Empty({2, seq}, DType::kInt32);
    for (int64_t i = 0; i < tokens.numel(); ++i) tokens.data<int32_t>()[i] = (i * 37 + 5) % 256;
    TransformerLm one(config, 7);
    const Tensor want = one.Forward(tokens, Tensor(), options, true).logits;
    for (const auto& [cp, algorithm] :
         {std::pair{2, CpAlgorithm::kRing}, std::pair{3, CpAlgorithm::kRing},
          std::pair{2, CpAlgorithm::kUlysses}, std::pair{3, CpAlgorithm::kUlysses}}) {
      SCOPED_TRACE("seq " + std::to_string(seq) + " cp " + std::to_string(cp));
      std::vector<Tensor> got(static_cast<size_t>(cp));
      comm::RunInProcess(cp, [&](comm::Communicator& group) {
        TransformerLm model(
            config, 7, nullptr, {}, {},
            ContextParallelContext{&group, {algorithm, SequenceSplitKind::kZigzag}});
        got[size_t(group.rank())] = model.Forward(tokens, Tensor(), options, true).logits;
        if (seq % (2 * cp) != 0) {
          ForwardOptions train;
          ExpectInvalid([&] { model.Forward(tokens, tokens, train); },
                        {"sequences of " + std::to_string(seq) + " tokens", "multiple of"});
        }
      });
      for (const Tensor& g : got) EXPECT_TRUE(AllClose("logits", g, want));
    }
  }
}

// MoE blocks under context parallelism route in the one-rank order (docs/context_parallel.md, "In
// `switchyard train`", MoE blocks): each token's global index (sequence b, position t -> b *
// seq_len + t) orders the slots and keys every random draw, so a cp group equals one rank with
// binding capacity (the default capacity factor 1.25: drops at every step, asserted) and with every
// order-dependent option: gate noise (Tutel, jitter, Gumbel), GShard random routing, the random and
// probs drop policies, batch-prioritized routing, the aux-loss-free expert bias. Ring and Ulysses
// at cp 2, cp 2 x dp 2 with ep 2, and cp 2 x pp 2 with two micro-batches; losses, gradient norms,
// expert loads and parameters over three steps.
class ContextParallelMoe : public ::testing::Test {
 protected:
  void SetUp() override { kernels::SetBlasThreads(1); }

  TrainConfig Base() {
    TrainConfig c = testing::TinyMoeConfig(dir_);
    c.model.num_heads = 4;
    c.capacity_factor = 1.25;  // the default
    c.num_experts = 8;
    return c;
  }
  // `c` with the MoE options `layer_json` (a layer.json object; "" for none).
  TrainConfig WithLayer(TrainConfig c, const std::string& layer_json) {
    if (layer_json.empty()) return c;
    c.moe_layer_config = dir_ / ("layer" + std::to_string(files_++) + ".json");
    WriteTextFileAtomic(c.moe_layer_config, layer_json);
    return c;
  }
  static TrainConfig Cp(TrainConfig c, int ranks, int cp, const char* algo, int ep = 0) {
    c.ranks = ranks;
    c.cp = cp;
    if (cp > 1) c.cp_algo = algo;
    c.ep = ep;
    return c;
  }

  testing::TempDir dir_;
  int files_ = 0;
};

TEST_F(ContextParallelMoe, EqualsOneRankWithDropsNoiseAndRandomRouting) {
  const int kSteps = 3;
  struct Routing {
    const char* name;
    const char* layer_json;
  };
  const Routing cases[] = {
      {"capacity factor 1.25", ""},
      {"tutel noise", R"({"noise": "tutel_normal", "noise_std": 2.0})"},
      {"random routing", R"({"random_routing": true})"},
      {"jitter", R"({"noise": "jitter", "jitter_eps": 0.1})"},
      {"renormalize after drop", R"({"renormalize_after_drop": true})"},
      {"gumbel second choice", R"({"noise": "gumbel_second"})"},
      {"random drops", R"({"drop_policy": "random"})"},
      {"probs drops, token order", R"({"drop_policy": "probs", "slot_order": "token_order"})"},
      {"batch-prioritized, expert bias",
       R"({"batch_prioritized_routing": true, "expert_bias": true})"},
  };
  for (const Routing& k : cases) {
    const TrainConfig c = WithLayer(Base(), k.layer_json);
    const testing::RunRecord want = testing::SingleRank(c, kSteps);
    for (double d : want.drop_rate) EXPECT_GT(d, 0.0) << k.name;  // capacity binds
    for (const char* algo : {"ring", "ulysses"}) {
      testing::ExpectSameRun(want, testing::OnRanks(Cp(c, 2, 2, algo), kSteps),
                             fmt::format("{}, cp 2 {}", k.name, algo));
    }
    testing::ExpectSameRun(want, testing::OnRanks(Cp(c, 4, 2, "ring", 2), kSteps),
                           fmt::format("{}, cp 2 x dp 2, ep 2", k.name));
  }
  // Two pipeline stages (the MoE block on the second), two micro-batches: one rank with two.
  TrainConfig two = WithLayer(Base(), R"({"drop_policy": "random", "noise": "tutel_normal"})");
  two.microbatches = 2;
  const testing::RunRecord want = testing::SingleRank(two, kSteps);
  for (double d : want.drop_rate) EXPECT_GT(d, 0.0) << "pp 2";
  TrainConfig pp = Cp(two, 4, 2, "ulysses");
  pp.pp = 2;
  testing::ExpectSameRun(want, testing::OnRanks(pp, kSteps), "random drops, noise, cp 2 x pp 2");
}

// With tensor and sequence parallelism (Megatron's arrangement: each tp rank holds half of its cp
// rank's rows, the MoE token group is tp x cp x dp), tp 2 x cp 2 routes as one rank too, also
// with 3 sequences per step, where a tp rank's rows start in the middle of a sequence.
TEST_F(ContextParallelMoe, WithSequenceParallelEqualsOneRank) {
  const int kSteps = 3;
  TrainConfig base = Base();
  base.model.tied_head = false;
  for (const int64_t batch : {8, 3}) {
    for (const char* layer_json : {"", R"({"drop_policy": "random", "noise": "tutel_normal"})"}) {
      TrainConfig c = WithLayer(base, layer_json);
      c.batch_size = batch;
      const std::string what = fmt::format("batch {}, {}", batch,
                                           *layer_json ? "random drops, noise" : "position drops");
      const testing::RunRecord want = testing::SingleRank(c, kSteps);
      for (double d : want.drop_rate) EXPECT_GT(d, 0.0) << what;
      TrainConfig sp = Cp(c, 4, 2, "ring");
      sp.tp = 2;
      sp.sequence_parallel = true;
      testing::ExpectSameRun(want, testing::OnRanks(sp, kSteps), "tp 2 sp x cp 2, " + what);
    }
  }
}

// The per-rank routing scope under context parallelism: a cp group holds one data-parallel
// rank's sequences, and routes them as one batch (capacity, drops and the balancing losses of the
// group's tokens). cp 2 equals one rank; cp 2 x dp 2 (ep 2, and with random drops and noise)
// equals one rank with 2 micro-batches, as dp 2 alone does.
TEST_F(ContextParallelMoe, PerRankScopeRoutesEachCpGroupAsOneShard) {
  const int kSteps = 3;
  TrainConfig base = Base();
  base.routing_scope = "per_rank";
  for (const char* layer_json :
       {"", R"({"drop_policy": "random", "noise": "tutel_normal", "random_routing": true})"}) {
    const TrainConfig c = WithLayer(base, layer_json);
    const std::string what = *layer_json ? "random drops, noise" : "position drops";
    const testing::RunRecord whole = testing::SingleRank(c, kSteps);
    for (double d : whole.drop_rate) EXPECT_GT(d, 0.0) << what;
    testing::ExpectSameRun(whole, testing::OnRanks(Cp(c, 2, 2, "ulysses"), kSteps),
                           "per_rank cp 2, " + what);
    TrainConfig two = c;
    two.microbatches = 2;
    const testing::RunRecord want = testing::SingleRank(two, kSteps);
    testing::ExpectSameRun(want, testing::OnRanks(Cp(c, 2, 1, ""), kSteps),
                           "per_rank dp 2, " + what);
    testing::ExpectSameRun(want, testing::OnRanks(Cp(c, 4, 2, "ring", 2), kSteps),
                           "per_rank cp 2 x dp 2, ep 2, " + what);
  }
}

}  // namespace
}  // namespace switchyard::train
