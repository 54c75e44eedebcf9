// Fault injection on the in-process transport: a rank that stops, never arrives, throws, calls a
// different collective or passes different sizes. Every other rank must get an error naming the
// collective, the group and the peer, within seconds, never a hang or memory corruption.
#include <gtest/gtest.h>

#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "switchyard/comm/communicator.h"
#include "switchyard/comm/inprocess.h"
#include "switchyard/core/error.h"

namespace switchyard::comm {
namespace {

// Runs fn on W ranks; returns each rank's error text ("" if none) and checks the run took less
// than `limit`.
std::vector<std::string> RunCollectingErrors(int w, const std::function<void(Communicator&)>& fn,
                                             Milliseconds timeout, Milliseconds limit) {
  std::vector<std::string> errors(static_cast<size_t>(w));
  std::mutex mu;
  InProcessOptions options;
  options.timeout = timeout;
  options.name = "test";
  auto t0 = Clock::now();
  try {
    RunInProcess(
        w,
        [&](Communicator& comm) {
          try {
            fn(comm);
          } catch (const Error& e) {
            std::lock_guard<std::mutex> lock(mu);
            errors[static_cast<size_t>(comm.rank())] = e.what();
          }
        },
        options);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "unexpected error escaped: " << e.what();
  }
  EXPECT_LT(Clock::now() - t0, limit) << "faults took too long to be reported";
  return errors;
}

bool Contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

TEST(Faults, RankThatStopsIsReportedAtOnce) {
  // Rank 3 returns before the collective; the long deadline is never reached.
  auto errors = RunCollectingErrors(
      4,
      [](Communicator& comm) {
        if (comm.rank() == 3) return;
        std::vector<float> x(1000, 1.0f);
        comm.AllReduce(x.data(), x.data(), x.size(), DType::kFloat32,
                       {.algorithm = Algorithm::kRing})
            .Wait();
      },
      Milliseconds(60000), Milliseconds(10000));
  for (int r = 0; r < 3; ++r) {
    const std::string& e = errors[static_cast<size_t>(r)];
    EXPECT_TRUE(Contains(e, "allreduce (ring")) << e;
    EXPECT_TRUE(Contains(e, "group 'test'")) << e;
  }
  // Rank 0 receives from rank 3 in the ring: it names it and says it left.
  EXPECT_TRUE(Contains(errors[0], "rank 3 (world rank 3)")) << errors[0];
  EXPECT_TRUE(Contains(errors[0], "left")) << errors[0];
}

TEST(Faults, RankThatNeverArrivesTimesOutAtTheDeadline) {
  auto errors = RunCollectingErrors(
      3,
      [](Communicator& comm) {
        if (comm.rank() == 2) {
          std::this_thread::sleep_for(Milliseconds(1500));  // alive, but too late
          return;
        }
        std::vector<int32_t> in(30), out(30);
        comm.AllToAll(in.data(), out.data(), 10, DType::kInt32,
                      {.algorithm = Algorithm::kLinear, .timeout = Milliseconds(300)})
            .Wait();
      },
      Milliseconds(60000), Milliseconds(10000));
  for (int r = 0; r < 2; ++r) {
    const std::string& e = errors[static_cast<size_t>(r)];
    EXPECT_TRUE(Contains(e, "alltoall (linear")) << e;
    EXPECT_TRUE(Contains(e, "rank 2 (world rank 2)")) << e;
    EXPECT_TRUE(Contains(e, "timed out") || Contains(e, "failed")) << e;
  }
}

TEST(Faults, RankThatThrowsIsNamedWithItsError) {
  InProcessOptions options;
  options.name = "test";
  try {
    RunInProcess(
        4,
        [](Communicator& comm) {
          if (comm.rank() == 2) throw InvalidArgument("injected failure on rank 2");
          std::vector<float> x(100, 1.0f);
          comm.Broadcast(x.data(), x.size(), DType::kFloat32, {.root = 2}).Wait();
        },
        options);
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_TRUE(Contains(e.what(), "injected failure on rank 2")) << e.what();  // the first one
  }
}

// In a ring every rank waits for its left neighbour; only one of them waits for the missing
// rank. The timeout consensus still lets every rank name it.
TEST(Faults, EveryRankNamesTheRankThatNeverArrivedInARing) {
  auto errors = RunCollectingErrors(
      4,
      [](Communicator& comm) {
        if (comm.rank() == 3) {
          std::this_thread::sleep_for(Milliseconds(1500));  // alive, but too late
          return;
        }
        std::vector<float> x(1000, 1.0f);
        comm.AllReduce(x.data(), x.data(), x.size(), DType::kFloat32,
                       {.algorithm = Algorithm::kRing, .timeout = Milliseconds(300)})
            .Wait();
      },
      Milliseconds(60000), Milliseconds(10000));
  for (int r = 0; r < 3; ++r) {
    const std::string& e = errors[static_cast<size_t>(r)];
    EXPECT_TRUE(Contains(e, "never arrived") && Contains(e, "rank 3 (world rank 3)")) << e;
  }
}

TEST(Faults, DifferentCollectiveIsNamed) {
  auto errors = RunCollectingErrors(
      4,
      [](Communicator& comm) {
        std::vector<float> x(64, 1.0f), y(256);
        if (comm.rank() == 0) {
          comm.AllGather(x.data(), y.data(), 64, DType::kFloat32).Wait();
        } else {
          comm.AllReduce(x.data(), x.data(), 64, DType::kFloat32, {.algorithm = Algorithm::kRing})
              .Wait();
        }
      },
      Milliseconds(60000), Milliseconds(10000));
  for (int r = 0; r < 4; ++r) EXPECT_FALSE(errors[static_cast<size_t>(r)].empty()) << r;
  // Rank 1 receives rank 0's allgather message in its allreduce ring.
  EXPECT_TRUE(Contains(errors[1], "called allgather")) << errors[1];
  EXPECT_TRUE(Contains(errors[1], "while this rank called allreduce")) << errors[1];
}

TEST(Faults, MismatchedSizesAreReportedNotWritten) {
  auto errors = RunCollectingErrors(
      3,
      [](Communicator& comm) {
        size_t n = comm.rank() == 1 ? 1000 : 500;
        std::vector<int64_t> x(n + 16, 7);
        comm.AllReduce(x.data(), x.data(), n, DType::kInt64, {.algorithm = Algorithm::kTree})
            .Wait();
      },
      Milliseconds(60000), Milliseconds(10000));
  for (int r = 0; r < 3; ++r) EXPECT_FALSE(errors[static_cast<size_t>(r)].empty()) << r;
  EXPECT_TRUE(Contains(errors[0], "mismatched sizes") || Contains(errors[0], "does not fit"))
      << errors[0];
}

TEST(Faults, MismatchedRootAndReduceOpAreNamed) {
  auto errors = RunCollectingErrors(
      2,
      [](Communicator& comm) {
        float x = 1;
        comm.Reduce(&x, &x, 1, DType::kFloat32,
                    {.root = 0, .reduce_op = comm.rank() ? ReduceOp::kMax : ReduceOp::kSum})
            .Wait();
      },
      Milliseconds(60000), Milliseconds(10000));
  EXPECT_TRUE(Contains(errors[0], "reduce op max, this rank with sum")) << errors[0];
  auto root_errors = RunCollectingErrors(
      2,
      [](Communicator& comm) {
        float x = 1;
        comm.Broadcast(&x, 1, DType::kFloat32, {.root = comm.rank()}).Wait();
      },
      Milliseconds(300), Milliseconds(10000));
  // Both ranks think they are the root: both send, neither receives; both time out naming the
  // other.
  EXPECT_TRUE(Contains(root_errors[0], "rank 1 (world rank 1)")) << root_errors[0];
}

TEST(Faults, CommunicatorIsUnusableAfterAFailure) {
  auto errors = RunCollectingErrors(
      2,
      [](Communicator& comm) {
        int32_t x = 1;
        if (comm.rank() == 0) {
          try {
            comm.AllReduce(&x, &x, 1, DType::kInt32, {.timeout = Milliseconds(100)}).Wait();
          } catch (const TimeoutError&) {
          }
          comm.AllReduce(&x, &x, 1, DType::kInt32).Wait();  // fails at once
        } else {
          std::this_thread::sleep_for(Milliseconds(400));
        }
      },
      Milliseconds(60000), Milliseconds(10000));
  EXPECT_TRUE(Contains(errors[0], "unusable after an earlier failure")) << errors[0];
}

}  // namespace
}  // namespace switchyard::comm
