// The MPI transport (see switchyard/comm/mpi.h).
//
// Wire protocol: every message is two MPI messages on the transport's own communicator, a
// 40-byte header (the collective's 32 bytes + the payload length) on tag 2t and the payload on
// tag 2t + 1, always both (the payload may be empty). MPI never lets messages with one (source,
// tag) overtake each other, so headers and payloads pair up in order; a payload longer than the
// receive is truncated by MPI (MPI_ERR_TRUNCATE, never written past the buffer) and reported.
// The communicator uses MPI_ERRORS_RETURN, so MPI errors become exceptions, not aborts. MPI's own
// collectives (Algorithm::kNative) are in mpi_collectives.cc; this file waits for them.
#include <mpi.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "comm/group_communicator.h"
#include "comm/mpi_collectives.h"
#include "switchyard/comm/mpi.h"
#include "switchyard/comm/reduce.h"
#include "switchyard/comm/transport.h"
#include "switchyard/core/error.h"

namespace switchyard::comm {
namespace {

class MpiRuntime {
 public:
  static MpiRuntime& Get() {
    static MpiRuntime* runtime = new MpiRuntime();  // lives until exit (used at exit)
    return *runtime;
  }

  void Init() {
    std::lock_guard<std::mutex> lock(mu_);
    SY_REQUIRE(!finalized_, InvalidArgument, "MPI was already finalized in this process");
    int initialized = 0;
    MPI_Initialized(&initialized);
    int provided = 0;
    if (!initialized) {
      MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      initialized_by_us_ = true;
      std::atexit([] { FinalizeMpi(); });
    } else {
      MPI_Query_thread(&provided);
    }
    SY_REQUIRE(provided >= MPI_THREAD_MULTIPLE, InvalidArgument,
               "MPI provides thread level {}, switchyard needs MPI_THREAD_MULTIPLE ({}): "
               "communicators make progress on their own threads",
               provided, MPI_THREAD_MULTIPLE);
    mpi::CreateBFloat16Ops();
  }

  void Finalize() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!initialized_by_us_ || finalized_) return;
    int done = 0;
    MPI_Finalized(&done);
    if (!done) {
      mpi::FreeBFloat16Ops();
      MPI_Finalize();
    }
    finalized_ = true;
  }

  static bool Alive() {
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    return initialized && !finalized;
  }

 private:
  std::mutex mu_;
  bool initialized_by_us_ = false;
  bool finalized_ = false;
};

struct WireHeader {
  MessageHeader user;
  uint64_t bytes;
};

class MpiRequest final : public Request {
 public:
  MpiRequest(bool is_send, int peer, uint64_t tag, size_t size, int peer_in_world)
      : Request(is_send, peer, tag, size), peer_world(peer_in_world) {}

  ~MpiRequest() override {
    if (!MpiRuntime::Alive()) return;
    for (MPI_Request* r : {&header_req, &payload_req}) {
      if (*r == MPI_REQUEST_NULL) continue;
      if (is_send()) {
        MPI_Request_free(r);  // MPI finishes it in the background (sends cannot be cancelled)
      } else {
        MPI_Cancel(r);
        MPI_Wait(r, MPI_STATUS_IGNORE);
      }
    }
  }

  // Tests the MPI requests; true when both finished. Throws PeerError on failure.
  bool Progress() {
    if (done) return true;
    if (header_req != MPI_REQUEST_NULL) {
      int flag = 0;
      SY_MPI_CALL(MPI_Test(&header_req, &flag, MPI_STATUS_IGNORE));
      if (flag && !is_send()) {
        header_ = wire.user;
        received_bytes_ = static_cast<size_t>(wire.bytes);
        if (wire.bytes > size()) {
          failed = fmt::format(
              "message of {} bytes from rank {} (world rank {}) does not fit the "
              "{} bytes expected",
              wire.bytes, peer(), peer_world, size());
        }
      }
    }
    if (payload_req != MPI_REQUEST_NULL) {
      int flag = 0;
      MPI_Status status;
      int rc = MPI_Test(&payload_req, &flag, &status);
      if (rc != MPI_SUCCESS) {
        payload_req = MPI_REQUEST_NULL;  // completed in error (e.g. MPI_ERR_TRUNCATE)
        if (failed.empty()) {
          failed = fmt::format("{} rank {} (world rank {}) failed: {}",
                               is_send() ? "send to" : "receive from", peer(), peer_world,
                               mpi::ErrorString(rc));
        }
      } else if (flag && !is_send()) {
        int n = 0;
        MPI_Get_count(&status, MPI_BYTE, &n);
        payload_bytes = static_cast<size_t>(n);
      }
    }
    if (header_req != MPI_REQUEST_NULL) return false;
    if (!failed.empty()) throw PeerError(failed);
    if (payload_req != MPI_REQUEST_NULL) return false;
    if (reduce) {
      ReduceInto(dst, reduction.local, staging.data(), payload_bytes / DTypeSize(reduction.dtype),
                 reduction.dtype, reduction.op);
    }
    done = true;
    return true;
  }

