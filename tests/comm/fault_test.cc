// Fault injection on the in-process transport: a rank that stops, never arrives, throws, calls a
// different collective or passes different sizes. Every other rank must get an error naming the
// collective, the group and the peer, within seconds, never a hang or memory corruption.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
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

// Every rank in `ranks` failed with an error containing every one of `parts`.
void ExpectEveryRankNames(const std::vector<std::string>& errors, const std::vector<int>& ranks,
                          const std::vector<std::string>& parts) {
  for (int r : ranks) {
    const std::string& e = errors[static_cast<size_t>(r)];
    EXPECT_FALSE(e.empty()) << "rank " << r << " got no error";
    for (const std::string& part : parts) {
      EXPECT_TRUE(Contains(e, part)) << "rank " << r << " does not name '" << part << "': " << e;
    }
  }
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
  // Every survivor names the collective, the group and the rank that left: rank 0 (its ring
  // predecessor) directly, ranks 1 and 2 through the failure of the neighbour they waited for.
  ExpectEveryRankNames(errors, {0, 1, 2},
                       {"allreduce (ring", "group 'test'", "rank 3 (world rank 3)", "left"});
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
  ExpectEveryRankNames(errors, {0, 1},
                       {"alltoall (linear", "group 'test'", "rank 2 (world rank 2)", "timed out"});
}

TEST(Faults, RankThatThrowsIsNamedWithItsError) {
  // Rank 2 (the root) dies: its thread throws out of the rank function. The others collect
  // their own errors.
  InProcessOptions options;
  options.name = "test";
  std::vector<std::string> errors(4);
  std::mutex mu;
  auto t0 = Clock::now();
  try {
    RunInProcess(
        4,
        [&](Communicator& comm) {
          if (comm.rank() == 2) throw InvalidArgument("injected failure on rank 2");
          try {
            std::vector<float> x(100, 1.0f);
            comm.Broadcast(x.data(), x.size(), DType::kFloat32, {.root = 2}).Wait();
          } catch (const Error& e) {
            std::lock_guard<std::mutex> lock(mu);
            errors[static_cast<size_t>(comm.rank())] = e.what();
          }
        },
        options);
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_TRUE(Contains(e.what(), "injected failure on rank 2")) << e.what();  // the first one
  }
  EXPECT_LT(Clock::now() - t0, Milliseconds(10000));
  // Ranks 3 and 0 receive from rank 2 itself, rank 1 from rank 0: all name rank 2 and its error.
  ExpectEveryRankNames(
      errors, {0, 1, 3},
      {"broadcast (tree", "group 'test'", "rank 2 (world rank 2)", "injected failure on rank 2"});
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
  ExpectEveryRankNames(
      errors, {0, 1, 2},
      {"allreduce (ring", "group 'test'", "never arrived", "rank 3 (world rank 3)"});
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
  // Rank 1 receives rank 0's allgather message in its allreduce ring and says so; ranks 2 and 3
  // learn it from the failure of the neighbour they wait for. Each names its own collective, the
  // group, the rank that called another one, and that one's collective.
  ExpectEveryRankNames(errors, {1, 2, 3},
                       {"allreduce (ring", "group 'test'", "rank 0 (world rank 0)", "allgather"});
  EXPECT_TRUE(Contains(errors[1], "rank 0 (world rank 0) called allgather")) << errors[1];
  EXPECT_TRUE(Contains(errors[1], "while this rank called allreduce")) << errors[1];
  // Rank 0, the odd one, fails too: rank 3's ring message in its allgather names the allreduce,
  // or its own message does not fit rank 1's ring receive.
  ExpectEveryRankNames(errors, {0}, {"allgather (linear", "group 'test'"});
  EXPECT_TRUE(Contains(errors[0], "called allreduce") || Contains(errors[0], "does not fit"))
      << errors[0];
}

TEST(Faults, MismatchedSizesAreReportedNotWritten) {
  auto errors = RunCollectingErrors(
      3,
      [](Communicator& comm) {
        size_t n = comm.rank() == 1 ? 1000 : 500;
        std::vector<int64_t> x(n + 16, 7);
        try {
          comm.AllReduce(x.data(), x.data(), n, DType::kInt64, {.algorithm = Algorithm::kTree})
              .Wait();
        } catch (const Error&) {
          // The 16 spare elements past the n this rank passed are never written.
          for (size_t i = n; i < x.size(); ++i) EXPECT_EQ(x[i], 7) << "rank " << comm.rank();
          throw;
        }
      },
      Milliseconds(60000), Milliseconds(10000));
  // Rank 0 receives rank 1's 1000 elements where it expects 500 and names the sizes; rank 1's
  // send does not fit; rank 2 sends to rank 0 and learns of its failure.
  ExpectEveryRankNames(errors, {0, 1, 2}, {"allreduce (tree", "group 'test'"});
  EXPECT_TRUE(
      Contains(errors[0],
               "mismatched sizes: rank 1 (world rank 1) called allreduce with 1000 x int64, "
               "this rank with 500 x int64"))
      << errors[0];
  EXPECT_TRUE(Contains(errors[1], "to rank 0 (world rank 0) does not fit")) << errors[1];
  EXPECT_TRUE(Contains(errors[2], "mismatched sizes") || Contains(errors[2], "does not fit"))
      << errors[2];
}

