// The Communicator on the in-process transport: groups (Split), asynchronous Work that progresses
// while the caller computes, ordering, Tensor forms, argument checks, emulated topology.
#include "switchyard/comm/communicator.h"

#include <gtest/gtest.h>
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "switchyard/comm/inprocess.h"
#include "switchyard/core/error.h"

namespace switchyard::comm {
namespace {

std::vector<int64_t> GroupWorldRanks(Communicator& group, int world_rank) {
  int64_t mine = world_rank;
  std::vector<int64_t> all(static_cast<size_t>(group.size()));
  group.AllGather(&mine, all.data(), 1, DType::kInt64).Wait();
  return all;
}

// DeepSpeed's expert-parallel layout: 16 ranks, ep_size 4 (expert groups of 4 consecutive
// ranks, expert-data-parallel groups of the ranks with equal index in them).
TEST(Communicator, SplitBuildsDeepSpeedExpertGroups) {
  std::mutex mu;
  std::vector<std::vector<int64_t>> ep(16), ep_dp(16);
  RunInProcess(16, [&](Communicator& world) {
    const int r = world.rank();
    auto ep_group = world.Split(r / 4, r, "ep");
    auto ep_dp_group = world.Split(r % 4, r, "ep_dp");
    auto a = GroupWorldRanks(*ep_group, r);
    auto b = GroupWorldRanks(*ep_dp_group, r);
    EXPECT_EQ(ep_group->name(), "ep");
    std::lock_guard<std::mutex> lock(mu);
    ep[static_cast<size_t>(r)] = a;
    ep_dp[static_cast<size_t>(r)] = b;
  });
  EXPECT_EQ(ep[5], (std::vector<int64_t>{4, 5, 6, 7}));
  EXPECT_EQ(ep_dp[5], (std::vector<int64_t>{1, 5, 9, 13}));
  EXPECT_EQ(ep_dp[12], (std::vector<int64_t>{0, 4, 8, 12}));
}

TEST(Communicator, SplitOrdersByKeyAndExcludesNoColor) {
  RunInProcess(5, [](Communicator& world) {
    const int r = world.rank();
    auto g = world.Split(r == 4 ? Communicator::kNoColor : 0, /*key=*/10 - r);
    if (r == 4) {
      EXPECT_EQ(g, nullptr);
      return;
    }
    ASSERT_NE(g, nullptr);
    EXPECT_EQ(g->size(), 4);
    EXPECT_EQ(g->rank(), 3 - r);
    EXPECT_EQ(g->name(), "world.0");
    auto nested = g->Split(g->rank() % 2, g->rank());
    EXPECT_EQ(nested->size(), 2);
    EXPECT_EQ(nested->name(), "world.0." + std::to_string(g->rank() % 2));
  });
}

// The collective completes while the caller never calls Wait: it runs on the progress thread.
TEST(Communicator, AsyncWorkProgressesWhileTheCallerComputes) {
  RunInProcess(4, [](Communicator& comm) {
    std::vector<float> in(4 * 50000, 1.0f + static_cast<float>(comm.rank()));
    std::vector<float> out(in.size(), 0.0f);
    Work w = comm.AllToAll(in.data(), out.data(), 50000, DType::kFloat32);
    auto t0 = Clock::now();
    volatile double sink = 0;
    while (!w.IsCompleted()) {
      for (int i = 0; i < 1000; ++i) sink = sink + i * 0.5;  // "compute"
      ASSERT_LT(Clock::now() - t0, Milliseconds(20000)) << "all-to-all made no progress";
    }
    w.Wait();
    for (int p = 0; p < 4; ++p) EXPECT_EQ(out[static_cast<size_t>(p) * 50000], 1.0f + p);
  });
}

TEST(Communicator, QueuedCollectivesRunInIssueOrder) {
  RunInProcess(3, [](Communicator& comm) {
    std::vector<std::vector<int32_t>> bufs(8, std::vector<int32_t>(1000));
    std::vector<Work> works;
    for (size_t i = 0; i < bufs.size(); ++i) {
      std::fill(bufs[i].begin(), bufs[i].end(), static_cast<int32_t>(i) + comm.rank());
      works.push_back(comm.AllReduce(bufs[i].data(), bufs[i].data(), 1000, DType::kInt32));
    }
    for (size_t i = works.size(); i-- > 0;) works[i].Wait();  // wait in reverse
    for (size_t i = 0; i < bufs.size(); ++i) {
      EXPECT_EQ(bufs[i][999], 3 * static_cast<int32_t>(i) + 3);
    }
  });
}

TEST(Communicator, WaitWithTimeoutReportsAStillRunningCollective) {
  RunInProcess(2, [](Communicator& comm) {
    int32_t x = 1;
    if (comm.rank() == 1) std::this_thread::sleep_for(Milliseconds(300));
    Work w = comm.AllReduce(&x, &x, 1, DType::kInt32);
    if (comm.rank() == 0) {
      EXPECT_THROW(w.Wait(Milliseconds(20)), TimeoutError);
    }
    w.Wait();  // completes once rank 1 joined
    EXPECT_EQ(x, 2);
  });
}

TEST(Communicator, CommunicatorsOfOneRankRunConcurrently) {
  RunInProcess(4, [](Communicator& world) {
    auto pair = world.Split(world.rank() / 2, world.rank());
    std::vector<float> a(20000, 1.0f), b(20000, 2.0f);
    // The world and the pair group are driven by two threads of this rank at once.
    std::thread side(
        [&] { pair->AllReduce(b.data(), b.data(), b.size(), DType::kFloat32).Wait(); });
    world.AllReduce(a.data(), a.data(), a.size(), DType::kFloat32).Wait();
    side.join();
    EXPECT_EQ(a[123], 4.0f);
    EXPECT_EQ(b[456], 4.0f);
  });
}

TEST(Communicator, TensorFormsCheckShapes) {
  RunInProcess(2, [](Communicator& comm) {
    Tensor in = Tensor::Full({4, 3}, comm.rank() + 1.0);
    Tensor out = Tensor::Zeros({4, 3});
    comm.AllToAll(in, out).Wait();
    EXPECT_EQ(out.At(0), 1.0);
    EXPECT_EQ(out.At(6), 2.0);
    Tensor gathered = Tensor::Zeros({8, 3});
    comm.AllGather(in, gathered).Wait();
    EXPECT_EQ(gathered.At(12), 2.0);
    Tensor scattered = Tensor::Zeros({2, 3});
    comm.ReduceScatter(in, scattered).Wait();
    EXPECT_EQ(scattered.At(0), 3.0);
    comm.AllReduce(in).Wait();
    EXPECT_EQ(in.At(5), 3.0);
    try {
      comm.AllGather(in, Tensor::Zeros({7, 3}));
      ADD_FAILURE() << "bad shape accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("allgather: output"), std::string::npos) << e.what();
    }
    // Variable rows: rank p sends p + 1 rows to each peer.
    std::vector<int64_t> send_rows(2, comm.rank() + 1);
    Tensor v = Tensor::Full({2 * (comm.rank() + 1), 3}, 10.0 * comm.rank());
    AllToAllVResult result;
    comm.AllToAllVDynamic(v, send_rows, &result).Wait();
    EXPECT_EQ(result.recv_counts, (std::vector<int64_t>{1, 2}));
    EXPECT_EQ(result.output.shape(), (Shape{3, 3}));
    EXPECT_EQ(result.output.At(8), 10.0);
  });
}

TEST(Communicator, RejectsBadArgumentsAtTheCall) {
  RunInProcess(2, [](Communicator& comm) {
    float x = 0;
    EXPECT_THROW(comm.Broadcast(&x, 1, DType::kFloat32, {.root = 2}), InvalidArgument);
    try {
      comm.AllGather(&x, &x, 0, DType::kFloat32, {.algorithm = Algorithm::kTree});
      ADD_FAILURE() << "allgather accepted the tree algorithm";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("offered: auto, ring, linear"), std::string::npos)
          << e.what();
    }
    try {
      comm.AllReduce(&x, &x, 1, DType::kFloat32, {.algorithm = Algorithm::kNative});
      ADD_FAILURE() << "native accepted in-process";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("MPI transport"), std::string::npos) << e.what();
    }
    std::vector<int64_t> wrong(3, 0);
    EXPECT_THROW(comm.AllToAllV(&x, wrong, {}, &x, wrong, {}, DType::kFloat32), InvalidArgument);
    EXPECT_THROW(comm.AllReduce(nullptr, &x, 1, DType::kFloat32), InvalidArgument);
  });
}

