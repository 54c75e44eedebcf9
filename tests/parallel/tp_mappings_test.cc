// The tensor- and sequence-parallel pairs (parallel/tp_mappings.h) on ranks as threads, group
// sizes 1..4 with odd row counts: every Forward and Backward equals the plain math on the
// gathered per-rank values (gather = concatenation, reduce = sum, swap = the Ulysses
// permutation), Backward is the adjoint of Forward (<F(x), y> == <x, B(y)> up to float order),
// one rank is the identity without a copy, the bytes follow the closed forms and bad shapes are
// errors naming the pair.
#include "switchyard/parallel/tp_mappings.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "switchyard/comm/inprocess.h"
#include "switchyard/core/error.h"
#include "testing/random.h"

namespace switchyard::parallel {
namespace {

using Vec = std::vector<float>;

constexpr int64_t kCols = 7;
constexpr double kTol = 1e-5;

Tensor Random(Shape shape, uint64_t seed) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return Tensor::FromVector(testing::RandomVector(static_cast<size_t>(n), seed), shape);
}

Vec ToVec(const Tensor& t) {
  const float* p = t.data<float>();
  return Vec(p, p + t.numel());
}

double Dot(const Vec& a, const Vec& b) {
  EXPECT_EQ(a.size(), b.size());
  double s = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

// What each rank of a pair's run saw and produced.
struct PairRun {
  std::vector<Vec> x, fx, dy, bdy;  // [rank]: Forward's input and output, Backward's input, output
  std::vector<CommStats> forward_stats, backward_stats;
};

// Runs Forward on x_r = make_x(r) and Backward on dy_r = make_dy(r) on each of `p` ranks.
PairRun RunPair(int p, const std::function<Tensor(int)>& make_x,
                const std::function<Tensor(int)>& make_dy,
                const std::function<Tensor(comm::Communicator&, const Tensor&, CommStats*)>& fwd,
                const std::function<Tensor(comm::Communicator&, const Tensor&, CommStats*)>& bwd) {
  PairRun run;
  for (auto* v : {&run.x, &run.fx, &run.dy, &run.bdy}) v->resize(static_cast<size_t>(p));
  run.forward_stats.resize(static_cast<size_t>(p));
  run.backward_stats.resize(static_cast<size_t>(p));
  comm::RunInProcess(p, [&](comm::Communicator& group) {
    const auto r = static_cast<size_t>(group.rank());
    Tensor x = make_x(group.rank()), dy = make_dy(group.rank());
    run.x[r] = ToVec(x);  // before the call: some pairs work in place
    run.dy[r] = ToVec(dy);
    run.fx[r] = ToVec(fwd(group, x, &run.forward_stats[r]));
    run.bdy[r] = ToVec(bwd(group, dy, &run.backward_stats[r]));
  });
  return run;
}

Vec Sum(const std::vector<Vec>& parts) {
  Vec s(parts[0].size(), 0.0f);
  for (const Vec& v : parts)
    for (size_t i = 0; i < s.size(); ++i) s[i] += v[i];
  return s;
}
Vec Concat(const std::vector<Vec>& parts) {
  Vec c;
  for (const Vec& v : parts) c.insert(c.end(), v.begin(), v.end());
  return c;
}
Vec Block(const Vec& v, int p, int r) {
  const size_t n = v.size() / static_cast<size_t>(p);
  return Vec(v.begin() + static_cast<std::ptrdiff_t>(n * r),
             v.begin() + static_cast<std::ptrdiff_t>(n * (r + 1)));
}
// <a, b> summed over ranks (per-rank and sharded values).
double DotRanks(const std::vector<Vec>& a, const std::vector<Vec>& b) {
  double s = 0;
  for (size_t r = 0; r < a.size(); ++r) s += Dot(a[r], b[r]);
  return s;
}
void ExpectClose(const Vec& got, const Vec& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  EXPECT_TRUE(testing::AllClose(got, want, kTol, kTol)) << what;
}
void ExpectAdjoint(double forward_side, double backward_side, const std::string& what) {
  EXPECT_NEAR(forward_side, backward_side, 1e-4 * (1 + std::abs(forward_side))) << what;
}

class TpMappingsTest : public ::testing::TestWithParam<int> {
 protected:
  int p() const { return GetParam(); }
  // Rows of a full (unsharded) tensor: odd for odd group sizes.
  int64_t rows() const { return 3 * p(); }
  Tensor Replicated(uint64_t seed) const { return Random({rows(), kCols}, seed); }
  std::function<Tensor(int)> Same(Shape s, uint64_t seed) const {
    return [=](int) { return Random(s, seed); };
  }
  std::function<Tensor(int)> PerRank(Shape s, uint64_t seed) const {
    return [=](int r) { return Random(s, seed + 100 * static_cast<uint64_t>(r + 1)); };
  }
  double Bytes(const CommStats& s) const { return s.Bytes(Traffic::kTensor); }
  double Size(int64_t r) const { return 4.0 * static_cast<double>(r * kCols); }
};

TEST_P(TpMappingsTest, CopyToTpIsIdentityThenAllReduce) {
  const PairRun run = RunPair(p(), Same({rows(), kCols}, 1), PerRank({rows(), kCols}, 2),
                              CopyToTp::Forward, CopyToTp::Backward);
  const Vec sum = Sum(run.dy);
  for (int r = 0; r < p(); ++r) {
    EXPECT_EQ(run.fx[r], run.x[r]);
    ExpectClose(run.bdy[r], sum, "backward = sum of dy, rank " + std::to_string(r));
    EXPECT_EQ(Bytes(run.forward_stats[r]), 0);
    EXPECT_DOUBLE_EQ(Bytes(run.backward_stats[r]), 2.0 * (p() - 1) / p() * Size(rows()));
  }
  // x replicated (counted once), dy per rank.
  ExpectAdjoint(DotRanks(run.fx, run.dy), Dot(run.x[0], run.bdy[0]), "adjoint");
}

TEST_P(TpMappingsTest, ReduceFromTpIsAllReduceThenIdentity) {
  const PairRun run = RunPair(p(), PerRank({rows(), kCols}, 3), Same({rows(), kCols}, 4),
                              ReduceFromTp::Forward, ReduceFromTp::Backward);
  const Vec sum = Sum(run.x);
  for (int r = 0; r < p(); ++r) {
    ExpectClose(run.fx[r], sum, "forward = sum of x, rank " + std::to_string(r));
    EXPECT_EQ(run.bdy[r], run.dy[r]);
    EXPECT_DOUBLE_EQ(Bytes(run.forward_stats[r]), 2.0 * (p() - 1) / p() * Size(rows()));
    EXPECT_EQ(Bytes(run.backward_stats[r]), 0);
  }
  ExpectAdjoint(Dot(run.fx[0], run.dy[0]), DotRanks(run.x, run.bdy), "adjoint");
}

TEST_P(TpMappingsTest, ScatterToSpIsSplitThenAllGather) {
  const PairRun run = RunPair(p(), Same({rows(), kCols}, 5), PerRank({rows() / p(), kCols}, 6),
                              ScatterToSp::Forward, ScatterToSp::Backward);
  const Vec gathered = Concat(run.dy);
  for (int r = 0; r < p(); ++r) {
    EXPECT_EQ(run.fx[r], Block(run.x[r], p(), r));
    EXPECT_EQ(run.bdy[r], gathered);
    EXPECT_EQ(Bytes(run.forward_stats[r]), 0);
    EXPECT_DOUBLE_EQ(Bytes(run.backward_stats[r]), (p() - 1) * Size(rows() / p()));
  }
  ExpectAdjoint(DotRanks(run.fx, run.dy), Dot(run.x[0], run.bdy[0]), "adjoint");
}

TEST_P(TpMappingsTest, GatherFromSpIsAllGatherThenReduceScatter) {
  const PairRun run = RunPair(p(), PerRank({rows() / p(), kCols}, 7), PerRank({rows(), kCols}, 8),
                              GatherFromSp::Forward, GatherFromSp::Backward);
  const Vec gathered = Concat(run.x), sum = Sum(run.dy);
  for (int r = 0; r < p(); ++r) {
    EXPECT_EQ(run.fx[r], gathered);
    ExpectClose(run.bdy[r], Block(sum, p(), r), "backward = rows r of the sum");
    EXPECT_DOUBLE_EQ(Bytes(run.forward_stats[r]), (p() - 1) * Size(rows() / p()));
    EXPECT_DOUBLE_EQ(Bytes(run.backward_stats[r]), (p() - 1.0) / p() * Size(rows()));
  }
  ExpectAdjoint(DotRanks(run.fx, run.dy), DotRanks(run.x, run.bdy), "adjoint");
}

TEST_P(TpMappingsTest, ReduceScatterToSpIsReduceScatterThenAllGather) {
  const PairRun run = RunPair(p(), PerRank({rows(), kCols}, 9), PerRank({rows() / p(), kCols}, 10),
                              ReduceScatterToSp::Forward, ReduceScatterToSp::Backward);
  const Vec sum = Sum(run.x), gathered = Concat(run.dy);
  for (int r = 0; r < p(); ++r) {
    ExpectClose(run.fx[r], Block(sum, p(), r), "forward = rows r of the sum");
    EXPECT_EQ(run.bdy[r], gathered);
    EXPECT_DOUBLE_EQ(Bytes(run.forward_stats[r]), (p() - 1.0) / p() * Size(rows()));
    EXPECT_DOUBLE_EQ(Bytes(run.backward_stats[r]), (p() - 1) * Size(rows() / p()));
  }
  ExpectAdjoint(DotRanks(run.fx, run.dy), DotRanks(run.x, run.bdy), "adjoint");
}

// Ulysses: rank q's local row b * n + i is row q * n + i of sequence b; head group r is columns
// [r * wl, (r + 1) * wl) of each of the `parts` parts of width W = P * wl.
TEST_P(TpMappingsTest, UlyssesSwapIsTheSequenceHeadPermutation) {
  const int64_t batch = 2, parts = 3, n = 3, wl = 2, w = p() * wl, pw = parts * wl;
  const PairRun run = RunPair(
      p(), PerRank({batch * n, parts * w}, 11), PerRank({batch * p() * n, pw}, 12),
      [&](comm::Communicator& g, const Tensor& x, CommStats* s) {
        return UlyssesSwap::Forward(g, x, batch, parts, s);
      },
      [&](comm::Communicator& g, const Tensor& dy, CommStats* s) {
        return UlyssesSwap::Backward(g, dy, batch, parts, s);
      });
  for (int r = 0; r < p(); ++r) {
    Vec fx(static_cast<size_t>(batch * p() * n * pw)),
        bdy(static_cast<size_t>(batch * n * parts * w));
    for (int q = 0; q < p(); ++q)
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t i = 0; i < n; ++i)
          for (int64_t f = 0; f < parts; ++f)
            for (int64_t k = 0; k < wl; ++k) {
              const size_t head_sharded =
                  static_cast<size_t>((b * p() * n + q * n + i) * pw + f * wl + k);
              fx[head_sharded] =
                  run.x[q][static_cast<size_t>((b * n + i) * parts * w + f * w + r * wl + k)];
              bdy[static_cast<size_t>((b * n + i) * parts * w + f * w + q * wl + k)] =
                  run.dy[q][static_cast<size_t>((b * p() * n + r * n + i) * pw + f * wl + k)];
            }
    EXPECT_EQ(run.fx[r], fx) << "forward, rank " << r;
    EXPECT_EQ(run.bdy[r], bdy) << "backward, rank " << r;
    const double expected = (p() - 1.0) / p() * 4.0 * static_cast<double>(fx.size());
    EXPECT_DOUBLE_EQ(run.forward_stats[r].Bytes(Traffic::kContext), expected);
    EXPECT_DOUBLE_EQ(run.backward_stats[r].Bytes(Traffic::kContext), expected);
  }
  ExpectAdjoint(DotRanks(run.fx, run.dy), DotRanks(run.x, run.bdy), "adjoint");
}

INSTANTIATE_TEST_SUITE_P(GroupSizes, TpMappingsTest, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& param_info) {
                           return "tp" + std::to_string(param_info.param);
                         });

