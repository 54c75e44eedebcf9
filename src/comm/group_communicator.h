// The Communicator of switchyard: collectives as algorithms over any Transport, run in order on
// a progress thread (Executor). Every collective takes one path: its method checks the
// arguments and packs them into CollectiveArgs, Launch selects the algorithm, looks up its row
// of the launch table (algorithm_select.cc) and submits it.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "comm/algorithms.h"
#include "comm/executor.h"
#include "comm/op_context.h"
#include "switchyard/comm/communicator.h"
#include "switchyard/comm/transport.h"

namespace switchyard::comm {

class GroupCommunicator final : public Communicator {
 public:
  GroupCommunicator(std::unique_ptr<Transport> transport, std::string name, Milliseconds timeout);
  ~GroupCommunicator() override;

  int rank() const override { return transport_->rank(); }
  int size() const override { return transport_->size(); }
  const std::string& name() const override { return name_; }
  Topology topology() const override { return transport_->topology(); }
  std::string_view transport_kind() const override { return transport_->kind(); }
  Milliseconds default_timeout() const override { return timeout_; }

  std::unique_ptr<Communicator> Split(int color, int key, std::string name) override;

  using Communicator::AllGather;
  using Communicator::AllReduce;
  using Communicator::AllToAll;
  using Communicator::AllToAllV;
  using Communicator::Broadcast;
  using Communicator::ReduceScatter;

  Work Barrier(const BarrierOptions& options) override;
  Work Broadcast(void* buffer, size_t count, DType dtype, const BroadcastOptions& options) override;
  Work Reduce(const void* send, void* recv, size_t count, DType dtype,
              const ReduceOptions& options) override;
  Work AllReduce(const void* send, void* recv, size_t count, DType dtype,
                 const AllReduceOptions& options) override;
  Work AllGather(const void* send, void* recv, size_t count, DType dtype,
                 const AllGatherOptions& options) override;
  Work ReduceScatter(const void* send, void* recv, size_t count, DType dtype,
                     const ReduceScatterOptions& options) override;
  Work AllToAll(const void* send, void* recv, size_t count, DType dtype,
                const AllToAllOptions& options) override;
  Work AllToAllV(const void* send, std::span<const int64_t> send_counts,
                 std::span<const int64_t> send_displs, void* recv,
                 std::span<const int64_t> recv_counts, std::span<const int64_t> recv_displs,
                 DType dtype, const AllToAllOptions& options) override;
  Work Scatter(const void* send, void* recv, size_t count, DType dtype,
               const RootedOptions& options) override;
  Work Gather(const void* send, void* recv, size_t count, DType dtype,
              const RootedOptions& options) override;
  Work Send(const void* data, size_t count, DType dtype, int peer,
            const PointToPointOptions& options) override;
  Work Recv(void* data, size_t count, DType dtype, int peer,
            const PointToPointOptions& options) override;

 protected:
  Work AllToAllVDynamicRows(const void* send, std::span<const int64_t> send_rows, int64_t row_elems,
                            const Shape& row_shape, DType dtype, AllToAllVResult* result,
                            const AllToAllOptions& options) override;

 private:
  // The fields every options struct of communicator.h has.
  struct LaunchOptions {
    template <typename Options>
    LaunchOptions(const Options& options)  // NOLINT(google-explicit-constructor)
        : algorithm(options.algorithm), timeout(options.timeout), tag(options.tag) {}
    Algorithm algorithm;
    Milliseconds timeout;
    uint32_t tag;
  };
  // The one launch path: selects the algorithm of `kind` for a message of `bytes` (equal on every
  // rank), runs its prepare step and queues its run on `args`.
  Work Launch(CollectiveKind kind, size_t bytes, CollectiveArgs args, const LaunchOptions& options);

  using Body = std::function<void(OpContext&)>;
  // Queues `body` as collective `info`; timeout 0 = the default.
  Work Submit(const OpInfo& info, Milliseconds timeout, Body body);
  // Runs on the progress thread (or inline in Work::Wait).
  void Execute(const OpInfo& info, Milliseconds timeout, uint64_t seq, const Body& body);
  void CheckRoot(CollectiveKind kind, int root) const;
  // Send or Recv: posts the transport request now; the Work's first Wait waits for it.
  Work PointToPoint(bool send, void* data, size_t count, DType dtype, int peer,
                    const PointToPointOptions& options);

  std::unique_ptr<Transport> transport_;
  std::string name_;
  Milliseconds timeout_;
  std::shared_ptr<Executor> executor_;
  std::mutex mu_;
  std::string broken_;  // guarded by mu_: why the communicator is unusable, "" if it is not
};

}  // namespace switchyard::comm
