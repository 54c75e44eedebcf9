// The collective suite of collectives_test.cc on the MPI transport, plus MPI's own collectives
// (Algorithm::kNative), Split, and fault injection. Run under mpirun, every rank executing the
// same tests in the same order:
//   scripts/mpirun.sh -np 4 build/release/tests/comm/comm_mpi_test
// CTest runs it with -np 2 and -np 4 (label "mpi").
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/collective_cases.h"
#include "switchyard/comm/communicator.h"
#include "switchyard/comm/mpi.h"
#include "switchyard/core/error.h"

namespace switchyard::comm {
namespace {

Communicator* g_world = nullptr;

constexpr size_t kLarge = 65537;

class MpiCollectivesTest : public ::testing::TestWithParam<CollectiveKind> {};

TEST_P(MpiCollectivesTest, MatchesReference) {
  Communicator& world = *g_world;
  for (const testing::Case& c :
       testing::CasesFor(GetParam(), world.size(), /*native=*/true, kLarge)) {
    EXPECT_TRUE(testing::RunCase(world, c));
  }
}

INSTANTIATE_TEST_SUITE_P(Mpi, MpiCollectivesTest, ::testing::ValuesIn(testing::CoveredKinds()),
                         [](const ::testing::TestParamInfo<CollectiveKind>& param_info) {
                           return std::string(CollectiveName(param_info.param));
                         });

TEST(MpiCommunicator, DetectsMpiAndReportsTopology) {
  EXPECT_TRUE(RunningUnderMpi());
  EXPECT_EQ(g_world->transport_kind(), "mpi");
  Topology t = g_world->topology();
  EXPECT_EQ(t.nodes * t.ranks_per_node, g_world->size());
}

TEST(MpiCommunicator, SplitIntoEvenAndOddRanks) {
  Communicator& world = *g_world;
  const int r = world.rank();
  std::unique_ptr<Communicator> half = world.Split(r % 2, /*key=*/-r, "parity");
  ASSERT_NE(half, nullptr);
  EXPECT_EQ(half->name(), "parity");
  EXPECT_EQ(half->size(), (world.size() + 1 - r % 2) / 2);
  // Ordered by key = -rank: the highest world rank of each parity is rank 0.
  int64_t mine = r, sum = 0;
  half->AllReduce(&mine, &sum, 1, DType::kInt64).Wait();
  int64_t expected = 0;
  for (int p = r % 2; p < world.size(); p += 2) expected += p;
  EXPECT_EQ(sum, expected);
  std::unique_ptr<Communicator> none = world.Split(r == 0 ? Communicator::kNoColor : 0, r);
  EXPECT_EQ(none == nullptr, r == 0);
}

TEST(MpiCommunicator, AsyncCollectivesRunInOrder) {
  Communicator& world = *g_world;
  std::vector<int32_t> a(1000, world.rank()), b(1000, 1);
  Work wa = world.AllReduce(a.data(), a.data(), a.size(), DType::kInt32);
  Work wb = world.AllReduce(b.data(), b.data(), b.size(), DType::kInt32,
                            {.reduce_op = ReduceOp::kMax, .algorithm = Algorithm::kNative});
  wb.Wait();
  wa.Wait();
  int32_t w = world.size();
  EXPECT_EQ(a[999], w * (w - 1) / 2);
  EXPECT_EQ(b[0], 1);
}

// "rank 3 (world rank 3)" for a group whose ranks are the world's.
std::string MissingName(int rank) {
  return "rank " + std::to_string(rank) + " (world rank " + std::to_string(rank) + ")";
}

// The error `what` of this rank contains every one of `parts`.
void ExpectNames(const std::string& what, const std::vector<std::string>& parts) {
  EXPECT_FALSE(what.empty()) << "no error";
  for (const std::string& part : parts) {
    EXPECT_NE(what.find(part), std::string::npos) << "does not name '" << part << "': " << what;
  }
}

// A rank that never joins: the others fail within their deadline, naming it.
TEST(MpiFaults, MissingPeerTimesOutNamingIt) {
  Communicator& world = *g_world;
  const int missing = world.size() - 1;
  std::unique_ptr<Communicator> group = world.Split(0, world.rank(), "faulty");
  if (world.rank() != missing) {
    std::vector<float> x(16, 1.0f);
    auto t0 = std::chrono::steady_clock::now();
    try {
      group
          ->AllReduce(x.data(), x.data(), x.size(), DType::kFloat32,
                      {.timeout = Milliseconds(1500)})
          .Wait();
      ADD_FAILURE() << "allreduce without rank " << missing << " succeeded";
    } catch (const Error& e) {
      // Split keyed by world rank: group rank == world rank. Only some ranks wait for the
      // missing one; the timeout consensus lets every rank name it.
      ExpectNames(e.what(), {"allreduce (", "group 'faulty'", MissingName(missing)});
    }
    double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_LT(seconds, 10.0);
  }
  group.reset();
  world.Barrier().Wait();
}

// A rank calling another collective: reported as such, never corrupting memory.
TEST(MpiFaults, DifferentCollectiveIsReported) {
  Communicator& world = *g_world;
  std::unique_ptr<Communicator> group = world.Split(0, world.rank(), "mixed");
  std::vector<float> x(64, 1.0f), y(64 * static_cast<size_t>(world.size()), 0.0f);
  std::string what;
  try {
    if (world.rank() == 0) {
      group
          ->AllGather(x.data(), y.data(), x.size(), DType::kFloat32,
                      {.timeout = Milliseconds(1500)})
          .Wait();
    } else {
      group
          ->AllReduce(x.data(), x.data(), x.size(), DType::kFloat32,
                      {.algorithm = Algorithm::kRing, .timeout = Milliseconds(1500)})
          .Wait();
    }
  } catch (const Error& e) {
    what = e.what();
  }
  // Every rank names its own collective and the group; the allreduce ranks name rank 0 and the
  // allgather it called (rank 1 directly, the others through a peer's failure notice). Rank 0,
  // the odd one, fails too (a ring message in its allgather, or a peer's notice).
  if (world.rank() == 0) {
    ExpectNames(what, {"allgather (", "group 'mixed'"});
  } else {
    ExpectNames(what, {"allreduce (ring", "group 'mixed'", MissingName(0), "allgather"});
  }
  if (world.rank() == 1) ExpectNames(what, {"rank 0 (world rank 0) called allgather"});
  group.reset();
  world.Barrier().Wait();
}

TEST(MpiFaults, MismatchedSizesAreReported) {
  Communicator& world = *g_world;
  std::unique_ptr<Communicator> group = world.Split(0, world.rank(), "sizes");
  std::vector<int32_t> x(world.rank() == 0 ? 100 : 50, 1);
  std::string what;
  try {
    group
        ->AllReduce(x.data(), x.data(), x.size(), DType::kInt32,
                    {.algorithm = Algorithm::kTree, .timeout = Milliseconds(1500)})
        .Wait();
  } catch (const Error& e) {
    what = e.what();
  }
  // Rank 0 sees rank 1's 50 elements where it expects 100; the others learn it from rank 0's
  // failure notice.
  ExpectNames(what, {"allreduce (tree", "group 'sizes'", "mismatched sizes"});
  if (world.rank() == 0) {
    ExpectNames(what, {"rank 1 (world rank 1) called allreduce with 50 x int32, this rank with "
                       "100 x int32"});
  }
  group.reset();
  world.Barrier().Wait();
}

// All-to-all-v where one receiver disagrees with rank 1 about rank 1's count (6 elements): it
// expects 9 (more) or 4 (fewer). That receiver reports mismatched sizes naming rank 1; nothing is
// written outside the blocks each rank declared. Rank 1 itself may finish without error (its
// output is right; under MPI a sender does not learn the receiver's size).
TEST(MpiFaults, MismatchedAllToAllVCountsAreReported) {
  Communicator& world = *g_world;
  const int w = world.size(), r = world.rank();
  constexpr int64_t kRows = 6, kStride = kRows + 3 + 8;
  constexpr float kSentinel = -7.0f;
  const int fewer_receiver = w > 2 ? 2 : 0;
  for (Algorithm algorithm : {Algorithm::kPairwise, Algorithm::kLinear}) {
    for (const auto& [receiver, expected] :
         {std::pair{0, kRows + 3}, std::pair{fewer_receiver, kRows - 2}}) {
      SCOPED_TRACE(fmt::format("{}, rank {} expects {} from rank 1", AlgorithmName(algorithm),
                               receiver, expected));
      std::unique_ptr<Communicator> group = world.Split(0, r, "v");
      const auto uw = static_cast<size_t>(w);
      std::vector<int64_t> sc(uw, kRows), rc(uw, kRows), rd(uw);
      if (r == receiver) rc[1] = expected;
      for (size_t q = 0; q < uw; ++q) rd[q] = static_cast<int64_t>(q) * kStride;
      std::vector<float> in(uw * kRows, static_cast<float>(r + 1));
      std::vector<float> out(uw * kStride, kSentinel);
      std::string what;
      try {
        group
            ->AllToAllV(in.data(), sc, {}, out.data(), rc, rd, DType::kFloat32,
                        {.algorithm = algorithm, .timeout = Milliseconds(3000)})
            .Wait();
      } catch (const Error& e) {
        what = e.what();
      }
      for (size_t q = 0; q < uw; ++q) {
        for (int64_t i = rd[q] + rc[q]; i < rd[q] + kStride; ++i) {
          EXPECT_EQ(out[static_cast<size_t>(i)], kSentinel)
              << "element " << i << " past the block of rank " << q << " was written";
        }
      }
      const std::string collective = fmt::format("alltoallv ({}", AlgorithmName(algorithm));
      if (r == receiver) {
        ExpectNames(what, {collective, "group 'v'",
                           fmt::format("mismatched sizes: rank 1 (world rank 1) sent 24 bytes (6 x "
                                       "float32) in alltoallv, this rank expected {} bytes",
                                       expected * 4)});
      } else if (!what.empty()) {
        ExpectNames(what, {collective, "group 'v'"});
      }
      group.reset();
      world.Barrier().Wait();
    }
  }
}

// bfloat16 reductions accumulate in float32 on the MPI transport too, MPI's own (native) included.
TEST(MpiBFloat16, ReductionsAccumulateInFloat32) {
  Communicator& world = *g_world;
  struct Run {
    CollectiveKind kind;
    Algorithm algorithm;
  };
  const std::vector<Run> runs = {
      {CollectiveKind::kAllReduce, Algorithm::kRing},
      {CollectiveKind::kAllReduce, Algorithm::kTree},
      {CollectiveKind::kAllReduce, Algorithm::kNative},
      {CollectiveKind::kReduce, Algorithm::kTree},
      {CollectiveKind::kReduce, Algorithm::kReduceScatterGather},
      {CollectiveKind::kReduce, Algorithm::kNative},
      {CollectiveKind::kReduceScatter, Algorithm::kRing},
      {CollectiveKind::kReduceScatter, Algorithm::kNative},
  };
  for (const Run& run : runs) {
    for (size_t count : {size_t{1}, size_t{37}, size_t{5003}}) {
      EXPECT_TRUE(testing::RunBFloat16SumCase(world, run.kind, run.algorithm, count));
    }
  }
}

// Prints failures of ranks other than 0, prefixed with the rank (rank 0 prints everything).
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (result.failed()) {
      std::fprintf(stderr, "[rank %d] %s:%d: %s\n", rank_,
                   result.file_name() ? result.file_name() : "", result.line_number(),
                   result.summary());
    }
  }

 private:
  int rank_;
};

}  // namespace
}  // namespace switchyard::comm

int main(int argc, char** argv) {
  using namespace switchyard::comm;
  ::testing::InitGoogleTest(&argc, argv);
  if (!RunningUnderMpi()) {
    std::fprintf(stderr, "comm_mpi_test: run me under MPI, e.g. scripts/mpirun.sh -np 4 %s\n",
                 argv[0]);
    return 2;
  }
  std::unique_ptr<Communicator> world = CreateMpiWorld({.timeout = Milliseconds(120000)});
  g_world = world.get();
  if (world->rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(world->rank()));
  }
  int rc = RUN_ALL_TESTS();
  // Every rank exits with the worst result of all.
  int32_t worst = rc;
  world->AllReduce(&worst, &worst, 1, switchyard::DType::kInt32, {.reduce_op = ReduceOp::kMax})
      .Wait();
  g_world = nullptr;
  world.reset();
  FinalizeMpi();
  return worst;
}