// One rank: every Forward and Backward returns its argument (same storage, no collective).
TEST(TpMappingsOneRankTest, EveryPairIsTheIdentity) {
  comm::RunInProcess(1, [](comm::Communicator& g) {
    Tensor x = Random({5, kCols}, 13), u = Random({5, 6}, 14);
    CommStats stats;
    for (const Tensor& t :
         {CopyToTp::Forward(g, x, &stats), CopyToTp::Backward(g, x, &stats),
          ReduceFromTp::Forward(g, x, &stats), ReduceFromTp::Backward(g, x, &stats),
          ScatterToSp::Forward(g, x, &stats), ScatterToSp::Backward(g, x, &stats),
          GatherFromSp::Forward(g, x, &stats), GatherFromSp::Backward(g, x, &stats),
          ReduceScatterToSp::Forward(g, x, &stats), ReduceScatterToSp::Backward(g, x, &stats)}) {
      EXPECT_EQ(t.data<float>(), x.data<float>());
      EXPECT_EQ(t.shape(), x.shape());
    }
    EXPECT_EQ(UlyssesSwap::Forward(g, u, 5, 3, &stats).data<float>(), u.data<float>());
    EXPECT_EQ(UlyssesSwap::Backward(g, u, 1, 2, &stats).data<float>(), u.data<float>());
    EXPECT_EQ(stats.collectives, 0);
    EXPECT_EQ(stats.TotalBytes(), 0);
  });
}

