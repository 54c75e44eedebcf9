// Communicator: a group of ranks running collectives, in the shape of PyTorch c10d's ProcessGroup.
//
// Every collective is asynchronous: it returns a Work at once and runs on the communicator's
// progress thread, in the order the calls were made, while the caller computes. Work::Wait()
// blocks until it finished (if the collective has not started yet when Wait() is called, the
// waiting thread runs it itself, which saves a thread hand-off on the synchronous path).
//
// Contract (as NCCL/c10d):
//   - every member calls the same collectives in the same order, with matching counts, dtype,
//     root, reduce_op and tag. A mismatch is detected (message headers carry them) and reported
//     as PeerError on the ranks that see it, naming both calls; it never corrupts memory.
//   - buffers must stay valid, and inputs unchanged, until the Work completed. Count and
//     displacement arrays are copied at the call.
//   - every collective has a deadline (options.timeout, else the communicator's default). A peer
//     that never arrives, left, or failed makes the collective fail with TimeoutError/PeerError
//     naming the collective, the group and the missing peer. After a failure the communicator is
//     unusable (later collectives fail at once, as after ncclCommAbort); peers in the same
//     process are told at once, so they fail fast too.
//   - counts are elements of `dtype`; a send buffer may equal the receive buffer (in place) for
//     allreduce only.
//   - reductions: float32, int32, int64 in their own type. bfloat16 accumulates in float32: the
//     input is widened to float32, every algorithm (native included) reduces and sends float32
//     partial results (twice bfloat16's bytes on the wire), and the result is rounded to
//     bfloat16 once -- not at every step as NCCL's bfloat16 ring does. Integer sums wrap around.
// Thread-safety: calls on one Communicator may come from several threads, but their order must
// be the same on every rank. Distinct communicators are independent and may run concurrently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "switchyard/comm/types.h"
#include "switchyard/core/dtype.h"
#include "switchyard/core/tensor.h"

namespace switchyard::comm {

namespace detail {
struct WorkState;
}  // namespace detail

class Transport;

// Handle to one asynchronous collective; copies share it. A default-constructed Work is a
// completed no-op.
class Work {
 public:
  Work() = default;
  explicit Work(std::shared_ptr<detail::WorkState> state) : state_(std::move(state)) {}

  // True once the collective finished (successfully or not); never blocks.
  bool IsCompleted() const;
  // Blocks until the collective finished and rethrows its error, if any (TimeoutError,
  // PeerError, InvalidArgument). The collective's own deadline bounds the wait.
  void Wait() const;
  // As Wait(), but throws TimeoutError if the collective is still running after `timeout` (it
  // then goes on until it finishes or reaches its own deadline). Never runs it inline.
  void Wait(Milliseconds timeout) const;
  // Once completed: when the collective started and finished running (on the progress thread or
  // inline in Wait), for timelines. False while it runs, for a default Work, and for a
  // collective that failed before it started.
  bool Times(Clock::time_point* started, Clock::time_point* finished) const;

