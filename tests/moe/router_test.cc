// The Megatron-Core / DeepSeek-V3 router options (docs/moe.md, "Gate" and "Losses") on their own
// terms: the sequence loss against the batch loss it generalizes, and the loss sums of a batch
// split over ranks (as the parallel layer adds them) against the whole batch. The forward values
// and gradients against the plain reference are in layer_test.cc, the layer.json keys in
// config_test.cc.
#include <gtest/gtest.h>

#include <numeric>
#include <string>
#include <vector>

#include "switchyard/core/error.h"
#include "switchyard/moe/config.h"
#include "switchyard/moe/gate.h"
#include "switchyard/moe/layer.h"
#include "switchyard/moe/losses.h"
#include "testing/random.h"

namespace switchyard::moe {
namespace {

LayerConfig SmallConfig() {
  LayerConfig c;
  c.model_dim = 6, c.hidden_dim = 5, c.num_experts = 4, c.top_k = 2;
  c.capacity_factor = 0;  // no drops
  c.seed = 3;
  return c;
}

Tensor RandomX(int64_t tokens, int64_t m_dim, uint64_t seed) {
  return Tensor::FromVector(
      switchyard::testing::RandomVector(static_cast<size_t>(tokens * m_dim), seed),
      {tokens, m_dim});
}

// One sequence holding the whole batch: the sequence loss is Megatron's batch aux loss
// E / (k T^2) sum_e P_e N_e, which is our gshard_all_choices (its counts are the top k of P, the
// layer's choices when nothing but the scores decides them).
TEST(SequenceLoss, OneSequenceEqualsTheAllChoicesBatchLoss) {
  for (ScoreFunction sf :
       {ScoreFunction::kSoftmax, ScoreFunction::kSigmoid, ScoreFunction::kSoftmaxAfterTopK}) {
    LayerConfig all = SmallConfig();
    all.score_function = sf;
    all.aux_loss = AuxLoss::kGShardAllChoices;
    LayerConfig seq = all;
    seq.aux_loss = AuxLoss::kSequence;
    seq.sequence_length = 10;
    LayerParams params = InitParams(all, 4);
    Tensor x = RandomX(10, all.model_dim, 5);
    float a = MoeLayer(all).Forward(params, x).l_aux;
    float s = MoeLayer(seq).Forward(params, x).l_aux;
    EXPECT_GT(a, 0.5f);
    EXPECT_NEAR(s, a, 1e-6f * a) << ScoreFunctionName(sf);
  }
}

// B sequences: the mean of the per-sequence losses, each of them the loss of that sequence alone;
// the gradient of the gate weight likewise.
TEST(SequenceLoss, IsTheMeanOfTheSequencesAlone) {
  LayerConfig c = SmallConfig();
  c.aux_loss = AuxLoss::kSequence;
  c.sequence_length = 5;
  c.aux_loss_coef = 1.0f;
  LayerParams params = InitParams(c, 4);
  const int64_t b_num = 3, t_num = b_num * c.sequence_length;
  Tensor x = RandomX(t_num, c.model_dim, 6);
  Tensor dy = Tensor::Zeros({t_num, c.model_dim});  // the aux loss alone
  MoeLayer layer(c);
  LayerOutput out = layer.Forward(params, x);
  LayerGradients g = layer.Backward(params, out, dy);
  double mean = 0;
  std::vector<double> dw(static_cast<size_t>(c.num_experts * c.model_dim), 0.0);
  for (int64_t b = 0; b < b_num; ++b) {
    Tensor xb = x.Slice(b * c.sequence_length, (b + 1) * c.sequence_length).Clone();
    ForwardOptions o;
    o.global_token_offset = b * c.sequence_length;
    LayerOutput ob = layer.Forward(params, xb, o);
    LayerGradients gb = layer.Backward(params, ob, dy.Slice(0, c.sequence_length).Clone());
    mean += ob.l_aux / b_num;
    for (size_t i = 0; i < dw.size(); ++i) {
      dw[i] += gb.params.gate_weight.data<float>()[i] / static_cast<double>(b_num);
    }
  }
  EXPECT_NEAR(out.l_aux, mean, 1e-6);
  for (size_t i = 0; i < dw.size(); ++i) {
    EXPECT_NEAR(g.params.gate_weight.data<float>()[i], dw[i], 1e-6) << "gate.weight " << i;
  }
}

// The parallel layer's way: each rank sums its own tokens per sequence of the batch (tokens of
// one sequence on several ranks, as context parallelism holds them), the ranks add the sums, and
// every rank gets the batch's loss and its share of the gradient.
TEST(SequenceLoss, SumsSplitOverRanksEqualTheWholeBatch) {
  LayerConfig c = SmallConfig();
  c.aux_loss = AuxLoss::kSequence;
  c.sequence_length = 4;
  c.num_experts = 8, c.num_groups = 4, c.group_topk = 2;  // choices differ from the aux top k
  const int64_t t_num = 12, base = 40;  // sequences 10, 11, 12 of the global order
  Tensor x = RandomX(t_num, c.model_dim, 7);
  LayerParams params = InitParams(c, 8);
  std::vector<int64_t> all(t_num);
  std::iota(all.begin(), all.end(), base);
  GateResult whole = GateForward(c, x, params.gate_weight, {}, {0, 0, true, all});
  GateLosses want = ComputeGateLosses(c, whole);
  Tensor want_dl = Tensor::Zeros({t_num, c.num_experts});
  GateLossesBackward(c, whole, 1.0f, 0.0f, want_dl);

  // Two ranks, each holding every other token.
  std::vector<std::vector<int64_t>> rows(2), index(2);
  for (int64_t t = 0; t < t_num; ++t) {
    rows[static_cast<size_t>(t % 2)].push_back(t);
    index[static_cast<size_t>(t % 2)].push_back(base + t);
  }
  std::vector<GateResult> part(2);
  std::vector<double> summed;
  for (size_t r = 0; r < 2; ++r) {
    Tensor xr = Tensor::Empty({static_cast<int64_t>(rows[r].size()), c.model_dim});
    for (size_t i = 0; i < rows[r].size(); ++i) {
      std::copy_n(x.data<float>() + rows[r][i] * c.model_dim, c.model_dim,
                  xr.data<float>() + static_cast<int64_t>(i) * c.model_dim);
    }
    part[r] = GateForward(c, xr, params.gate_weight, {}, {0, 0, true, index[r]});
    std::vector<double> v = ComputeGateLossSums(c, part[r], t_num).ToVector();
    if (summed.empty()) summed.assign(v.size(), 0.0);
    ASSERT_EQ(v.size(), summed.size());
    for (size_t i = 0; i < v.size(); ++i) summed[i] += v[i];
  }
  GateLossSums batch = GateLossSums::FromVector(c, summed);
  EXPECT_NEAR(GateLossesFromSums(c, batch).l_aux, want.l_aux, 1e-6);
  for (size_t r = 0; r < 2; ++r) {
    Tensor dl = Tensor::Zeros({static_cast<int64_t>(rows[r].size()), c.num_experts});
    GateLossesBackward(c, part[r], 1.0f, 0.0f, dl, batch);
    for (size_t i = 0; i < rows[r].size(); ++i) {
      for (int64_t e = 0; e < c.num_experts; ++e) {
        EXPECT_NEAR(dl.data<float>()[static_cast<int64_t>(i) * c.num_experts + e],
                    want_dl.data<float>()[rows[r][i] * c.num_experts + e], 1e-7)
            << "rank " << r << " token " << rows[r][i] << " expert " << e;
      }
    }
  }
  EXPECT_THROW(ComputeGateLossSums(c, part[0], 10), InvalidArgument);  // not whole sequences
}

TEST(SequenceLoss, RowsNotWholeSequencesAreAnErrorNamingTheKey) {
  LayerConfig c = SmallConfig();
  c.aux_loss = AuxLoss::kSequence;
  c.sequence_length = 4;
  LayerParams params = InitParams(c, 4);
  try {
    MoeLayer(c).Forward(params, RandomX(6, c.model_dim, 1));
    FAIL() << "6 rows of sequences of 4 were accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("sequence_length"), std::string::npos) << e.what();
  }
}

// Megatron-Core's get_updated_expert_bias: bias + rate * sign(mean load - load), the mean over
// the experts of the step's global counts.
TEST(ExpertBiasUpdate, FollowsTheSignOfTheLoadBelowTheMean) {
  Tensor bias = Tensor::FromVector(std::vector<float>{0.1f, 0.0f, -0.2f}, {3});
  UpdateExpertBias(std::vector<int64_t>{7, 1, 4}, 0.25f, bias);  // mean 4
  const float* b = bias.data<float>();
  EXPECT_FLOAT_EQ(b[0], 0.1f - 0.25f);
  EXPECT_FLOAT_EQ(b[1], 0.0f + 0.25f);
  EXPECT_FLOAT_EQ(b[2], -0.2f);  // at the mean: unchanged
}

}  // namespace
}  // namespace switchyard::moe
