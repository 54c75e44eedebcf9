// A transport written outside the library plugs into CreateCommunicator: every algorithm of the
// Communicator then runs over it. The transport here is a user's simplest possible one -- ranks
// as threads sharing a table of message queues, sends buffered (copied at Isend) -- written only
// against the public switchyard/comm/transport.h.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "switchyard/comm/communicator.h"
#include "switchyard/comm/reduce.h"
#include "switchyard/comm/transport.h"
#include "switchyard/core/error.h"

namespace switchyard::comm {
namespace {

class QueueRequest;

// Shared by the ranks of one process: buffered messages not yet received and receives posted but
// not yet matched, per (group context, source world rank, destination world rank, tag), oldest
// first. Everything is guarded by mu.
struct Hub {
  using Key = std::tuple<uint64_t, int, int, uint64_t>;
  struct Message {
    MessageHeader header;
    std::vector<std::byte> payload;
  };
  std::mutex mu;
  std::condition_variable cv;
  std::map<Key, std::deque<Message>> messages;
  std::map<Key, std::deque<QueueRequest*>> receives;
};

class QueueRequest final : public Request {
 public:
  QueueRequest(std::shared_ptr<Hub> hub, bool is_send, int peer, uint64_t tag, size_t size)
      : Request(is_send, peer, tag, size), hub_(std::move(hub)) {}
  // Cancels an unmatched receive.
  ~QueueRequest() override {
    std::lock_guard<std::mutex> lock(hub_->mu);
    if (done_ || !posted_) return;
    auto& queue = hub_->receives[key_];
    queue.erase(std::find(queue.begin(), queue.end(), this));
  }

  // Delivers `m` into this receive (hub->mu held).
  void Deliver(const Hub::Message& m) {
    header_ = m.header;
    received_bytes_ = m.payload.size();
    if (m.payload.size() > size()) {
      error_ = "a message of " + std::to_string(m.payload.size()) + " bytes from rank " +
               std::to_string(peer()) + " does not fit the " + std::to_string(size()) +
               " bytes expected";
    } else if (reduction_.has_value()) {
      ReduceInto(data_, reduction_->local, m.payload.data(),
                 m.payload.size() / DTypeSize(reduction_->dtype), reduction_->dtype,
                 reduction_->op);
    } else if (!m.payload.empty()) {
      std::memcpy(data_, m.payload.data(), m.payload.size());
    }
    done_ = true;
  }

  std::shared_ptr<Hub> hub_;
  Hub::Key key_;
  void* data_ = nullptr;
  std::optional<RecvReduction> reduction_;
  bool posted_ = false;  // waiting in hub->receives
  bool done_ = false;    // guarded by hub->mu
  std::string error_;    // guarded by hub->mu
};

class QueueTransport final : public Transport {
 public:
  // The endpoint of members[rank] in the group `members` (world ranks) named by `context`.
  QueueTransport(std::shared_ptr<Hub> hub, uint64_t context, std::vector<int> members, int rank)
      : hub_(std::move(hub)), context_(context), members_(std::move(members)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(members_.size()); }
  std::string_view kind() const override { return "queue"; }
  int WorldRank(int group_rank) const override { return members_[static_cast<size_t>(group_rank)]; }
  Topology topology() const override { return {1, size()}; }

  RequestPtr Isend(int peer, uint64_t tag, const void* data, size_t bytes,
                   const MessageHeader& header) override {
    auto request = std::make_unique<QueueRequest>(hub_, true, peer, tag, bytes);
    Hub::Message m{header, std::vector<std::byte>(bytes)};
    if (bytes > 0) std::memcpy(m.payload.data(), data, bytes);
    const Hub::Key key{context_, WorldRank(rank_), WorldRank(peer), tag};
    {
      std::lock_guard<std::mutex> lock(hub_->mu);
      request->done_ = true;  // buffered
      auto& waiting = hub_->receives[key];
      if (waiting.empty()) {
        hub_->messages[key].push_back(std::move(m));
      } else {
        waiting.front()->Deliver(m);
        waiting.pop_front();
      }
    }
    hub_->cv.notify_all();
    return request;
  }

