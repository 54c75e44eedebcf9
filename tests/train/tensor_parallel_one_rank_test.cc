// The tensor-parallel layers over one rank are the single-rank layers of train/layers.h bit for
// bit, in float32 and in bfloat16 mixed precision: the model (train/model.h) is built from them
// alone, so its tp 1 losses are the plain layers' to the last bit. Sizes are chosen so that the
// GEMMs block their inner dimension (in_dim > 384), where adding the bias before or after the
// product rounds differently.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "switchyard/comm/inprocess.h"
#include "switchyard/train/feed_forward.h"
#include "switchyard/train/layers.h"
#include "switchyard/train/tensor_parallel.h"
#include "testing/random.h"
#include "train/grad_check.h"

namespace switchyard::train {
namespace {

using testing::RandomTensor;

::testing::AssertionResult BitEqual(const Tensor& got, const Tensor& want) {
  if (got.shape() != want.shape()) {
    return ::testing::AssertionFailure() << "shapes differ: " << ShapeToString(got.shape())
                                         << " vs " << ShapeToString(want.shape());
  }
  if (got.dtype() != want.dtype()) return ::testing::AssertionFailure() << "dtypes differ";
  if (std::memcmp(got.raw(), want.raw(), got.nbytes()) != 0) {
    return ::testing::AssertionFailure() << "not bit-identical";
  }
  return ::testing::AssertionSuccess();
}

// Every parameter of `got` (a tensor-parallel layer's) equals the same-named one of `want` in
// value and gradient, and is not marked as a shard.
void ExpectSameParameters(const ParameterSet& got, const ParameterSet& want,
                          const std::string& who) {
  ASSERT_EQ(got.all().size(), want.all().size()) << who;
  for (size_t i = 0; i < want.all().size(); ++i) {
    const Parameter& w = want.all()[i];
    const Parameter& g = got.all()[i];
    EXPECT_EQ(g.name, w.name) << who << ": registration order";
    EXPECT_TRUE(BitEqual(g.value, w.value)) << who << " " << w.name << " value";
    EXPECT_TRUE(BitEqual(g.grad, w.grad)) << who << " " << w.name << " grad";
    EXPECT_FALSE(g.tp_shard.split()) << who << " " << w.name << ": one rank holds it whole";
  }
}

std::string Name(Precision p) { return p == Precision::kBFloat16 ? "bf16" : "fp32"; }

TEST(TensorParallelOneRank, LinearLayersAreLinearInBothPrecisions) {
  const int64_t in = 520, out = 24, n = 37;
  const Tensor x = RandomTensor({n, in}, 1), dy = RandomTensor({n, out}, 2);
  for (const Precision precision : {Precision::kFloat32, Precision::kBFloat16}) {
    comm::RunInProcess(1, [&](comm::Communicator& group) {
      ParameterSet ref_params, params;
      Linear ref_col(ref_params, "col.", in, out, true, 0.1f, 3);
      Linear ref_row(ref_params, "row.", in, out, true, 0.1f, 3);
      ColumnParallelLinear col(params, "col.", in, out, true, 0.1f, 3, group);
      RowParallelLinear row(params, "row.", in, out, true, 0.1f, 3, group);
      const Tensor bias = RandomTensor({out}, 4);
      for (Parameter* b : {ref_col.bias(), ref_row.bias(), col.local().bias(), row.bias()}) {
        b->value.CopyFrom(bias);
      }
      const std::string who = Name(precision);
      // The plain layers as the single-rank model runs them: bfloat16 inputs under mixed
      // precision.
      const Tensor xin = precision == Precision::kBFloat16 ? ToBFloat16(x) : x;
      ColumnParallelCache cc;
      EXPECT_TRUE(BitEqual(col.Forward(x, &cc, 1, nullptr, precision), ref_col.Forward(xin)))
          << who << " column y";
      EXPECT_TRUE(BitEqual(col.Backward(cc, dy), ref_col.Backward(xin, dy))) << who << " column dx";
      RowParallelCache rc;
      EXPECT_TRUE(BitEqual(row.Forward(xin, &rc, 1, nullptr, precision), ref_row.Forward(xin)))
          << who << " row y";
      EXPECT_TRUE(BitEqual(row.Backward(rc, dy), ref_row.Backward(xin, dy))) << who << " row dx";
      ExpectSameParameters(params, ref_params, who);
    });
  }
}

TEST(TensorParallelOneRank, AttentionAndMlpAreThePlainLayersInBothPrecisions) {
  const int64_t d = 32, heads = 4, hidden = 400, batch = 3, seq = 5, n = batch * seq;
  const Tensor x = RandomTensor({n, d}, 5), dy = RandomTensor({n, d}, 6);
  for (const Precision precision : {Precision::kFloat32, Precision::kBFloat16}) {
    comm::RunInProcess(1, [&](comm::Communicator& group) {
      const std::string who = Name(precision);
      ParameterSet ref_params, params;
      CausalSelfAttention ref_attn(ref_params, "attn.", d, heads, 0.2f, 0.1f, 7);
      DenseFeedForward ref_mlp(ref_params, "mlp.", d, hidden, kernels::Activation::kGelu, 0.2f,
                               0.1f, 7);
      TensorParallelAttention attn(params, "attn.", d, heads, 0.2f, 0.1f, 7, group, {});
      TensorParallelFeedForward mlp(params, "mlp.", d, hidden, kernels::Activation::kGelu, 0.2f,
                                    0.1f, 7, group, {});
      AttentionCache ref_ac, ac;
      EXPECT_TRUE(BitEqual(attn.Forward(x, batch, 2, &ac, precision),
                           ref_attn.Forward(x, batch, 2, &ref_ac, precision)))
          << who << " attention y";
      for (const auto& [got, want, what] :
           {std::tuple{ac.x, ref_ac.x, "x"}, std::tuple{ac.qkv, ref_ac.qkv, "qkv"},
            std::tuple{ac.probs, ref_ac.probs, "probs"}, std::tuple{ac.att, ref_ac.att, "att"}}) {
        EXPECT_TRUE(BitEqual(got, want)) << who << " attention cache " << what;
      }
      EXPECT_TRUE(BitEqual(attn.Backward(ac, dy, 2), ref_attn.Backward(ref_ac, dy, 2)))
          << who << " attention dx";

      FeedForwardContext context;
      context.precision = precision;
      context.threads = 2;
      FeedForwardOutput ref_out = ref_mlp.Forward(x, context), out = mlp.Forward(x, context);
      EXPECT_TRUE(BitEqual(out.y, ref_out.y)) << who << " mlp y";
      EXPECT_TRUE(BitEqual(mlp.Backward(out, dy, 1.0f, 2), ref_mlp.Backward(ref_out, dy, 1.0f, 2)))
          << who << " mlp dx";
      std::vector<Tensor> saved, ref_saved;
      mlp.SavedTensors(out, &saved);
      ref_mlp.SavedTensors(ref_out, &ref_saved);
      ASSERT_EQ(saved.size(), ref_saved.size());
      for (size_t i = 0; i < saved.size(); ++i) {
        EXPECT_TRUE(BitEqual(saved[i], ref_saved[i])) << who << " mlp saved tensor " << i;
      }
      ExpectSameParameters(params, ref_params, who);
    });
  }
}

TEST(TensorParallelOneRank, VocabParallelLossIsTheSoftmaxCrossEntropy) {
  const int64_t n = 29, vocab = 300;
  const Tensor logits = RandomTensor({n, vocab}, 8);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[static_cast<size_t>(i)] = i % 7 == 3 ? -1 : (i * 37) % vocab;
  const Tensor targets = Tensor::FromVector(t, {n});
  comm::RunInProcess(1, [&](comm::Communicator& group) {
    for (const int threads : {1, 3}) {
      Tensor d, ref_d;
      const CrossEntropyResult got =
          VocabParallelLoss(group, logits, targets, vocab, &d, 0.5f, threads);
      const CrossEntropyResult want = SoftmaxCrossEntropy(logits, targets, &ref_d, 0.5f, threads);
      EXPECT_EQ(got.loss, want.loss) << threads << " threads";  // the same double, exactly
      EXPECT_EQ(got.count, want.count);
      EXPECT_TRUE(BitEqual(d, ref_d)) << threads << " threads: dlogits";
    }
  });
}

}  // namespace
}  // namespace switchyard::train
