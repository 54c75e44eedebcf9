// The in-process transport (see switchyard/comm/inprocess.h for the contract).
//
// A Fabric is shared by the W ranks of one process: a mailbox per rank (pending sends addressed
// to it and receives it posted, both in FIFO order), the failure table, and the emulated links.
// An InProcessTransport is one rank's endpoint in one group (the world or a Split of it); groups
// are told apart by a 64-bit context id that is part of every match.
//
// Life of a message: Isend and Irecv each look in the destination's mailbox for a partner (same
// source, context and tag, oldest first) and enqueue themselves if there is none. The second to
// arrive creates a Transfer. Small transfers are copied at once by that thread; larger ones are
// split in chunks that every thread waiting on either request claims and copies (or reduces),
// so sender and receiver copy together. The thread that finishes the last chunk completes both
// requests and wakes their owners.
#pragma once

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "switchyard/comm/inprocess.h"
#include "switchyard/comm/transport.h"

namespace switchyard::comm::inproc {

// Wakes the threads waiting on one endpoint's requests.
struct Event {
  std::mutex mu;
  std::condition_variable cv;
  std::atomic<uint64_t> generation{0};
  void Notify();
};

class InProcRequest;

struct Mailbox {
  std::mutex mu;
  std::vector<InProcRequest*> posted_recvs;   // receives posted by this rank, oldest first
  std::vector<InProcRequest*> pending_sends;  // sends to this rank not yet received
};

class Fabric {
 public:
  Fabric(int world_size, const InProcessOptions& options);

  int world_size() const { return world_size_; }
  Mailbox& mailbox(int world_rank) { return *mailboxes_[static_cast<size_t>(world_rank)]; }
  size_t chunk_bytes() const { return chunk_bytes_; }
  int ranks_per_node() const { return ranks_per_node_; }
  int NodeOf(int world_rank) const { return world_rank / ranks_per_node_; }

  bool emulated() const { return emulation_.has_value(); }

  // Testing only: the matching thread pauses this long between publishing its own request's
  // state and its partner's, which widens the window a wrong publication order would race in.
  void set_match_pause_for_testing(std::chrono::microseconds pause) { match_pause_ = pause; }
  std::chrono::microseconds match_pause() const { return match_pause_; }
  // Emulation: the time at which a message of `bytes` from src to dst matched at `now` completes
  // (serialized on src's port of the link class).
  Clock::time_point Schedule(int src, int dst, size_t bytes, Clock::time_point now);

  // Records that world_rank failed in `context` (0 = in every group) and wakes every waiter.
  void MarkFailed(int world_rank, uint64_t context, const std::string& reason);
  // True (with the reason) if world_rank failed in `context` or everywhere.
  bool FailureOf(int world_rank, uint64_t context, std::string* reason);
  // Changes whenever a failure is recorded; 0 while none was.
  uint64_t failure_epoch() const { return failure_epoch_.load(std::memory_order_acquire); }

  void Register(const std::shared_ptr<Event>& event);

  // Timeout consensus (see InProcessTransport::Wait): world_rank timed out in `context` waiting
  // for waited_for_world (-1: not known); the records of a context, world rank -> waited for.
  void RecordTimeout(uint64_t context, int world_rank, int waited_for_world);
  std::map<int, int> TimeoutsOf(uint64_t context);

 private:
  std::chrono::microseconds match_pause_{0};
  int world_size_;
  int ranks_per_node_;
  size_t chunk_bytes_;
  std::vector<std::unique_ptr<Mailbox>> mailboxes_;

  std::optional<EmulationOptions> emulation_;
  std::mutex emulation_mu_;
  std::vector<Clock::time_point> port_free_;  // [world_rank * 2 + link class]

  std::mutex failure_mu_;
  std::map<std::pair<int, uint64_t>, std::string> failures_;
  std::atomic<uint64_t> failure_epoch_{0};
  std::map<uint64_t, std::map<int, int>> timeouts_;  // guarded by failure_mu_
  std::vector<std::weak_ptr<Event>> events_;
};

class InProcessTransport final : public Transport {
 public:
  // The endpoint of members[rank] in the group `members` (world ranks) with id `context`.
  InProcessTransport(std::shared_ptr<Fabric> fabric, uint64_t context, std::vector<int> members,
                     int rank);

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(members_.size()); }
  std::string_view kind() const override { return "inprocess"; }
  int WorldRank(int group_rank) const override { return members_[static_cast<size_t>(group_rank)]; }
  Topology topology() const override { return topology_; }

  RequestPtr Isend(int peer, uint64_t tag, const void* data, size_t bytes,
                   const MessageHeader& header) override;
  RequestPtr Irecv(int peer, uint64_t tag, void* data, size_t capacity,
                   const RecvReduction* reduction = nullptr) override;
  void Wait(std::span<Request* const> requests, Deadline deadline) override;
  bool Test(Request& request) override;
  std::unique_ptr<Transport> Split(int color, int key, uint64_t tag, Deadline deadline) override;
  void Abort(const std::string& reason) override;

  Fabric& fabric() { return *fabric_; }
  uint64_t context() const { return context_; }

 private:
  void CheckPeer(int peer) const;
  std::string TimeoutConsensus(int waited_for_world);

  std::shared_ptr<Fabric> fabric_;
  uint64_t context_;
  std::vector<int> members_;
  int rank_;
  int world_rank_;
  Topology topology_;
  std::shared_ptr<Event> event_;
  uint64_t splits_ = 0;
};

// The world of an in-process run: its fabric and one transport per rank.
struct InProcessWorld {
  std::shared_ptr<Fabric> fabric;
  std::vector<std::unique_ptr<InProcessTransport>> transports;
};
InProcessWorld CreateInProcessTransports(int world_size, const InProcessOptions& options);

}  // namespace switchyard::comm::inproc