  RequestPtr Irecv(int peer, uint64_t tag, void* data, size_t capacity,
                   const RecvReduction* reduction) override {
    auto request = std::make_unique<QueueRequest>(hub_, false, peer, tag, capacity);
    request->key_ = Hub::Key{context_, WorldRank(peer), WorldRank(rank_), tag};
    request->data_ = data;
    if (reduction != nullptr) request->reduction_ = *reduction;
    std::lock_guard<std::mutex> lock(hub_->mu);
    auto& queue = hub_->messages[request->key_];
    if (queue.empty()) {
      hub_->receives[request->key_].push_back(request.get());
      request->posted_ = true;
    } else {
      request->Deliver(queue.front());
      queue.pop_front();
    }
    return request;
  }

  void Wait(std::span<Request* const> requests, Deadline deadline) override {
    std::unique_lock<std::mutex> lock(hub_->mu);
    for (;;) {
      const QueueRequest* pending = nullptr;
      for (Request* r : requests) {
        auto* q = static_cast<QueueRequest*>(r);
        if (q == nullptr) continue;
        if (!q->error_.empty()) throw PeerError(q->error_);
        if (!q->done_ && pending == nullptr) pending = q;
      }
      if (pending == nullptr) return;
      if (hub_->cv.wait_until(lock, deadline) == std::cv_status::timeout &&
          Clock::now() >= deadline) {
        throw TimeoutError("timed out waiting for rank " + std::to_string(pending->peer()));
      }
    }
  }

  bool Test(Request& request) override {
    std::lock_guard<std::mutex> lock(hub_->mu);
    auto& q = static_cast<QueueRequest&>(request);
    if (!q.error_.empty()) throw PeerError(q.error_);
    return q.done_;
  }

  std::unique_ptr<Transport> Split(int color, int key, uint64_t tag, Deadline deadline) override {
    std::vector<std::array<int, 2>> keys = ExchangeSplitKeys(color, key, tag, deadline);
    if (color < 0) return nullptr;
    std::vector<std::array<int, 2>> order;  // (key, group rank) of the members with this color
    for (int p = 0; p < size(); ++p) {
      if (keys[static_cast<size_t>(p)][0] == color)
        order.push_back({keys[static_cast<size_t>(p)][1], p});
    }
    std::sort(order.begin(), order.end());
    std::vector<int> members;
    int new_rank = 0;
    for (const auto& [k, p] : order) {
      if (p == rank_) new_rank = static_cast<int>(members.size());
      members.push_back(WorldRank(p));
    }
    // Equal on every member of the new group, distinct from the parent's and its siblings'.
    const uint64_t context = (context_ * 1000003 + tag) * 64 + static_cast<uint64_t>(color) + 1;
    return std::make_unique<QueueTransport>(hub_, context, std::move(members), new_rank);
  }

 private:
  std::shared_ptr<Hub> hub_;
  uint64_t context_;
  std::vector<int> members_;
  int rank_;
};

// Runs fn(communicator of rank r) on W threads, each communicator made by CreateCommunicator
// over a QueueTransport; rethrows the first failure after every thread finished.
void RunOnQueueTransport(int world, const std::function<void(Communicator&)>& fn) {
  auto hub = std::make_shared<Hub>();
  std::vector<int> members(static_cast<size_t>(world));
  std::iota(members.begin(), members.end(), 0);
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < world; ++r) {
    comms.push_back(CreateCommunicator(std::make_unique<QueueTransport>(hub, 1, members, r),
                                       {.timeout = Milliseconds(20000), .name = "queue"}));
  }
  std::mutex mu;
  std::exception_ptr error;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(*comms[static_cast<size_t>(r)]);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!error) error = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (error) std::rethrow_exception(error);
}

TEST(CustomTransport, AllReduceEveryAlgorithm) {
  for (int w : {1, 3, 4}) {
    RunOnQueueTransport(w, [w](Communicator& comm) {
      EXPECT_EQ(comm.name(), "queue");
      EXPECT_EQ(comm.transport_kind(), "queue");
      const int r = comm.rank();
      for (Algorithm a : {Algorithm::kAuto, Algorithm::kRing, Algorithm::kTree}) {
        for (size_t n : {size_t{0}, size_t{1}, size_t{1000}}) {
          std::vector<float> in(n), out(n, -1.0f);
          for (size_t i = 0; i < n; ++i) in[i] = static_cast<float>(r * 100 + i);
          comm.AllReduce(in.data(), out.data(), n, DType::kFloat32, {.algorithm = a}).Wait();
          for (size_t i = 0; i < n; ++i) {
            // sum over ranks of (q * 100 + i), exact in float32
            ASSERT_EQ(out[i], static_cast<float>(100 * w * (w - 1) / 2 + w * i))
                << "algorithm " << AlgorithmName(a) << " n " << n << " i " << i;
          }
        }
      }
      // int64 max, in place.
      int64_t x = 7 * r;
      comm.AllReduce(&x, &x, 1, DType::kInt64, {.reduce_op = ReduceOp::kMax}).Wait();
      EXPECT_EQ(x, 7 * (w - 1));
    });
  }
}