  int peer_world;
  WireHeader wire{};
  MPI_Request header_req = MPI_REQUEST_NULL;
  MPI_Request payload_req = MPI_REQUEST_NULL;
  bool done = false;
  size_t payload_bytes = 0;
  std::string failed;
  // Receives that reduce land in `staging` and are reduced into `dst` on completion.
  bool reduce = false;
  RecvReduction reduction;
  void* dst = nullptr;
  std::vector<std::byte> staging;
};

// World ranks -> node index, shared by a world and its splits.
using NodeMap = std::shared_ptr<const std::vector<int>>;

class MpiTransport final : public Transport {
 public:
  MpiTransport(MPI_Comm comm, NodeMap nodes) : comm_(comm), nodes_(std::move(nodes)) {
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    int* ub = nullptr;
    int flag = 0;
    MPI_Comm_get_attr(comm_, MPI_TAG_UB, &ub, &flag);
    int tag_ub = flag && ub ? *ub : 32767;
    abort_tag_ = tag_ub;  // odd tags below it carry payloads, even ones headers
    tag_space_ = static_cast<uint64_t>(tag_ub - 1) / 2;
    MPI_Group world_group, group;
    MPI_Comm_group(MPI_COMM_WORLD, &world_group);
    MPI_Comm_group(comm_, &group);
    std::vector<int> ranks(static_cast<size_t>(size_));
    for (int i = 0; i < size_; ++i) ranks[static_cast<size_t>(i)] = i;
    world_ranks_.resize(static_cast<size_t>(size_));
    MPI_Group_translate_ranks(group, size_, ranks.data(), world_group, world_ranks_.data());
    MPI_Group_free(&group);
    MPI_Group_free(&world_group);
    // Node layout: blocks of equal size on distinct nodes, else one node.
    auto node = [&](int i) {
      return (*nodes_)[static_cast<size_t>(world_ranks_[static_cast<size_t>(i)])];
    };
    int per = 1;
    while (per < size_ && node(per) == node(0)) ++per;
    bool uniform = size_ % per == 0;
    for (int i = 0; uniform && i < size_; ++i) {
      uniform = node(i) == node(i / per * per) && (i < per || node(i) != node(i - per));
    }
    topology_ = uniform ? Topology{size_ / per, per} : Topology{1, size_};
    native_ = mpi::CreateMpiCollectives(
        comm_,
        [this](MPI_Request& r, Deadline deadline, const char* what) { Poll(r, deadline, what); });
  }