 private:
  std::shared_ptr<detail::WorkState> state_;
};

// Options common to every collective. timeout 0 = the communicator's default. tag is checked to
// be equal on every rank (a cheap guard against mismatched call sites).
struct BarrierOptions {
  Algorithm algorithm = Algorithm::kAuto;
  Milliseconds timeout{0};
  uint32_t tag = 0;
};
struct BroadcastOptions {
  int root = 0;
  Algorithm algorithm = Algorithm::kAuto;
  Milliseconds timeout{0};
  uint32_t tag = 0;
};
struct ReduceOptions {
  int root = 0;
  ReduceOp reduce_op = ReduceOp::kSum;
  Algorithm algorithm = Algorithm::kAuto;
  Milliseconds timeout{0};
  uint32_t tag = 0;
};
struct AllReduceOptions {
  ReduceOp reduce_op = ReduceOp::kSum;
  Algorithm algorithm = Algorithm::kAuto;
  Milliseconds timeout{0};
  uint32_t tag = 0;
};
struct AllGatherOptions {
  Algorithm algorithm = Algorithm::kAuto;
  Milliseconds timeout{0};
  uint32_t tag = 0;
};
struct ReduceScatterOptions {
  ReduceOp reduce_op = ReduceOp::kSum;
  Algorithm algorithm = Algorithm::kAuto;
  Milliseconds timeout{0};
  uint32_t tag = 0;
};
// For alltoall, alltoallv and alltoallv_dynamic. ranks_per_node (hierarchical only): 0 = the
// communicator's topology().
struct AllToAllOptions {
  Algorithm algorithm = Algorithm::kAuto;
  int ranks_per_node = 0;
  Milliseconds timeout{0};
  uint32_t tag = 0;
};
// For scatter and gather.
struct RootedOptions {
  int root = 0;
  Algorithm algorithm = Algorithm::kAuto;
  Milliseconds timeout{0};
  uint32_t tag = 0;
};

// For Send and Recv. The tag tells messages between the same two ranks apart (a receive matches
// the oldest unmatched send from its peer with the same tag); it is not checked like a
// collective's.
struct PointToPointOptions {
  Milliseconds timeout{0};
  uint32_t tag = 0;
};

// Result of AllToAllVDynamic, filled when its Work completes.
struct AllToAllVResult {
  std::vector<int64_t> recv_counts;  // [size()]: elements (rows) received from each peer
  std::vector<int64_t> recv_displs;  // [size()]: where each peer's part starts in output
  Tensor output;                     // peer 0's part, then peer 1's, ...
};

class Communicator {
 public:
  static constexpr int kNoColor = -1;

  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "world" or the name given to Split; appears in every error message.
  virtual const std::string& name() const = 0;
  // Node layout of the group (used by the hierarchical all-to-all).
  virtual Topology topology() const = 0;
  // The transport's kind(): "inprocess", "mpi", or a user transport's name.
  virtual std::string_view transport_kind() const = 0;
  virtual Milliseconds default_timeout() const = 0;

  // Collective over the group (blocking, ordered with the queued collectives): members with the
  // same color >= 0 form a new communicator, ranked by (key, rank). Returns null for kNoColor.
  // name "" = "<this name>.<color>".
  virtual std::unique_ptr<Communicator> Split(int color, int key, std::string name = "") = 0;

  virtual Work Barrier(const BarrierOptions& options = {}) = 0;
  // buffer [count] at every rank; root's values are copied to every rank.
  virtual Work Broadcast(void* buffer, size_t count, DType dtype,
                         const BroadcastOptions& options = {}) = 0;
  // send [count] at every rank; recv [count] at root = reduction over ranks (ignored elsewhere,
  // may be null there).
  virtual Work Reduce(const void* send, void* recv, size_t count, DType dtype,
                      const ReduceOptions& options = {}) = 0;
  // send, recv [count]; recv = reduction over ranks, equal on every rank. send may equal recv.
  virtual Work AllReduce(const void* send, void* recv, size_t count, DType dtype,
                         const AllReduceOptions& options = {}) = 0;
  // send [count]; recv [size() * count], block r = rank r's send.
  virtual Work AllGather(const void* send, void* recv, size_t count, DType dtype,
                         const AllGatherOptions& options = {}) = 0;
  // send [size() * count]; recv [count] = reduction over ranks of their block rank().
  virtual Work ReduceScatter(const void* send, void* recv, size_t count, DType dtype,
                             const ReduceScatterOptions& options = {}) = 0;
  // send, recv [size() * count]; recv block p = block rank() of rank p's send.
  virtual Work AllToAll(const void* send, void* recv, size_t count, DType dtype,
                        const AllToAllOptions& options = {}) = 0;
  // Per-peer sizes (zeros allowed): send_counts[p] elements at send + send_displs[p] go to rank
  // p, which receives them at recv + recv_displs[rank()]; recv_counts[p] must equal rank p's
  // send_counts[rank()] (checked). Empty displs = packed in peer order.
  virtual Work AllToAllV(const void* send, std::span<const int64_t> send_counts,
                         std::span<const int64_t> send_displs, void* recv,
                         std::span<const int64_t> recv_counts, std::span<const int64_t> recv_displs,
                         DType dtype, const AllToAllOptions& options = {}) = 0;
  // FastMoE's two-phase form, for when receivers do not know their counts: exchange counts
  // (an all-to-all of int64), then the data. send packed in peer order, send_counts[p] elements
  // for rank p. result->output is allocated as [sum of recv_counts] of dtype.
  Work AllToAllVDynamic(const void* send, std::span<const int64_t> send_counts, DType dtype,
                        AllToAllVResult* result, const AllToAllOptions& options = {});
  // send [size() * count] at root (ignored elsewhere); recv [count] = block rank().
  virtual Work Scatter(const void* send, void* recv, size_t count, DType dtype,
                       const RootedOptions& options = {}) = 0;
  // send [count]; recv [size() * count] at root (ignored elsewhere), block r = rank r's send.
  virtual Work Gather(const void* send, void* recv, size_t count, DType dtype,
                      const RootedOptions& options = {}) = 0;

