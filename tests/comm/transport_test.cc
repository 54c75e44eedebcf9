// The in-process transport on its own: matching, ordering, the single shared copy, size checks,
// deadlines, failures, contexts, and the emulated alpha-beta links.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "comm/inprocess_transport.h"
#include "switchyard/core/error.h"

namespace switchyard::comm {
namespace {

using inproc::CreateInProcessTransports;
using inproc::InProcessWorld;

Deadline In(int ms) { return Clock::now() + Milliseconds(ms); }

MessageHeader Header(uint64_t v) { return {v, v + 1, v + 2, v + 3}; }

TEST(InProcessTransport, DeliversWhicheverSidePostsFirst) {
  InProcessWorld world = CreateInProcessTransports(2, {});
  Transport& a = *world.transports[0];
  Transport& b = *world.transports[1];
  for (bool recv_first : {true, false}) {
    std::vector<int> src(100), dst(100, -1);
    std::iota(src.begin(), src.end(), recv_first ? 0 : 1000);
    RequestPtr r, s;
    if (recv_first) {
      r = b.Irecv(0, 7, dst.data(), dst.size() * sizeof(int));
      s = a.Isend(1, 7, src.data(), src.size() * sizeof(int), Header(5));
    } else {
      s = a.Isend(1, 7, src.data(), src.size() * sizeof(int), Header(5));
      r = b.Irecv(0, 7, dst.data(), dst.size() * sizeof(int));
    }
    Request* both[] = {r.get(), s.get()};
    a.Wait(both, In(5000));
    EXPECT_EQ(dst, src);
    EXPECT_EQ(r->header(), Header(5));
    EXPECT_EQ(r->received_bytes(), src.size() * sizeof(int));
  }
}

TEST(InProcessTransport, SameTagIsFifoAndTagsAreIndependent) {
  InProcessWorld world = CreateInProcessTransports(2, {});
  Transport& a = *world.transports[0];
  Transport& b = *world.transports[1];
  int x1 = 1, x2 = 2, y = 3;
  RequestPtr s1 = a.Isend(1, 10, &x1, sizeof(int), {});
  RequestPtr s2 = a.Isend(1, 10, &x2, sizeof(int), {});
  RequestPtr s3 = a.Isend(1, 11, &y, sizeof(int), {});
  int got_y = 0, got1 = 0, got2 = 0;
  RequestPtr r3 = b.Irecv(0, 11, &got_y, sizeof(int));  // other tag first
  RequestPtr r1 = b.Irecv(0, 10, &got1, sizeof(int));
  RequestPtr r2 = b.Irecv(0, 10, &got2, sizeof(int));
  Request* all[] = {s1.get(), s2.get(), s3.get(), r1.get(), r2.get(), r3.get()};
  b.Wait(all, In(5000));
  EXPECT_EQ(got1, 1);
  EXPECT_EQ(got2, 2);
  EXPECT_EQ(got_y, 3);
}

TEST(InProcessTransport, LargeMessageIsCopiedInChunksByBothThreads) {
  InProcessOptions options;
  options.copy_chunk_bytes = 4096;
  InProcessWorld world = CreateInProcessTransports(2, options);
  const size_t n = (size_t{3} << 20) + 12345;  // bytes, not a multiple of the chunk
  std::vector<unsigned char> src(n), dst(n + 64, 0xee);
  for (size_t i = 0; i < n; ++i) src[i] = static_cast<unsigned char>(i * 31 + 7);
  std::thread sender([&] {
    RequestPtr s = world.transports[0]->Isend(1, 1, src.data(), n, {});
    Request* one[] = {s.get()};
    world.transports[0]->Wait(one, In(10000));
  });
  RequestPtr r = world.transports[1]->Irecv(0, 1, dst.data(), n);
  Request* one[] = {r.get()};
  world.transports[1]->Wait(one, In(10000));
  sender.join();
  EXPECT_EQ(0, std::memcmp(src.data(), dst.data(), n));
  for (size_t i = n; i < dst.size(); ++i) ASSERT_EQ(dst[i], 0xee) << "wrote past the receive";
}

TEST(InProcessTransport, ReduceOnReceiveCombinesLocalAndIncoming) {
  InProcessOptions options;
  options.copy_chunk_bytes = 256;
  InProcessWorld world = CreateInProcessTransports(2, options);
  std::vector<float> mine(1000), theirs(1000), out(1000);
  for (int i = 0; i < 1000; ++i) {
    mine[static_cast<size_t>(i)] = static_cast<float>(i);
    theirs[static_cast<size_t>(i)] = static_cast<float>(2 * i);
  }
  RecvReduction reduction{mine.data(), DType::kFloat32, ReduceOp::kSum};
  RequestPtr r = world.transports[1]->Irecv(0, 3, out.data(), 4000, &reduction);
  RequestPtr s = world.transports[0]->Isend(1, 3, theirs.data(), 4000, {});
  Request* both[] = {r.get(), s.get()};
  world.transports[1]->Wait(both, In(5000));
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(out[static_cast<size_t>(i)], 3.0f * i);
}

// The thread that matches a pair must publish its partner's state last: a partner that sees its
// request matched may copy and complete the transfer at once, and a later store by the matcher
// would take the completion back (the request then waits forever). Receivers post second here, so
// every pair is matched by the receiving thread while the sender is already waiting on its send;
// both directions of matching are crossed, and the matcher pauses between its two stores so that a
// wrong order loses the race every time (the partner copies and completes within the pause).
TEST(InProcessTransport, PairsMatchedWhileThePartnerWaitsAllComplete) {
  InProcessWorld world = CreateInProcessTransports(2, {});
  world.fabric->set_match_pause_for_testing(std::chrono::microseconds(2000));
  constexpr int kPairs = 20;
  std::atomic<int> sent{0};
  auto sender = [&](Transport& t, int peer, bool post_first) {
    for (int i = 0; i < kPairs; ++i) {
      int value = i;
      if (!post_first) {
        while (sent.load(std::memory_order_acquire) <= i) std::this_thread::yield();
      }
      RequestPtr s = t.Isend(peer, static_cast<uint64_t>(i), &value, sizeof(int), Header(i));
      if (post_first) sent.store(i + 1, std::memory_order_release);
      Request* one[] = {s.get()};
      t.Wait(one, In(5000));
    }
  };
  auto receiver = [&](Transport& t, int peer, bool wait_for_sender) {
    for (int i = 0; i < kPairs; ++i) {
      if (wait_for_sender) {
        while (sent.load(std::memory_order_acquire) <= i) std::this_thread::yield();
      }
      int got = -1;
      RequestPtr r = t.Irecv(peer, static_cast<uint64_t>(i), &got, sizeof(int));
      if (!wait_for_sender) sent.store(i + 1, std::memory_order_release);
      Request* one[] = {r.get()};
      t.Wait(one, In(5000));
      ASSERT_EQ(got, i);
    }
  };
  for (bool receiver_matches : {true, false}) {
    sent.store(0);
    std::string sender_error;
    std::thread a([&] {
      try {
        sender(*world.transports[0], 1, receiver_matches);
      } catch (const std::exception& e) {
        sender_error = e.what();
      }
    });
    EXPECT_NO_THROW(receiver(*world.transports[1], 0, receiver_matches))
        << "receiver_matches " << receiver_matches;
    a.join();
    EXPECT_EQ(sender_error, "") << "receiver_matches " << receiver_matches;
  }
}

TEST(InProcessTransport, MessageLargerThanReceiveFailsBothSidesWithoutWriting) {
  InProcessWorld world = CreateInProcessTransports(2, {});
  std::vector<char> src(100, 'x'), dst(50, 'o');
  RequestPtr r = world.transports[1]->Irecv(0, 1, dst.data(), 40);
  RequestPtr s = world.transports[0]->Isend(1, 1, src.data(), 100, {});
  Request* recv_only[] = {r.get()};
  Request* send_only[] = {s.get()};
  EXPECT_THROW(world.transports[1]->Wait(recv_only, In(5000)), PeerError);
  try {
    world.transports[0]->Wait(send_only, In(5000));
    ADD_FAILURE() << "send of a too large message succeeded";
  } catch (const PeerError& e) {
    EXPECT_NE(std::string(e.what()).find("does not fit"), std::string::npos) << e.what();
  }
  EXPECT_EQ(std::string(dst.begin(), dst.end()), std::string(50, 'o'));
  EXPECT_EQ(r->received_bytes(), 100u);  // the sender's size, for the error message
}

TEST(InProcessTransport, ShorterMessageReportsItsSize) {
  InProcessWorld world = CreateInProcessTransports(2, {});
  char src[10] = "abcdefghi", dst[64] = {};
  RequestPtr r = world.transports[1]->Irecv(0, 1, dst, sizeof(dst));
  RequestPtr s = world.transports[0]->Isend(1, 1, src, 10, {});
  Request* both[] = {r.get(), s.get()};
  world.transports[1]->Wait(both, In(5000));
  EXPECT_EQ(r->received_bytes(), 10u);
  EXPECT_STREQ(dst, "abcdefghi");
}

TEST(InProcessTransport, WaitTimesOutNamingTheMissingPeer) {
  InProcessWorld world = CreateInProcessTransports(3, {});
  int x = 0;
  RequestPtr r = world.transports[0]->Irecv(2, 1, &x, sizeof(x));
  Request* one[] = {r.get()};
  auto t0 = Clock::now();
  try {
    world.transports[0]->Wait(one, In(200));
    ADD_FAILURE() << "no timeout";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 2"), std::string::npos) << e.what();
  }
  EXPECT_LT(Clock::now() - t0, Milliseconds(2000));
}

TEST(InProcessTransport, DestroyedReceiveIsCancelled) {
  InProcessWorld world = CreateInProcessTransports(2, {});
  int first = -1;
  {
    RequestPtr r = world.transports[1]->Irecv(0, 1, &first, sizeof(int));
  }  // cancelled: the message below must go to the next receive, not into `first`
  int value = 42, second = -1;
  RequestPtr s = world.transports[0]->Isend(1, 1, &value, sizeof(int), {});
  RequestPtr r = world.transports[1]->Irecv(0, 1, &second, sizeof(int));
  Request* both[] = {r.get(), s.get()};
  world.transports[1]->Wait(both, In(5000));
  EXPECT_EQ(first, -1);
  EXPECT_EQ(second, 42);
}

TEST(InProcessTransport, FailedPeerWakesWaitersAtOnce) {
  InProcessWorld world = CreateInProcessTransports(2, {});
  int x = 0;
  RequestPtr r = world.transports[0]->Irecv(1, 1, &x, sizeof(x));
  std::thread failer([&] {
    std::this_thread::sleep_for(Milliseconds(50));
    world.fabric->MarkFailed(1, 0, "failed: injected");
  });
  Request* one[] = {r.get()};
  auto t0 = Clock::now();
  try {
    world.transports[0]->Wait(one, In(20000));
    ADD_FAILURE() << "no error";
  } catch (const PeerError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 (world rank 1) failed: injected"),
              std::string::npos)
        << e.what();
  }
  failer.join();
  EXPECT_LT(Clock::now() - t0, Milliseconds(5000));
}

TEST(InProcessTransport, SplitGroupsDoNotSeeEachOthersMessages) {
  InProcessWorld world = CreateInProcessTransports(4, {});
  std::vector<std::unique_ptr<Transport>> halves(4);
  std::vector<std::thread> threads;
  for (int r = 0; r < 4; ++r) {
    threads.emplace_back([&, r] {
      halves[static_cast<size_t>(r)] =
          world.transports[static_cast<size_t>(r)]->Split(r / 2, -r, /*tag=*/99, In(5000));
    });
  }
  for (auto& t : threads) t.join();
  // Keys -r: world rank 1 is rank 0 of group {0, 1}.
  EXPECT_EQ(halves[1]->rank(), 0);
  EXPECT_EQ(halves[0]->rank(), 1);
  EXPECT_EQ(halves[0]->WorldRank(0), 1);
  // Same tag in the world and in the subgroup: each receive gets its own group's message.
  int from_world = 1, from_group = 2, got_world = 0, got_group = 0;
  RequestPtr s1 = world.transports[1]->Isend(0, 5, &from_world, sizeof(int), {});
  RequestPtr s2 = halves[1]->Isend(1, 5, &from_group, sizeof(int), {});
  RequestPtr r2 = halves[0]->Irecv(0, 5, &got_group, sizeof(int));
  RequestPtr r1 = world.transports[0]->Irecv(1, 5, &got_world, sizeof(int));
  Request* all[] = {s1.get(), s2.get(), r1.get(), r2.get()};
  world.transports[0]->Wait(all, In(5000));
  EXPECT_EQ(got_world, 1);
  EXPECT_EQ(got_group, 2);
}

TEST(InProcessTransport, TopologyOfWorldAndSplits) {
  InProcessOptions options;
  options.ranks_per_node = 2;
  InProcessWorld world = CreateInProcessTransports(6, options);
  Topology t = world.transports[0]->topology();
  EXPECT_EQ(t.nodes, 3);
  EXPECT_EQ(t.ranks_per_node, 2);
}

TEST(InProcessTransport, EmulatedLinksDelayCompletionBySerializedAlphaBeta) {
  InProcessOptions options;
  options.ranks_per_node = 2;
  options.emulation = EmulationOptions{{.latency_us = 2000, .bandwidth_gbps = 0},
                                       {.latency_us = 30000, .bandwidth_gbps = 0.01}};
  InProcessWorld world = CreateInProcessTransports(4, options);
  std::vector<char> buf(100000), in1(100000), in2(100000);
  // Intra-node (0 -> 1): 2 ms. Two inter-node messages (0 -> 2, 0 -> 3) from one port:
  // 30 ms + 100000 B / 10 MB/s = 40 ms each, serialized: the second completes after >= 80 ms.
  auto t0 = Clock::now();
  RequestPtr ri = world.transports[1]->Irecv(0, 1, in1.data(), 100);
  RequestPtr si = world.transports[0]->Isend(1, 1, buf.data(), 100, {});
  Request* intra[] = {ri.get(), si.get()};
  world.transports[0]->Wait(intra, In(5000));
  auto intra_time = Clock::now() - t0;
  EXPECT_GE(intra_time, Milliseconds(2));
  auto t1 = Clock::now();
  RequestPtr r2 = world.transports[2]->Irecv(0, 1, in1.data(), buf.size());
  RequestPtr r3 = world.transports[3]->Irecv(0, 1, in2.data(), buf.size());
  RequestPtr s2 = world.transports[0]->Isend(2, 1, buf.data(), buf.size(), {});
  RequestPtr s3 = world.transports[0]->Isend(3, 1, buf.data(), buf.size(), {});
  Request* first[] = {r2.get(), s2.get()};
  world.transports[0]->Wait(first, In(5000));
  auto first_time = Clock::now() - t1;
  Request* second[] = {r3.get(), s3.get()};
  world.transports[0]->Wait(second, In(5000));
  auto second_time = Clock::now() - t1;
  EXPECT_GE(first_time, Milliseconds(40));
  EXPECT_GE(second_time, Milliseconds(80));
}

}  // namespace
}  // namespace switchyard::comm
