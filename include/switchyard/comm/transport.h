// Transports move bytes between the ranks of a group; they know nothing of collectives.
//
// A Transport is one rank's endpoint in a group: tagged asynchronous point-to-point send/receive,
// waits with a deadline, a barrier, and Split into subgroups. Two implementations come with
// switchyard:
//   in-process (inprocess.h)  ranks are threads of one process; a message is copied once, straight
//                             from the sender's buffer into the receiver's (no staging), by the
//                             threads of the two ranks together; optional emulated topology.
//   MPI (mpi.h)               ranks are processes under mpirun/srun (MPI_Isend/MPI_Irecv/MPI_Test).
// Collectives (communicator.h) are algorithms over this interface, so they run on either -- and
// on a user's own: implement Transport (and Request) and pass it to CreateCommunicator
// (communicator.h). tests/comm/custom_transport_test.cc is a complete, small example.
//
// What an implementation must provide (the collectives rely on each point):
//   - Matching: a receive matches the oldest unmatched send from `peer` with the same tag
//     (messages between two ranks with one tag never overtake each other); tags are 64-bit and
//     a collective uses many, so they may not be assumed small. Sends to rank() itself happen.
//   - Headers: every message carries a 32-byte MessageHeader that the transport delivers
//     untouched with the payload; a completed receive exposes it (Request::header()) and the
//     number of bytes that arrived (received_bytes()). Collectives compare it with their own
//     call, which is how a peer running another collective or other sizes is reported.
//   - Sizes: a message longer than the receive's capacity fails that receive (PeerError from
//     Wait/Test) without writing past the buffer.
//   - Reductions: a receive with a RecvReduction writes dst[i] = op(local[i], incoming[i])
//     (ReduceInto of reduce.h does the arithmetic) instead of copying.
//   - Deadlines: Wait never blocks past its deadline; it throws TimeoutError naming what it
//     still waits for. A failed peer becomes PeerError, never a hang.
//   - Cancellation: destroying an incomplete Request cancels it; afterwards the transport
//     no longer touches its buffer.
//   - Split: a collective over the group; ExchangeSplitKeys (below) does the exchange over
//     Isend/Irecv, so an implementation only builds the subgroup's endpoint from the keys.
//     Messages of a subgroup must never match those of its parent or siblings.
// Optional: Barrier (default: dissemination over Isend/Irecv), Abort (tell peers this rank
// failed, so they fail fast; default: nothing, they reach their deadline), native() (the
// transport's own collectives for Algorithm::kNative; default: none).
//
// Thread-safety: a Transport may be used from several threads at once (a communicator's progress
// thread and the threads that wait on its collectives); a Request belongs to the thread that
// waits on it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "switchyard/comm/types.h"
#include "switchyard/core/dtype.h"

namespace switchyard::comm {

// Opaque to transports; delivered with the payload.
using MessageHeader = std::array<uint64_t, 4>;

// A receive that reduces instead of copying: dst[i] = op(local[i], incoming[i]) for the
// elements of the message (local may equal dst). The in-process transport applies it directly
// on the sender's buffer, so a reduction step costs one pass over memory.
struct RecvReduction {
  const void* local = nullptr;
  DType dtype = DType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
};

// One posted send or receive. Destroying an incomplete request cancels it: once the destructor
// returns, the transport no longer touches the request's buffer. A transport subclasses it and
// sets header_ and received_bytes_ when a receive completes.
class Request {
 public:
  virtual ~Request() = default;
  Request(const Request&) = delete;
  Request& operator=(const Request&) = delete;

  bool is_send() const { return is_send_; }
  int peer() const { return peer_; }
  uint64_t tag() const { return tag_; }
  // Bytes to send, or the capacity of a receive.
  size_t size() const { return size_; }
  // After a receive completed: the sender's header and the number of bytes received.
  const MessageHeader& header() const { return header_; }
  size_t received_bytes() const { return received_bytes_; }
  // Whether header() may be read now: true once the sender's header has arrived (also for a
  // receive that failed on size). A transport whose peers write the header from another thread
  // says false until then, so that a caller looking at an unfinished receive after an error
  // reads nothing a peer may be writing.
  virtual bool HeaderArrived() const { return true; }