  // A communicator that saw a failure may still have unmatched messages in flight. OpenMPI
  // reuses the context id of a freed communicator, so they could match in a later one: such a
  // communicator is therefore never freed (a small, deliberate leak after a failure).
  ~MpiTransport() override {
    if (MpiRuntime::Alive() && !tainted_.load()) MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view kind() const override { return "mpi"; }
  int WorldRank(int group_rank) const override {
    return world_ranks_[static_cast<size_t>(group_rank)];
  }
  Topology topology() const override { return topology_; }
  NativeCollectives* native() override { return native_.get(); }

  RequestPtr Isend(int peer, uint64_t tag, const void* data, size_t bytes,
                   const MessageHeader& header) override {
    CheckPeer(peer);
    auto req = std::make_unique<MpiRequest>(true, peer, tag, bytes, WorldRank(peer));
    req->wire.user = header;
    req->wire.bytes = bytes;
    SY_MPI_CALL(MPI_Isend(&req->wire, sizeof(WireHeader), MPI_BYTE, peer, HeaderTag(tag), comm_,
                          &req->header_req));
    SY_MPI_CALL(MPI_Isend(data, mpi::ToInt(bytes, "message size"), MPI_BYTE, peer, PayloadTag(tag),
                          comm_, &req->payload_req));
    return req;
  }

  RequestPtr Irecv(int peer, uint64_t tag, void* data, size_t capacity,
                   const RecvReduction* reduction) override {
    CheckPeer(peer);
    auto req = std::make_unique<MpiRequest>(false, peer, tag, capacity, WorldRank(peer));
    void* target = data;
    if (reduction) {
      req->reduce = true;
      req->reduction = *reduction;
      req->dst = data;
      req->staging.resize(capacity);
      target = req->staging.data();
    }
    SY_MPI_CALL(MPI_Irecv(&req->wire, sizeof(WireHeader), MPI_BYTE, peer, HeaderTag(tag), comm_,
                          &req->header_req));
    SY_MPI_CALL(MPI_Irecv(target, mpi::ToInt(capacity, "receive size"), MPI_BYTE, peer,
                          PayloadTag(tag), comm_, &req->payload_req));
    return req;
  }

  void Wait(std::span<Request* const> requests, Deadline deadline) override {
    try {
      for (int spins = 0;; ++spins) {
        bool all_done = true;
        for (Request* q : requests) {
          if (q && !static_cast<MpiRequest*>(q)->Progress()) all_done = false;
        }
        if (all_done) return;
        auto first_unmatched_peer = [&] {
          for (Request* q : requests) {
            auto* r = static_cast<MpiRequest*>(q);
            if (r && !r->done && r->header_req != MPI_REQUEST_NULL) return r->peer();
          }
          return -1;
        };
        if (spins % 64 == 63) {
          // A peer reached its deadline first (ranks start a collective at different moments,
          // more so under load): join its timeout consensus now with whom this rank waits for,
          // instead of repeating the peer's partial view, so that every rank can name the rank
          // that never arrived.
          if (PeerAnnouncedTimeout()) {
            throw TimeoutError(DescribeTimeout(requests) +
                               TimeoutConsensus(first_unmatched_peer()));
          }
          CheckAborts();
        }
        if (Clock::now() >= deadline) {
          throw TimeoutError(DescribeTimeout(requests) + TimeoutConsensus(first_unmatched_peer()));
        }
        sched_yield();
      }
    } catch (...) {
      tainted_ = true;
      throw;
    }
  }

  // Tells every other member that this rank failed in this group (fire and forget).
  void Abort(const std::string& reason) override {
    tainted_ = true;
    {
      std::lock_guard<std::mutex> lock(abort_mu_);
      if (aborted_) return;
      aborted_ = true;
    }
    std::string notice = "A";
    notice += reason.substr(0, kMaxAbortNotice);
    SendNotice(std::move(notice));
  }

  bool Test(Request& request) override {
    try {
      return static_cast<MpiRequest&>(request).Progress();
    } catch (...) {
      tainted_ = true;
      throw;
    }
  }

  std::unique_ptr<Transport> Split(int color, int key, uint64_t tag, Deadline deadline) override {
    // The exchange has a deadline, so a missing member is reported; MPI_Comm_split then runs
    // with every member present.
    ExchangeSplitKeys(color, key, tag, deadline);
    MPI_Comm sub = MPI_COMM_NULL;
    SY_MPI_CALL(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &sub));
    if (sub == MPI_COMM_NULL) return nullptr;
    return std::make_unique<MpiTransport>(sub, nodes_);
  }

 private:
  int HeaderTag(uint64_t tag) const { return static_cast<int>((tag % tag_space_) * 2); }
  int PayloadTag(uint64_t tag) const { return HeaderTag(tag) + 1; }

  void CheckPeer(int peer) const {
    SY_REQUIRE(peer >= 0 && peer < size_, InvalidArgument,
               "peer {} is not a rank of this group of {} ranks", peer, size_);
  }

  // Waits for one of MPI's own collectives (mpi_collectives.cc). MPI offers no way to abandon a
  // non-blocking collective: after a timeout it stays posted and
  // the communicator is unusable (as the Communicator contract says).
  void Poll(MPI_Request& r, Deadline deadline, const char* what) {
    for (int spins = 0;; ++spins) {
      int flag = 0;
      SY_MPI_CALL(MPI_Test(&r, &flag, MPI_STATUS_IGNORE));
      if (flag) return;
      if (spins % 64 == 63) CheckAborts();
      if (Clock::now() >= deadline) {
        tainted_ = true;
        throw TimeoutError(fmt::format("timed out in MPI's own {} (some rank did not join){}", what,
                                       TimeoutConsensus(-1)));
      }
      sched_yield();
    }
  }