// All-to-all-v where a receiver disagrees with a sender about the sender's count (the MoE
// dispatch case): rank 1 sends 6 elements to every rank, and one receiver expects 9 (more) or
// 4 (fewer) from it. The receiver reports mismatched sizes naming rank 1; no element lands
// outside the block each rank declared (the gaps between the receive blocks stay untouched).
// A sender whose message was shorter than expected may finish without error: its own output is
// right, and only the receiver knows.
TEST(Faults, MismatchedAllToAllVCountsAreReportedNotWritten) {
  constexpr int kW = 4;
  constexpr int64_t kRows = 6, kStride = kRows + 3 + 8;  // block + room for 3 more + 8 gap
  constexpr float kSentinel = -7.0f;
  for (Algorithm algorithm : {Algorithm::kPairwise, Algorithm::kLinear}) {
    for (const auto& [receiver, expected] : {std::pair{0, kRows + 3}, std::pair{2, kRows - 2}}) {
      SCOPED_TRACE(fmt::format("{}, rank {} expects {} from rank 1", AlgorithmName(algorithm),
                               receiver, expected));
      auto errors = RunCollectingErrors(
          kW,
          [&](Communicator& comm) {
            const int r = comm.rank();
            std::vector<int64_t> sc(kW, kRows), rc(kW, kRows), rd(kW);
            if (r == receiver) rc[1] = expected;
            for (int q = 0; q < kW; ++q) rd[static_cast<size_t>(q)] = q * kStride;
            std::vector<float> in(kW * kRows, static_cast<float>(r + 1));
            std::vector<float> out(kW * kStride, kSentinel);
            auto gaps_intact = [&] {
              for (size_t q = 0; q < kW; ++q) {
                for (int64_t i = rd[q] + rc[q]; i < rd[q] + kStride; ++i) {
                  EXPECT_EQ(out[static_cast<size_t>(i)], kSentinel)
                      << "rank " << r << " wrote element " << i << " past the block of rank " << q;
                }
              }
            };
            try {
              comm.AllToAllV(in.data(), sc, {}, out.data(), rc, rd, DType::kFloat32,
                             {.algorithm = algorithm})
                  .Wait();
            } catch (const Error&) {
              gaps_intact();
              throw;
            }
            gaps_intact();
          },
          Milliseconds(60000), Milliseconds(10000));
      const std::string what = fmt::format("alltoallv ({}", AlgorithmName(algorithm));
      ExpectEveryRankNames(errors, {receiver},
                           {what, "group 'test'",
                            fmt::format("mismatched sizes: rank 1 (world rank 1) sent 24 bytes "
                                        "(6 x float32) in alltoallv, this rank expected {} bytes",
                                        expected * 4)});
      if (expected < kRows) {
        // In-process the sender learns that its message does not fit the receive.
        ExpectEveryRankNames(errors, {1}, {what, "to rank 2 (world rank 2) does not fit"});
      }
      for (int r = 0; r < kW; ++r) {
        const std::string& e = errors[static_cast<size_t>(r)];
        if (!e.empty()) {
          EXPECT_TRUE(Contains(e, what) && Contains(e, "group 'test'")) << e;
        }
      }
    }
  }
}

TEST(Faults, AllToAllVSelfBlockMismatchIsRejectedAtTheCall) {
  RunInProcess(2, [](Communicator& comm) {
    std::vector<float> in(8), out(8);
    std::vector<int64_t> sc = {2, 2}, rc = {2, 2};
    rc[static_cast<size_t>(comm.rank())] = 3;
    try {
      comm.AllToAllV(in.data(), sc, {}, out.data(), rc, {}, DType::kFloat32);
      ADD_FAILURE() << "accepted a self block of 2 sent and 3 received";
    } catch (const InvalidArgument& e) {
      EXPECT_TRUE(Contains(e.what(), "must equal what it receives from itself")) << e.what();
    }
  });
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
  ExpectEveryRankNames(root_errors, {0},
                       {"broadcast (tree", "group 'test'", "rank 1 (world rank 1)"});
  ExpectEveryRankNames(root_errors, {1},
                       {"broadcast (tree", "group 'test'", "rank 0 (world rank 0)"});
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

// The error RunInProcess rethrows (and the CLI prints) is the root cause, not a peer's error
// about it: rank 1 times out waiting for rank 2 (late) while rank 0, blocked in the same ring,
// learns of rank 1's failure. Repeated: which thread unwinds first is a race.
TEST(Faults, FirstErrorIsTheOneRethrown) {
  for (int trial = 0; trial < 5; ++trial) {
    InProcessOptions options;
    options.name = "test";
    try {
      RunInProcess(
          3,
          [](Communicator& comm) {
            if (comm.rank() == 2) {
              std::this_thread::sleep_for(Milliseconds(600));  // alive, but too late
              return;
            }
            std::vector<float> x(64, 1.0f);
            const Milliseconds timeout(comm.rank() == 1 ? 100 : 30000);
            comm.AllReduce(x.data(), x.data(), x.size(), DType::kFloat32,
                           {.algorithm = Algorithm::kRing, .timeout = timeout})
                .Wait();
          },
          options);
      ADD_FAILURE() << "no error";
    } catch (const TimeoutError& e) {
      EXPECT_TRUE(Contains(e.what(), "(rank 1 of 3)")) << e.what();
    } catch (const Error& e) {
      ADD_FAILURE() << "trial " << trial << ": not the root cause: " << e.what();
    }
  }
}

}  // namespace
}  // namespace switchyard::comm