TEST(CustomTransport, AllToAllVWithUnequalCounts) {
  const int w = 4;
  RunOnQueueTransport(w, [](Communicator& comm) {
    const int r = comm.rank();
    // Rank r sends (r + p) % 3 elements to rank p, each r * 1000 + p * 10 + j.
    auto count = [](int from, int to) { return static_cast<int64_t>((from + to) % 3); };
    std::vector<int64_t> send_counts, recv_counts;
    std::vector<int32_t> send;
    for (int p = 0; p < w; ++p) {
      send_counts.push_back(count(r, p));
      recv_counts.push_back(count(p, r));
      for (int64_t j = 0; j < count(r, p); ++j) send.push_back(r * 1000 + p * 10 + j);
    }
    std::vector<int32_t> expected;
    for (int p = 0; p < w; ++p) {
      for (int64_t j = 0; j < count(p, r); ++j) expected.push_back(p * 1000 + r * 10 + j);
    }
    for (Algorithm a : {Algorithm::kAuto, Algorithm::kPairwise, Algorithm::kLinear}) {
      std::vector<int32_t> recv(expected.size(), -1);
      comm.AllToAllV(send.data(), send_counts, {}, recv.data(), recv_counts, {}, DType::kInt32,
                     {.algorithm = a})
          .Wait();
      EXPECT_EQ(recv, expected) << AlgorithmName(a);
    }
    // The two-phase form, where receivers do not know their counts.
    AllToAllVResult result;
    comm.AllToAllVDynamic(send.data(), send_counts, DType::kInt32, &result).Wait();
    EXPECT_EQ(result.recv_counts, recv_counts);
    const int32_t* out = result.output.data<int32_t>();
    EXPECT_EQ(std::vector<int32_t>(out, out + result.output.numel()), expected);
  });
}

TEST(CustomTransport, BroadcastFromEveryRoot) {
  const int w = 5;
  RunOnQueueTransport(w, [](Communicator& comm) {
    for (int root = 0; root < w; ++root) {
      for (Algorithm a : {Algorithm::kTree, Algorithm::kScatterAllGather}) {
        std::vector<int64_t> buffer(37, comm.rank() == root ? 0 : -1);
        if (comm.rank() == root) std::iota(buffer.begin(), buffer.end(), root * 100);
        comm.Broadcast(buffer.data(), buffer.size(), DType::kInt64, {.root = root, .algorithm = a})
            .Wait();
        std::vector<int64_t> expected(37);
        std::iota(expected.begin(), expected.end(), root * 100);
        EXPECT_EQ(buffer, expected) << "root " << root << " " << AlgorithmName(a);
      }
    }
  });
}

TEST(CustomTransport, SplitAndMismatchDetectionWork) {
  RunOnQueueTransport(4, [](Communicator& world) {
    const int r = world.rank();
    auto half = world.Split(r % 2, r, "half");
    ASSERT_NE(half, nullptr);
    EXPECT_EQ(half->size(), 2);
    float x = static_cast<float>(r);
    half->AllReduce(&x, &x, 1, DType::kFloat32).Wait();
    EXPECT_EQ(x, r % 2 == 0 ? 0.0f + 2.0f : 1.0f + 3.0f);
    // A count mismatch travels in the headers the transport delivers untouched.
    std::vector<float> v(3, 1.0f), gathered(8, 0.0f);
    try {
      half->AllGather(v.data(), gathered.data(), half->rank() == 0 ? 2 : 3, DType::kFloat32,
                      {.algorithm = Algorithm::kLinear})
          .Wait();
      ADD_FAILURE() << "mismatched allgather counts went unnoticed";
    } catch (const PeerError& e) {
      EXPECT_NE(std::string(e.what()).find("allgather"), std::string::npos) << e.what();
    }
    // The native algorithm needs a transport with its own collectives.
    EXPECT_THROW(world.AllReduce(&x, &x, 1, DType::kFloat32, {.algorithm = Algorithm::kNative}),
                 InvalidArgument);
  });
}

TEST(CustomTransport, RejectsANullTransport) {
  EXPECT_THROW(CreateCommunicator(nullptr), InvalidArgument);
}

}  // namespace
}  // namespace switchyard::comm