  // Notices travel on abort_tag_ between the members of this group, fire and forget:
  //   "A<reason>"  the sender's collective failed (it will not take part any more);
  //   "T<rank>"    the sender timed out waiting for group rank <rank> (-1: not known).
  void SendNotice(std::string text) {
    std::lock_guard<std::mutex> lock(abort_mu_);
    sent_notices_.push_back(std::move(text));  // alive as long as the communicator (MPI reads it)
    const std::string& notice = sent_notices_.back();
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      MPI_Request r;
      if (MPI_Isend(notice.data(), static_cast<int>(notice.size()), MPI_CHAR, p, abort_tag_, comm_,
                    &r) == MPI_SUCCESS) {
        MPI_Request_free(&r);
      }
    }
  }

  // Receives every notice that has arrived (abort_mu_ held).
  void DrainNoticesLocked() {
    for (;;) {
      int flag = 0;
      MPI_Status status;
      MPI_Iprobe(MPI_ANY_SOURCE, abort_tag_, comm_, &flag, &status);
      if (!flag) return;
      int len = 0;
      MPI_Get_count(&status, MPI_CHAR, &len);
      std::string notice(static_cast<size_t>(std::max(len, 0)), '\0');
      MPI_Recv(notice.data(), len, MPI_CHAR, status.MPI_SOURCE, abort_tag_, comm_,
               MPI_STATUS_IGNORE);
      const int from = status.MPI_SOURCE;
      if (!notice.empty() && notice[0] == 'T') {
        timed_out_[from] = std::atoi(notice.c_str() + 1);
      } else if (failure_.empty()) {
        failure_ = fmt::format("rank {} (world rank {}) failed: {}", from, WorldRank(from),
                               notice.empty() ? notice : notice.substr(1));
      }
    }
  }

  std::string Name(int group_rank) const {
    return fmt::format("rank {} (world rank {})", group_rank, WorldRank(group_rank));
  }

  // True if a member announced a timeout ("T" notice) and none announced a failure.
  bool PeerAnnouncedTimeout() {
    std::lock_guard<std::mutex> lock(abort_mu_);
    DrainNoticesLocked();
    return failure_.empty() && !timed_out_.empty();
  }

  // Throws PeerError if a member announced that it failed or gave up (now or earlier).
  void CheckAborts() {
    std::lock_guard<std::mutex> lock(abort_mu_);
    DrainNoticesLocked();
    if (failure_.empty() && !timed_out_.empty()) {
      auto [from, waited] = *timed_out_.begin();
      failure_ = fmt::format("{} timed out waiting for {}", Name(from),
                             waited >= 0 ? Name(waited) : std::string("MPI"));
    }
    if (failure_.empty()) return;
    tainted_ = true;
    NoteFailureReportedByPeer();  // the rank that failed or timed out first reports it
    throw PeerError(failure_);
  }

  // At this rank's deadline. Peers usually reach theirs at about the same moment, and each of
  // them only knows the neighbour it waited for. Every timed-out rank announces whom it waited
  // for ("T" notice) and listens for a moment: a rank that somebody waited for but that announced
  // nothing never arrived. Returns "; ranks that never arrived: ..." (or "" if none is known);
  // throws PeerError instead if a peer reported a failure of its own meanwhile.
  std::string TimeoutConsensus(int waited_for) {
    SendNotice("T" + std::to_string(waited_for));
    Deadline until = Clock::now() + kTimeoutGrace;
    std::map<int, int> timed_out;
    std::string failure;
    // Listen for the whole window even if a peer's failure notice arrives first: that peer may
    // itself have given up without knowing who was missing.
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(abort_mu_);
        DrainNoticesLocked();
        failure = failure_;
        timed_out = timed_out_;
      }
      if (Clock::now() >= until) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    timed_out[rank_] = waited_for;
    std::set<int> missing;
    for (const auto& [from, waited] : timed_out) {
      if (waited >= 0 && !timed_out.count(waited)) missing.insert(waited);
    }
    std::string names;
    for (int m : missing) names += (names.empty() ? "" : ", ") + Name(m);
    if (!names.empty()) {
      // Every timed-out rank knows the same story; the lowest of them tells it (docs/errors.md).
      if (timed_out.begin()->first != rank_) NoteFailureReportedByPeer();
      return fmt::format("; ranks that never arrived (announced no timeout of their own): {}",
                         names);
    }
    if (!failure.empty()) {
      NoteFailureReportedByPeer();
      throw PeerError(failure);
    }
    return "";
  }

  std::string DescribeTimeout(std::span<Request* const> requests) const {
    std::string who, details;
    int outstanding = 0;
    for (Request* q : requests) {
      auto* r = static_cast<MpiRequest*>(q);
      if (!r || r->done) continue;
      ++outstanding;
      bool unmatched = r->header_req != MPI_REQUEST_NULL;
      if (who.empty() && unmatched) {
        who = fmt::format("rank {} (world rank {})", r->peer(), r->peer_world);
      }
      if (outstanding <= 4) {
        details +=
            fmt::format("{}{} rank {} (world rank {}) of {} bytes: {}", details.empty() ? "" : "; ",
                        r->is_send() ? "send to" : "receive from", r->peer(), r->peer_world,
                        r->size(), unmatched ? "peer never matched it" : "payload in flight");
      }
    }
    if (who.empty()) who = "payloads to arrive";
    return fmt::format("timed out waiting for {} ({} of {} requests outstanding: {})", who,
                       outstanding, requests.size(), details);
  }

  static constexpr size_t kMaxAbortNotice = 2048;
  static constexpr auto kTimeoutGrace = std::chrono::milliseconds(300);

  MPI_Comm comm_;
  NodeMap nodes_;
  int abort_tag_ = 32767;
  std::mutex abort_mu_;
  bool aborted_ = false;                  // guarded by abort_mu_
  std::deque<std::string> sent_notices_;  // guarded by abort_mu_; kept alive for the MPI sends
  std::string failure_;                   // guarded by abort_mu_: first failure announced by a peer
  std::map<int, int> timed_out_;          // guarded by abort_mu_: peer -> rank it waited for
  std::atomic<bool> tainted_{false};      // saw a failure: never freed
  int rank_ = 0;
  int size_ = 1;
  uint64_t tag_space_ = 16384;
  std::vector<int> world_ranks_;
  Topology topology_;
  std::unique_ptr<NativeCollectives> native_;  // MPI's own collectives on comm_
};

}  // namespace

