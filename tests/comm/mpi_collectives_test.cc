// The collective suite of collectives_test.cc on the MPI transport, plus MPI's own collectives
// (Algorithm::kNative), Split, and fault injection. Run under mpirun, every rank executing the
// same tests in the same order:
//   scripts/mpirun.sh -np 4 build/release/tests/comm/comm_mpi_test
// CTest runs it with -np 2 and -np 4 (label "mpi").
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

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
      std::string what = e.what();
      EXPECT_NE(what.find("allreduce"), std::string::npos) << what;
      EXPECT_NE(what.find("'faulty'"), std::string::npos) << what;
      EXPECT_NE(what.find("rank"), std::string::npos) << what;
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
  EXPECT_FALSE(what.empty());
  // Rank 0's ring neighbours see the other collective by name.
  if (world.rank() == 1) {
    EXPECT_NE(what.find("allgather"), std::string::npos) << what;
  }
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
  EXPECT_FALSE(what.empty());
  if (world.rank() == 0 || world.rank() == 1) {
    EXPECT_NE(what.find("mismatched sizes"), std::string::npos) << what;
  }
  group.reset();
  world.Barrier().Wait();
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