  // ---- Point-to-point (pipeline stages) ----
  // Not ordered with the collectives (they never wait for each other in the queue); messages
  // between two ranks with one tag arrive in order. Send's buffer must stay valid until its Work
  // completes; Recv's count must equal the message's (another size is PeerError). A
  // point-to-point Work runs in no queue: it completes when waited on (IsCompleted stays false
  // until then), and dropping it unwaited cancels the transfer.
  // A peer that never sends or receives becomes TimeoutError at the deadline, a failed peer
  // PeerError. The base class has none: InvalidArgument naming the communicator.
  virtual Work Send(const void* data, size_t count, DType dtype, int peer,
                    const PointToPointOptions& options = {});
  virtual Work Recv(void* data, size_t count, DType dtype, int peer,
                    const PointToPointOptions& options = {});

  // ---- Tensor forms: dtype from the tensor, shapes checked (InvalidArgument). ----
  // tensor: any shape, reduced in place.
  Work AllReduce(const Tensor& tensor, const AllReduceOptions& options = {});
  Work Broadcast(const Tensor& tensor, const BroadcastOptions& options = {});
  // input [n, ...]; output [size() * n, ...].
  Work AllGather(const Tensor& input, const Tensor& output, const AllGatherOptions& options = {});
  // input [size() * n, ...]; output [n, ...].
  Work ReduceScatter(const Tensor& input, const Tensor& output,
                     const ReduceScatterOptions& options = {});
  // input, output [size() * n, ...]: rows [p * n, (p + 1) * n) go to / come from rank p.
  Work AllToAll(const Tensor& input, const Tensor& output, const AllToAllOptions& options = {});
  // input [sum(send_rows), ...] packed by peer; output [sum(recv_rows), ...] packed by peer.
  Work AllToAllV(const Tensor& input, std::span<const int64_t> send_rows, const Tensor& output,
                 std::span<const int64_t> recv_rows, const AllToAllOptions& options = {});
  // input [sum(send_rows), ...] packed by peer; result->output [sum(recv_rows), ...] with
  // recv_counts/recv_displs in rows.
  Work AllToAllVDynamic(const Tensor& input, std::span<const int64_t> send_rows,
                        AllToAllVResult* result, const AllToAllOptions& options = {});

 protected:
  // Row form of AllToAllVDynamic: counts in rows of row_elems elements; result->output gets
  // shape [rows, row_shape...].
  virtual Work AllToAllVDynamicRows(const void* send, std::span<const int64_t> send_rows,
                                    int64_t row_elems, const Shape& row_shape, DType dtype,
                                    AllToAllVResult* result, const AllToAllOptions& options) = 0;
};

// ---- A communicator over any transport ----

struct CommunicatorOptions {
  // Default deadline of every collective (> 0).
  Milliseconds timeout{60000};
  // The group's name in error messages; splits are named "<name>.<color>" unless given one.
  std::string name = "world";
};

// The communicator of the calling rank over `transport` (this rank's endpoint in its group; see
// switchyard/comm/transport.h for what a transport must provide). Every collective algorithm
// runs over the transport's point-to-point interface; Algorithm::kNative needs
// Transport::native(). The communicator owns the transport and starts one progress thread.
// Throws InvalidArgument for a null transport or a timeout <= 0.
std::unique_ptr<Communicator> CreateCommunicator(std::unique_ptr<Transport> transport,
                                                 const CommunicatorOptions& options = {});

}  // namespace switchyard::comm