bool MpiCompiledIn() { return true; }

std::unique_ptr<Communicator> CreateMpiWorld(const MpiOptions& options) {
  MpiRuntime::Get().Init();
  int world_rank = 0, world_size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  // Node of every world rank: the lowest world rank sharing its memory, renumbered 0, 1, ...
  std::vector<int> node_of(static_cast<size_t>(world_size));
  if (options.ranks_per_node > 0) {
    SY_REQUIRE(world_size % options.ranks_per_node == 0, InvalidArgument,
               "ranks_per_node {} must divide the MPI world size {}", options.ranks_per_node,
               world_size);
    for (int r = 0; r < world_size; ++r)
      node_of[static_cast<size_t>(r)] = r / options.ranks_per_node;
  } else {
    MPI_Comm shared;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, world_rank, MPI_INFO_NULL, &shared);
    int leader = world_rank;
    MPI_Allreduce(MPI_IN_PLACE, &leader, 1, MPI_INT, MPI_MIN, shared);
    MPI_Comm_free(&shared);
    MPI_Allgather(&leader, 1, MPI_INT, node_of.data(), 1, MPI_INT, MPI_COMM_WORLD);
    std::vector<int> leaders = node_of;
    std::sort(leaders.begin(), leaders.end());
    leaders.erase(std::unique(leaders.begin(), leaders.end()), leaders.end());
    for (int& n : node_of) {
      n = static_cast<int>(std::lower_bound(leaders.begin(), leaders.end(), n) - leaders.begin());
    }
  }
  MPI_Comm comm;
  MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  auto transport = std::make_unique<MpiTransport>(
      comm, std::make_shared<const std::vector<int>>(std::move(node_of)));
  return std::make_unique<GroupCommunicator>(std::move(transport), options.name, options.timeout);
}

void FinalizeMpi() { MpiRuntime::Get().Finalize(); }

bool InMultiProcessMpiJob() { return MpiRuntime::Alive() && MpiWorldSize() > 1; }

int MpiWorldRank() {
  int rank = 0;
  if (MpiRuntime::Alive()) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

int MpiWorldSize() {
  int size = 1;
  if (MpiRuntime::Alive()) MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

void AbortMpiJob(int exit_code) {
  // MPI_Abort kills every process of the job (OpenMPI: mpirun sends SIGCONT, SIGTERM, then
  // SIGKILL), stopped ones included, and mpirun exits with exit_code.
  if (MpiRuntime::Alive()) MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::_Exit(exit_code);
}

}  // namespace switchyard::comm
