#include "comm/inprocess_transport.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <thread>

#include "comm/copy.h"
#include "switchyard/comm/reduce.h"
#include "switchyard/core/error.h"

namespace switchyard::comm::inproc {

void Event::Notify() {
  {
    std::lock_guard<std::mutex> lock(mu);
    generation.fetch_add(1, std::memory_order_release);
  }
  cv.notify_all();
}

namespace {

enum State : int { kPosted, kMatched, kDone, kFailed };

// How long a waiter yields before it sleeps on its event.
constexpr auto kSpinBeforeSleep = std::chrono::microseconds(50);

// How long a timed-out rank looks at what its peers' timeouts recorded (TimeoutConsensus).
constexpr auto kTimeoutGrace = std::chrono::milliseconds(100);

// A request destroyed while its copy runs waits for the copy; this long means the copy is lost.
constexpr auto kStuckCopyLimit = std::chrono::seconds(60);

// Transfers up to this size are copied at once by the thread that matched them.
constexpr size_t kEagerCopyBytes = 16 << 10;

uint64_t Mix(uint64_t x) {  // splitmix64 finalizer
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

struct Transfer;

class InProcRequest final : public Request {
 public:
  InProcRequest(bool is_send, int peer, uint64_t tag, size_t size, std::shared_ptr<Event> owner,
                Fabric* owner_fabric, int self, int peer_in_world, uint64_t group_context)
      : Request(is_send, peer, tag, size),
        event(std::move(owner)),
        fabric(owner_fabric),
        self_world(self),
        peer_world(peer_in_world),
        context(group_context) {}
  ~InProcRequest() override;

  // The matcher writes the header before it publishes the state (release).
  bool HeaderArrived() const override { return state.load(std::memory_order_acquire) != kPosted; }

  void SetReceived(const MessageHeader& h, size_t bytes) {
    header_ = h;
    received_bytes_ = bytes;
  }
  void Fail(std::string message) {
    error = std::move(message);
    state.store(kFailed, std::memory_order_release);
  }

  std::shared_ptr<Event> event;  // the owner's
  Fabric* fabric;
  int self_world;
  int peer_world;
  uint64_t context;
  const void* send_data = nullptr;
  void* recv_data = nullptr;
  bool has_reduction = false;
  RecvReduction reduction;
  MessageHeader send_header{};

  std::atomic<int> state{kPosted};
  std::shared_ptr<Transfer> transfer;  // set before state becomes kMatched
  std::string error;                   // set before state becomes kFailed
};

struct Transfer {
  const std::byte* src = nullptr;
  std::byte* dst = nullptr;
  size_t bytes = 0;
  bool reduce = false;
  RecvReduction reduction;
  size_t chunk = 0;
  size_t num_chunks = 1;
  std::atomic<size_t> next_chunk{0};
  std::atomic<size_t> chunks_done{0};
  Clock::time_point ready_at{};   // emulation: completion not before this
  InProcRequest* send = nullptr;  // valid until both are kDone
  InProcRequest* recv = nullptr;
  std::shared_ptr<Event> send_event;
  std::shared_ptr<Event> recv_event;
};

namespace {

void Complete(Transfer& t) {
  // After a state store the owner may destroy its request: touch neither afterwards.
  t.send->state.store(kDone, std::memory_order_release);
  t.recv->state.store(kDone, std::memory_order_release);
  t.send_event->Notify();
  if (t.recv_event != t.send_event) t.recv_event->Notify();
}

// Claims and copies chunks of `t` until none is left; true if this thread copied any.
bool Progress(const std::shared_ptr<Transfer>& keep) {
  Transfer& t = *keep;
  bool did = false;
  for (;;) {
    size_t c = t.next_chunk.fetch_add(1, std::memory_order_relaxed);
    if (c >= t.num_chunks) break;
    size_t begin = c * t.chunk;
    size_t end = std::min(t.bytes, begin + t.chunk);
    if (end > begin) {
      if (t.reduce) {
        size_t elem = DTypeSize(t.reduction.dtype);
        ReduceInto(t.dst + begin, static_cast<const std::byte*>(t.reduction.local) + begin,
                   t.src + begin, (end - begin) / elem, t.reduction.dtype, t.reduction.op);
      } else {
        CopyBytes(t.dst + begin, t.src + begin, end - begin);
      }
    }
    did = true;
    if (t.chunks_done.fetch_add(1, std::memory_order_acq_rel) + 1 == t.num_chunks) Complete(t);
  }
  return did;
}

// Pairs a send with a receive; called with the destination mailbox locked by the thread that
// posted `own` (one of the two). Returns the transfer, or null if the pair failed (message larger
// than the receive).
//
// Publication order: everything is written first, then `own`'s state, the partner's state last.
// Once the partner's owner sees its request matched (or failed) it may copy and complete the
// transfer, or throw and destroy its request; nothing may touch the partner's request after that
// (a late kMatched store once overwrote a completion and hung the waiter).
std::shared_ptr<Transfer> Match(InProcRequest* send, InProcRequest* recv, const InProcRequest* own,
                                Fabric& fabric) {
  InProcRequest* mine = own == send ? send : recv;
  InProcRequest* partner = own == send ? recv : send;
  if (send->size() > recv->size()) {
    recv->SetReceived(send->send_header, send->size());
    std::string send_error = fmt::format(
        "message of {} bytes to rank {} (world rank {}) does not fit its "
        "receive of {} bytes",
        send->size(), send->peer(), send->peer_world, recv->size());
    std::string recv_error = fmt::format(
        "message of {} bytes from rank {} (world rank {}) does not fit the "
        "{} bytes expected",
        send->size(), recv->peer(), recv->peer_world, recv->size());
    mine->Fail(std::move(mine == send ? send_error : recv_error));
    partner->Fail(std::move(partner == send ? send_error : recv_error));
    return nullptr;
  }
  auto t = std::make_shared<Transfer>();
  t->src = static_cast<const std::byte*>(send->send_data);
  t->dst = static_cast<std::byte*>(recv->recv_data);
  t->bytes = send->size();
  t->reduce = recv->has_reduction;
  t->reduction = recv->reduction;
  t->chunk = fabric.chunk_bytes();
  t->num_chunks = t->bytes <= kEagerCopyBytes ? 1 : (t->bytes + t->chunk - 1) / t->chunk;
  if (t->num_chunks == 1) t->chunk = std::max<size_t>(t->bytes, 1);
  if (fabric.emulated()) {
    t->ready_at = fabric.Schedule(send->self_world, recv->self_world, t->bytes, Clock::now());
  }
  t->send = send;
  t->recv = recv;
  t->send_event = send->event;
  t->recv_event = recv->event;
  recv->SetReceived(send->send_header, t->bytes);
  send->transfer = t;
  recv->transfer = t;
  mine->state.store(kMatched, std::memory_order_release);
  if (fabric.match_pause().count() > 0) std::this_thread::sleep_for(fabric.match_pause());
  partner->state.store(kMatched, std::memory_order_release);
  return t;
}

// After matching outside the lock: copy small transfers at once, else wake the partner so it
// helps; a failed pair wakes both.
void AfterMatch(const std::shared_ptr<Transfer>& t, const std::shared_ptr<Event>& partner_event) {
  if (t && t->num_chunks == 1) {
    Progress(t);
  } else {
    partner_event->Notify();
  }
}

bool IsReady(InProcRequest& r, Clock::time_point* wake) {
  const Transfer& t = *r.transfer;
  if (t.ready_at == Clock::time_point{}) return true;
  Clock::time_point now = Clock::now();
  if (now >= t.ready_at) return true;
  *wake = std::min(*wake, t.ready_at);
  return false;
}

std::string DescribeRequest(const InProcRequest& r) {
  int s = r.state.load(std::memory_order_acquire);
  return fmt::format("{} rank {} (world rank {}) of {} bytes, tag {:#x}: {}",
                     r.is_send() ? "send to" : "receive from", r.peer(), r.peer_world, r.size(),
                     r.tag(), s == kPosted ? "peer never posted its side" : "copy in progress");
}

// "timed out waiting for rank 3 (world rank 3): receive from rank 3 ... [; ...]": requests whose
// peer never showed up first, they name the missing peers.
std::string DescribeTimeout(std::span<Request* const> requests) {
  std::vector<const InProcRequest*> posted, matched;
  for (Request* q : requests) {
    if (!q) continue;
    const auto& r = static_cast<const InProcRequest&>(*q);
    int s = r.state.load(std::memory_order_acquire);
    if (s == kPosted) posted.push_back(&r);
    if (s == kMatched) matched.push_back(&r);
  }
  std::string who = posted.empty() ? std::string("copies to finish")
                                   : fmt::format("rank {} (world rank {})", posted[0]->peer(),
                                                 posted[0]->peer_world);
  std::string details;
  int listed = 0;
  for (const auto* list : {&posted, &matched}) {
    for (const InProcRequest* r : *list) {
      if (listed++ == 4) details += "; ...";
      if (listed > 4) break;
      details += (details.empty() ? "" : "; ") + DescribeRequest(*r);
    }
  }
  return fmt::format("timed out waiting for {} ({} of {} requests outstanding: {})", who,
                     posted.size() + matched.size(), requests.size(), details);
}

}  // namespace

InProcRequest::~InProcRequest() {
  int s = state.load(std::memory_order_acquire);
  if (s == kPosted) {
    int box_rank = is_send() ? peer_world : self_world;
    Mailbox& box = fabric->mailbox(box_rank);
    std::unique_lock<std::mutex> lock(box.mu);
    s = state.load(std::memory_order_acquire);
    if (s == kPosted) {
      auto& list = is_send() ? box.pending_sends : box.posted_recvs;
      std::erase(list, this);
      return;
    }
  }
  // Matched: finish the copy (both buffers are still valid) before letting go of the buffer. The
  // copy is in the hands of this thread and the partner's, so it ends; if it does not (a broken
  // invariant), stop loudly rather than hang or free a buffer that is still being read.
  const Clock::time_point give_up = Clock::now() + kStuckCopyLimit;
  while (state.load(std::memory_order_acquire) == kMatched) {
    std::shared_ptr<Transfer> t = transfer;
    if (Progress(t)) continue;
    if (Clock::now() > give_up) {
      std::fprintf(stderr,
                   "switchyard: %s:%d: in-process %s of %zu bytes (tag %#llx, world rank %d with "
                   "world rank %d) still matched %lld s after its owner let go of it\n",
                   __FILE__, __LINE__, is_send() ? "send" : "receive", size(),
                   static_cast<unsigned long long>(tag()), self_world, peer_world,
                   static_cast<long long>(
                       std::chrono::duration_cast<std::chrono::seconds>(kStuckCopyLimit).count()));
      std::abort();
    }
    std::this_thread::yield();
  }
}

// ---- Fabric ----

Fabric::Fabric(int world_size, const InProcessOptions& options)
    : world_size_(world_size),
      ranks_per_node_(options.ranks_per_node > 0 ? options.ranks_per_node : world_size),
      chunk_bytes_(std::max<size_t>(64, options.copy_chunk_bytes / 64 * 64)),
      emulation_(options.emulation),
      port_free_(static_cast<size_t>(world_size) * 2) {
  for (int r = 0; r < world_size; ++r) mailboxes_.push_back(std::make_unique<Mailbox>());
}

Clock::time_point Fabric::Schedule(int src, int dst, size_t bytes, Clock::time_point now) {
  if (src == dst) return now;
  bool inter = NodeOf(src) != NodeOf(dst);
  const LinkModel& link = inter ? emulation_->inter_node : emulation_->intra_node;
  double seconds = link.latency_us * 1e-6;
  if (link.bandwidth_gbps > 0) seconds += static_cast<double>(bytes) / (link.bandwidth_gbps * 1e9);
  auto cost = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  std::lock_guard<std::mutex> lock(emulation_mu_);
  Clock::time_point& port = port_free_[static_cast<size_t>(src) * 2 + (inter ? 1 : 0)];
  port = std::max(port, now) + cost;
  return port;
}

void Fabric::MarkFailed(int world_rank, uint64_t context, const std::string& reason) {
  std::vector<std::shared_ptr<Event>> wake;
  {
    std::lock_guard<std::mutex> lock(failure_mu_);
    failures_.emplace(std::make_pair(world_rank, context), reason);
    failure_epoch_.fetch_add(1, std::memory_order_acq_rel);
    for (auto& weak : events_) {
      if (auto e = weak.lock()) wake.push_back(std::move(e));
    }
  }
  for (auto& e : wake) e->Notify();
}

bool Fabric::FailureOf(int world_rank, uint64_t context, std::string* reason) {
  std::lock_guard<std::mutex> lock(failure_mu_);
  // The group's own record first: it carries the root cause ("failed: allreduce ... rank 3
  // left"), while the world-wide one a rank leaves when its thread returns says only "left".
  for (uint64_t c : {context, uint64_t{0}}) {
    auto it = failures_.find({world_rank, c});
    if (it != failures_.end()) {
      *reason = it->second;
      return true;
    }
  }
  return false;
}

void Fabric::RecordTimeout(uint64_t context, int world_rank, int waited_for_world) {
  std::lock_guard<std::mutex> lock(failure_mu_);
  timeouts_[context][world_rank] = waited_for_world;
}

std::map<int, int> Fabric::TimeoutsOf(uint64_t context) {
  std::lock_guard<std::mutex> lock(failure_mu_);
  return timeouts_[context];
}

void Fabric::Register(const std::shared_ptr<Event>& event) {
  std::lock_guard<std::mutex> lock(failure_mu_);
  std::erase_if(events_, [](const std::weak_ptr<Event>& e) { return e.expired(); });
  events_.push_back(event);
}

// ---- InProcessTransport ----

InProcessTransport::InProcessTransport(std::shared_ptr<Fabric> fabric, uint64_t context,
                                       std::vector<int> members, int rank)
    : fabric_(std::move(fabric)),
      context_(context),
      members_(std::move(members)),
      rank_(rank),
      world_rank_(members_[static_cast<size_t>(rank)]),
      event_(std::make_shared<Event>()) {
  fabric_->Register(event_);
  // Node layout: blocks of equal size, each on one node, nodes distinct.
  const int w = size();
  int per_node = 1;
  while (per_node < w &&
         fabric_->NodeOf(members_[static_cast<size_t>(per_node)]) == fabric_->NodeOf(members_[0])) {
    ++per_node;
  }
  bool uniform = w % per_node == 0;
  for (int i = 0; uniform && i < w; ++i) {
    int block_node = fabric_->NodeOf(members_[static_cast<size_t>(i / per_node * per_node)]);
    uniform = fabric_->NodeOf(members_[static_cast<size_t>(i)]) == block_node;
    if (uniform && i % per_node == 0 && i > 0) {
      uniform = block_node != fabric_->NodeOf(members_[static_cast<size_t>(i - per_node)]);
    }
  }
  topology_ = uniform ? Topology{w / per_node, per_node} : Topology{1, w};
}

void InProcessTransport::CheckPeer(int peer) const {
  SY_REQUIRE(peer >= 0 && peer < size(), InvalidArgument,
             "peer {} is not a rank of this group of {} ranks", peer, size());
}

RequestPtr InProcessTransport::Isend(int peer, uint64_t tag, const void* data, size_t bytes,
                                     const MessageHeader& header) {
  CheckPeer(peer);
  int peer_world = members_[static_cast<size_t>(peer)];
  auto req = std::make_unique<InProcRequest>(true, peer, tag, bytes, event_, fabric_.get(),
                                             world_rank_, peer_world, context_);
  req->send_data = data;
  req->send_header = header;
  std::shared_ptr<Transfer> t;
  std::shared_ptr<Event> partner;
  bool failed = false;
  {
    Mailbox& box = fabric_->mailbox(peer_world);
    std::lock_guard<std::mutex> lock(box.mu);
    auto it =
        std::find_if(box.posted_recvs.begin(), box.posted_recvs.end(), [&](const InProcRequest* r) {
          return r->peer_world == world_rank_ && r->context == context_ && r->tag() == tag;
        });
    if (it == box.posted_recvs.end()) {
      box.pending_sends.push_back(req.get());
    } else {
      InProcRequest* recv = *it;
      box.posted_recvs.erase(it);
      partner = recv->event;
      t = Match(req.get(), recv, req.get(), *fabric_);
      failed = t == nullptr;
    }
  }
  if (t || failed) AfterMatch(t, partner);
  return req;
}

RequestPtr InProcessTransport::Irecv(int peer, uint64_t tag, void* data, size_t capacity,
                                     const RecvReduction* reduction) {
  CheckPeer(peer);
  int peer_world = members_[static_cast<size_t>(peer)];
  auto req = std::make_unique<InProcRequest>(false, peer, tag, capacity, event_, fabric_.get(),
                                             world_rank_, peer_world, context_);
  req->recv_data = data;
  if (reduction) {
    req->has_reduction = true;
    req->reduction = *reduction;
    SY_CHECK(capacity % DTypeSize(reduction->dtype) == 0, "reduce receive of {} bytes", capacity);
  }
  std::shared_ptr<Transfer> t;
  std::shared_ptr<Event> partner;
  bool failed = false;
  {
    Mailbox& box = fabric_->mailbox(world_rank_);
    std::lock_guard<std::mutex> lock(box.mu);
    auto it = std::find_if(
        box.pending_sends.begin(), box.pending_sends.end(), [&](const InProcRequest* s) {
          return s->self_world == peer_world && s->context == context_ && s->tag() == tag;
        });
    if (it == box.pending_sends.end()) {
      box.posted_recvs.push_back(req.get());
    } else {
      InProcRequest* send = *it;
      box.pending_sends.erase(it);
      partner = send->event;
      t = Match(send, req.get(), req.get(), *fabric_);
      failed = t == nullptr;
    }
  }
  if (t || failed) AfterMatch(t, partner);
  return req;
}

void InProcessTransport::Wait(std::span<Request* const> requests, Deadline deadline) {
  int idle_rounds = 0;
  Clock::time_point spin_until;
  for (;;) {
    uint64_t generation = event_->generation.load(std::memory_order_acquire);
    uint64_t failure_epoch = fabric_->failure_epoch();
    bool all_done = true;
    bool worked = false;
    Clock::time_point wake = deadline;
    for (Request* q : requests) {
      if (!q) continue;
      auto& r = static_cast<InProcRequest&>(*q);
      int s = r.state.load(std::memory_order_acquire);
      if (s == kMatched) {
        std::shared_ptr<Transfer> t = r.transfer;
        worked |= Progress(t);
        s = r.state.load(std::memory_order_acquire);
      }
      if (s == kDone) {
        if (!IsReady(r, &wake)) all_done = false;
        continue;
      }
      if (s == kFailed) throw PeerError(r.error);
      all_done = false;
      std::string reason;
      // A peer that left after its side of this transfer matched is no failure: the record is
      // made after the peer's own requests matched, so look at the state again after reading it.
      if (s == kPosted && failure_epoch != 0 &&
          fabric_->FailureOf(r.peer_world, context_, &reason) &&
          r.state.load(std::memory_order_acquire) == kPosted) {
        throw PeerError(fmt::format("rank {} (world rank {}) {}", r.peer(), r.peer_world, reason));
      }
    }
    if (all_done) return;
    if (worked) continue;
    if (Clock::now() >= deadline) {
      int waited_for = -1;
      for (Request* q : requests) {
        auto* r = static_cast<InProcRequest*>(q);
        if (r && r->state.load(std::memory_order_acquire) == kPosted) {
          waited_for = r->peer_world;
          break;
        }
      }
      throw TimeoutError(DescribeTimeout(requests) + TimeoutConsensus(waited_for));
    }
    // Yield for a little while before sleeping: partners are often about to post, and a
    // futex sleep + wake costs more than the wait itself.
    if (idle_rounds++ == 0) spin_until = Clock::now() + kSpinBeforeSleep;
    if (Clock::now() < spin_until) {
      std::this_thread::yield();
      continue;
    }
    std::unique_lock<std::mutex> lock(event_->mu);
    event_->cv.wait_until(lock, wake, [&] {
      return event_->generation.load(std::memory_order_acquire) != generation;
    });
  }
}

// Peers usually reach their deadlines together, each knowing only the neighbour it waited for.
// Every timed-out rank records whom it waited for and looks for a moment at what the others
// recorded: a rank somebody waited for that recorded nothing never arrived.
std::string InProcessTransport::TimeoutConsensus(int waited_for_world) {
  fabric_->RecordTimeout(context_, world_rank_, waited_for_world);
  std::this_thread::sleep_for(kTimeoutGrace);
  std::map<int, int> timed_out = fabric_->TimeoutsOf(context_);
  std::string names;
  std::set<int> missing;
  for (const auto& [from, waited] : timed_out) {
    if (waited >= 0 && !timed_out.count(waited)) missing.insert(waited);
  }
  for (int world : missing) {
    auto it = std::find(members_.begin(), members_.end(), world);
    int group_rank = it == members_.end() ? -1 : static_cast<int>(it - members_.begin());
    names += fmt::format("{}rank {} (world rank {})", names.empty() ? "" : ", ", group_rank, world);
  }
  if (names.empty()) return "";
  return "; ranks that never arrived (recorded no timeout of their own): " + names;
}

bool InProcessTransport::Test(Request& request) {
  auto& r = static_cast<InProcRequest&>(request);
  int s = r.state.load(std::memory_order_acquire);
  if (s == kMatched) {
    std::shared_ptr<Transfer> t = r.transfer;
    Progress(t);
    s = r.state.load(std::memory_order_acquire);
  }
  if (s == kFailed) throw PeerError(r.error);
  Clock::time_point wake = Clock::time_point::max();
  return s == kDone && IsReady(r, &wake);
}

std::unique_ptr<Transport> InProcessTransport::Split(int color, int key, uint64_t tag,
                                                     Deadline deadline) {
  std::vector<std::array<int, 2>> keys = ExchangeSplitKeys(color, key, tag, deadline);
  uint64_t split_index = splits_++;
  if (color < 0) return nullptr;
  std::vector<int> order;
  for (int p = 0; p < size(); ++p) {
    if (keys[static_cast<size_t>(p)][0] == color) order.push_back(p);
  }
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return keys[static_cast<size_t>(a)][1] < keys[static_cast<size_t>(b)][1];
  });
  std::vector<int> members;
  int new_rank = -1;
  for (int p : order) {
    if (p == rank_) new_rank = static_cast<int>(members.size());
    members.push_back(members_[static_cast<size_t>(p)]);
  }
  uint64_t context =
      Mix(context_ ^ Mix(split_index * 0x100000001b3ull + static_cast<uint64_t>(color) + 1));
  return std::make_unique<InProcessTransport>(fabric_, context, std::move(members), new_rank);
}

void InProcessTransport::Abort(const std::string& reason) {
  fabric_->MarkFailed(world_rank_, context_, "failed: " + reason);
}

InProcessWorld CreateInProcessTransports(int world_size, const InProcessOptions& options) {
  SY_REQUIRE(world_size >= 1, InvalidArgument, "in-process world size must be >= 1, got {}",
             world_size);
  SY_REQUIRE(options.ranks_per_node >= 0 &&
                 (options.ranks_per_node == 0 || world_size % options.ranks_per_node == 0),
             InvalidArgument, "ranks_per_node {} must divide the world size {}",
             options.ranks_per_node, world_size);
  if (options.emulation) ValidateEmulationOptions(*options.emulation, options.timeout);
  InProcessWorld world;
  world.fabric = std::make_shared<Fabric>(world_size, options);
  std::vector<int> members(static_cast<size_t>(world_size));
  for (int r = 0; r < world_size; ++r) members[static_cast<size_t>(r)] = r;
  for (int r = 0; r < world_size; ++r) {
    world.transports.push_back(
        std::make_unique<InProcessTransport>(world.fabric, /*context=*/1, members, r));
  }
  return world;
}

}  // namespace switchyard::comm::inproc