 protected:
  Request(bool is_send, int peer, uint64_t tag, size_t size)
      : is_send_(is_send), peer_(peer), tag_(tag), size_(size) {}

  bool is_send_;
  int peer_;
  uint64_t tag_;
  size_t size_;
  MessageHeader header_{};
  size_t received_bytes_ = 0;
};
using RequestPtr = std::unique_ptr<Request>;

// Collectives a transport implements natively (MPI's own). Blocking with a deadline: they poll
// the MPI non-blocking form. Arguments as in communicator.h; counts are elements.
class NativeCollectives {
 public:
  virtual ~NativeCollectives() = default;
  virtual void Barrier(Deadline deadline) = 0;
  virtual void Broadcast(void* buffer, size_t count, DType dtype, int root, Deadline deadline) = 0;
  virtual void Reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                      int root, Deadline deadline) = 0;
  virtual void AllReduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                         Deadline deadline) = 0;
  virtual void AllGather(const void* send, void* recv, size_t count, DType dtype,
                         Deadline deadline) = 0;
  virtual void ReduceScatter(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                             Deadline deadline) = 0;
  virtual void AllToAll(const void* send, void* recv, size_t count, DType dtype,
                        Deadline deadline) = 0;
  virtual void AllToAllV(const void* send, std::span<const int64_t> send_counts,
                         std::span<const int64_t> send_displs, void* recv,
                         std::span<const int64_t> recv_counts, std::span<const int64_t> recv_displs,
                         DType dtype, Deadline deadline) = 0;
  virtual void Scatter(const void* send, void* recv, size_t count, DType dtype, int root,
                       Deadline deadline) = 0;
  virtual void Gather(const void* send, void* recv, size_t count, DType dtype, int root,
                      Deadline deadline) = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;

  // This rank's index in the group, 0 <= rank() < size().
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "inprocess", "mpi", or a user transport's own name. Algorithm selection treats every kind
  // other than "mpi" like "inprocess" (docs/algorithms.md).
  virtual std::string_view kind() const = 0;
  // The rank of group member `group_rank` in the world (for error messages).
  virtual int WorldRank(int group_rank) const = 0;
  // Node layout of this group (see types.h); {1, size()} when the transport does not know one.
  virtual Topology topology() const = 0;

  // Starts sending [data, data + bytes) with `header` to `peer` (a rank of this group, may be
  // rank() itself). The buffer must stay valid and unchanged until the request completes.
  virtual RequestPtr Isend(int peer, uint64_t tag, const void* data, size_t bytes,
                           const MessageHeader& header) = 0;
  // Starts receiving from `peer` into [data, data + capacity), or reducing into it (reduction).
  // A message longer than `capacity` fails the request (PeerError) without writing past it.
  virtual RequestPtr Irecv(int peer, uint64_t tag, void* data, size_t capacity,
                           const RecvReduction* reduction = nullptr) = 0;
  // Blocks until every request completed. Throws TimeoutError at the deadline naming the peers
  // still outstanding, PeerError if a request failed or its peer failed or left. Null entries
  // are skipped. After an exception the requests stay valid (destroy them to cancel).
  virtual void Wait(std::span<Request* const> requests, Deadline deadline) = 0;
  // Non-blocking: true if the request completed (throws as Wait does if it failed).
  virtual bool Test(Request& request) = 0;

  // Returns once every member called Barrier with this tag; dissemination over Isend/Irecv.
  virtual void Barrier(uint64_t tag, Deadline deadline);
  // Collective over the group: members with the same color >= 0 form a new group, ordered by
  // (key, rank). Returns null for color < 0. Every member must call it with the same tag.
  virtual std::unique_ptr<Transport> Split(int color, int key, uint64_t tag, Deadline deadline) = 0;
  // Tells peers, where the transport can, that this rank failed in this group, so that their
  // waits on it fail at once instead of at their deadline.
  virtual void Abort(const std::string& reason) {}
  // MPI's own collectives over this group, or null.
  virtual NativeCollectives* native() { return nullptr; }

 protected:
  // For Split implementations: the (color, key) of every member, exchanged point-to-point.
  std::vector<std::array<int, 2>> ExchangeSplitKeys(int color, int key, uint64_t tag,
                                                    Deadline deadline);
};

}  // namespace switchyard::comm
