// The flash attention core (train/attention_flash.h) against the softmax core of train/layers.h
// (CausalAttentionForward/Backward): outputs and d(qkv) at odd sequence lengths that leave partial
// query and key tiles, head_dims that are not multiples of 16, several sequences and heads, and
// grouped-query inputs (k, v shared by groups of heads); the gradients against finite differences;
// the tile product against plain loops.
#include "train/attention_flash.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "switchyard/train/context_parallel.h"
#include "switchyard/train/layers.h"
#include "train/grad_check.h"

namespace switchyard::train {
namespace {

using testing::CheckGradient;
using testing::Dot;
using testing::RandomTensor;

::testing::AssertionResult AllClose(const std::string& what, const Tensor& got, const Tensor& want,
                                    double rtol = 1e-4, double atol = 2e-5) {
  if (got.shape() != want.shape())
    return ::testing::AssertionFailure() << what << ": shapes differ";
  for (int64_t i = 0; i < got.numel(); ++i) {
    const float g = got.data<float>()[i], w = want.data<float>()[i];
    if (!(std::abs(g - w) <= atol + rtol * std::abs(w)))
      return ::testing::AssertionFailure()
             << what << ": element " << i << " is " << g << ", expected " << w;
  }
  return ::testing::AssertionSuccess();
}

// The one-rank flash core over the plain split (any length).
ContextParallelAttention Flash(int64_t heads, int64_t seq) {
  return ContextParallelAttention(heads, seq,
                                  {CpAlgorithm::kRing, SequenceSplitKind::kPlain, /*causal=*/true});
}

// qkv [batch * seq, 3 * heads * hd] whose k and v columns repeat every `group` heads (grouped-
// query attention as the softmax core sees it: each kv head expanded to its query heads).
Tensor GroupedQkv(int64_t rows, int64_t heads, int64_t hd, int64_t group, uint64_t seed) {
  Tensor qkv = RandomTensor({rows, 3 * heads * hd}, seed);
  float* p = qkv.data<float>();
  const int64_t d = heads * hd;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t part = 1; part < 3; ++part)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t c = 0; c < hd; ++c)
          p[i * 3 * d + part * d + h * hd + c] =
              p[i * 3 * d + part * d + (h / group) * group * hd + c];
  return qkv;
}

struct Case {
  int64_t batch, seq, heads, hd, group;
};

TEST(FlashAttention, EqualsSoftmaxCoreForwardAndGradients) {
  const std::vector<Case> cases = {{1, 1, 1, 4, 1},   {2, 7, 3, 5, 1},   {1, 64, 2, 16, 1},
                                   {2, 65, 2, 20, 1}, {1, 130, 4, 8, 2}, {1, 201, 2, 64, 1},
                                   {3, 97, 4, 12, 4}, {1, 256, 1, 33, 1}};
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message()
                 << "batch " << c.batch << " seq " << c.seq << " heads " << c.heads << " head_dim "
                 << c.hd << " kv group " << c.group);
    const int64_t rows = c.batch * c.seq, d = c.heads * c.hd;
    const Tensor qkv = GroupedQkv(rows, c.heads, c.hd, c.group, 11 + c.seq);
    const Tensor datt = RandomTensor({rows, d}, 5 + c.seq);
    Tensor probs;
    const Tensor want = CausalAttentionForward(qkv, c.batch, c.heads, 2, &probs);
    const Tensor want_d = CausalAttentionBackward(qkv, probs, datt, c.batch, c.heads, 2);
    for (int threads : {1, 3}) {
      const ContextParallelAttention flash = Flash(c.heads, c.seq);
      ContextParallelCache cache;
      const Tensor got = flash.Forward(qkv, c.batch, &cache, threads);
      EXPECT_TRUE(AllClose("att", got, want));
      EXPECT_TRUE(AllClose("d(qkv)", flash.Backward(cache, datt, threads), want_d, 2e-4, 5e-5));
    }
  }
}

// The zigzag split (what `attention_core flash` runs on one rank) at lengths spanning several
// tiles per chunk.
TEST(FlashAttention, ZigzagSplitEqualsSoftmaxCore) {
  for (int64_t seq : {2, 66, 258}) {
    SCOPED_TRACE(::testing::Message() << "seq " << seq);
    const Tensor qkv = RandomTensor({seq, 3 * 2 * 24}, seq);
    const Tensor datt = RandomTensor({seq, 2 * 24}, seq + 1);
    Tensor probs;
    const Tensor want = CausalAttentionForward(qkv, 1, 2, 1, &probs);
    const ContextParallelAttention flash(2, seq);
    ContextParallelCache cache;
    EXPECT_TRUE(AllClose("att", flash.Forward(qkv, 1, &cache, 2), want));
    EXPECT_TRUE(AllClose("d(qkv)", flash.Backward(cache, datt, 2),
                         CausalAttentionBackward(qkv, probs, datt, 1, 2, 1), 2e-4, 5e-5));
  }
}

// d(sum(att * datt)) / d(qkv) against central differences, across a tile boundary.
TEST(FlashAttention, GradientMatchesFiniteDifferences) {
  constexpr int64_t kSeq = 70, kHeads = 2, kHd = 3;
  const Tensor qkv = RandomTensor({kSeq, 3 * kHeads * kHd}, 21, -2.0f, 2.0f);
  const Tensor datt = RandomTensor({kSeq, kHeads * kHd}, 22);
  const ContextParallelAttention flash = Flash(kHeads, kSeq);
  ContextParallelCache cache;
  (void)flash.Forward(qkv, 1, &cache, 1);
  const Tensor grad = flash.Backward(cache, datt, 1);
  auto loss = [&] {
    ContextParallelCache c;
    return Dot(flash.Forward(qkv, 1, &c, 1), datt);
  };
  EXPECT_TRUE(CheckGradient("d(qkv)", loss, qkv, grad, 1e-2, 2e-2, 2e-3, 200));
}

TEST(FlashAttention, TileGemmEqualsPlainProduct) {
  for (bool trans : {false, true})
    for (int64_t m : {1, 5, 6, 13, 64})
      for (int64_t n : {16, 48, 64})
        for (int64_t k : {1, 7, 64})
          for (bool accumulate : {false, true}) {
            // A [m, k] rows lda = k + 3 apart, or stored [k, m] rows lda = m + 3 apart.
            const int64_t lda = trans ? m + 3 : k + 3;
            const Tensor a = RandomTensor({trans ? k : m, lda}, m * 100 + k);
            const Tensor b = RandomTensor({k, n}, n);
            Tensor c = RandomTensor({m, n + 1}, 7), want = Tensor::Empty({m, n + 1});
            for (int64_t i = 0; i < m; ++i)
              for (int64_t j = 0; j <= n; ++j) {
                double s = accumulate || j == n ? c.data<float>()[i * (n + 1) + j] : 0.0;
                for (int64_t p = 0; j < n && p < k; ++p)  // column n is outside C: untouched
                  s += static_cast<double>(a.data<float>()[trans ? p * lda + i : i * lda + p]) *
                       b.data<float>()[p * n + j];
                want.data<float>()[i * (n + 1) + j] = static_cast<float>(s);
              }
            internal::FlashTileGemm(trans, m, n, k, a.data<float>(), lda, b.data<float>(),
                                    c.data<float>(), n + 1, accumulate);
            EXPECT_TRUE(AllClose(fmt::format("trans {} m {} n {} k {}", trans, m, n, k), c, want,
                                 1e-5, 1e-5));
          }
}

}  // namespace
}  // namespace switchyard::train