// Rows that do not divide by P, and Ulysses shapes that do not split: errors naming the pair,
// raised before any collective (every rank throws; none waits for the others).
TEST(TpMappingsErrorsTest, ShapesThatDoNotSplitNameThePair) {
  auto message = [](const std::function<void(comm::Communicator&)>& call) {
    try {
      comm::RunInProcess(2, call);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const Tensor odd = Random({5, kCols}, 15);
  std::string m = message([&](comm::Communicator& g) { ScatterToSp::Forward(g, odd); });
  EXPECT_NE(m.find("ScatterToSp forward: x: 5 rows do not divide by the size 2"), std::string::npos)
      << m;
  m = message([&](comm::Communicator& g) { GatherFromSp::Backward(g, odd); });
  EXPECT_NE(m.find("GatherFromSp backward: dy: 5 rows"), std::string::npos) << m;
  m = message([&](comm::Communicator& g) { ReduceScatterToSp::Forward(g, odd); });
  EXPECT_NE(m.find("ReduceScatterToSp forward: x: 5 rows"), std::string::npos) << m;
  // 7 columns of 1 part do not split over 2 ranks; 5 rows are not 2 sequences.
  m = message([&](comm::Communicator& g) { UlyssesSwap::Forward(g, odd, 5, 1); });
  EXPECT_NE(m.find("UlyssesSwap forward: x: 7 columns"), std::string::npos) << m;
  m = message([&](comm::Communicator& g) { UlyssesSwap::Backward(g, odd, 2, 7); });
  EXPECT_NE(m.find("UlyssesSwap backward: dy: 5 rows"), std::string::npos) << m;
  m = message(
      [&](comm::Communicator& g) { CopyToTp::Backward(g, Tensor::Zeros({4}, DType::kInt32)); });
  EXPECT_NE(m.find("CopyToTp backward: dy"), std::string::npos) << m;
}

}  // namespace
}  // namespace switchyard::parallel