TEST(Communicator, HierarchicalIsChosenOnMultiNodeTopologiesAndEqualsFlat) {
  InProcessOptions options;
  options.ranks_per_node = 3;
  RunInProcess(
      6,
      [](Communicator& comm) {
        EXPECT_EQ(comm.topology().nodes, 2);
        const size_t n = 33;
        std::vector<int32_t> in(6 * n), flat(6 * n), twod(6 * n);
        std::iota(in.begin(), in.end(), 1000 * comm.rank());
        comm.AllToAll(in.data(), flat.data(), n, DType::kInt32, {.algorithm = Algorithm::kPairwise})
            .Wait();
        comm.AllToAll(in.data(), twod.data(), n, DType::kInt32).Wait();  // auto -> 2DH
        EXPECT_EQ(flat, twod);
      },
      options);
}

TEST(Communicator, RunsUnderEmulatedTopology) {
  InProcessOptions options;
  options.ranks_per_node = 2;
  options.emulation = EmulationOptions{{.latency_us = 5, .bandwidth_gbps = 50},
                                       {.latency_us = 200, .bandwidth_gbps = 2}};
  RunInProcess(
      4,
      [](Communicator& comm) {
        std::vector<float> x(10000, 1.0f);
        comm.AllReduce(x.data(), x.data(), x.size(), DType::kFloat32).Wait();
        EXPECT_EQ(x[9999], 4.0f);
      },
      options);
}

// Threads carry names that /proc/PID/task/*/comm (top -H, gdb) shows: rank threads "sy-rank<r>",
// each communicator's progress thread "sy-progress".
TEST(Communicator, ThreadsAreNamedForTools) {
  auto count_named = [](const std::string& name) {
    int n = 0;
    for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
      std::ifstream in(task.path() / "comm");
      std::string comm;
      std::getline(in, comm);
      n += comm == name ? 1 : 0;
    }
    return n;
  };
  const int before = count_named("sy-progress");
  std::atomic<int> during{0};
  RunInProcess(3, [&](Communicator& comm) {
    char name[16] = {};
    pthread_getname_np(pthread_self(), name, sizeof(name));
    EXPECT_EQ(std::string(name), "sy-rank" + std::to_string(comm.rank()));
    auto sub = comm.Split(0, comm.rank());
    sub->Barrier().Wait();  // every rank holds two communicators now
    if (comm.rank() == 0) during = count_named("sy-progress");
    sub->Barrier().Wait();
  });
  EXPECT_GE(during.load() - before, 6);
}

}  // namespace
}  // namespace switchyard::comm
