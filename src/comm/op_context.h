// What an algorithm sees of the collective it runs: the group, sends and receives tagged and
// headed for this collective, waits against its deadline, and the local reduction.
//
// Every message carries a header naming the collective (kind, algorithm, dtype, reduce op, root,
// user tag, count, sequence number) and its own size; receivers check it, so a peer that runs a
// different collective or passes different sizes is reported by name instead of corrupting
// memory or hanging.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <vector>

#include "switchyard/comm/transport.h"
#include "switchyard/comm/types.h"
#include "switchyard/core/dtype.h"

namespace switchyard::comm {

// The identity of one collective call; equal on every rank of a correct program.
struct OpInfo {
  CollectiveKind kind = CollectiveKind::kBarrier;
  Algorithm algorithm = Algorithm::kAuto;
  DType dtype = DType::kFloat32;
  ReduceOp reduce_op = ReduceOp::kSum;
  uint32_t user_tag = 0;
  uint64_t count = 0;  // elements (per rank or per block, as the collective defines); 0 if varying
  int root = 0;
  bool has_reduce_op = false;
  bool has_root = false;
};

// "allreduce (ring, 1024 x float32, sum)".
std::string DescribeOp(const OpInfo& info);

class OpContext {
 public:
  OpContext(Transport& transport, const OpInfo& info, uint64_t seq, Deadline deadline,
            Milliseconds timeout, const std::string& group);

  Transport& transport() { return transport_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  const OpInfo& info() const { return info_; }
  // The dtype the algorithm computes and sends in: info().dtype, except for bfloat16 reductions,
  // which run on float32 copies (AccumulateInFloat32 in group_communicator.cc). Message headers
  // always carry info().dtype, so mismatch detection compares what the callers passed.
  DType work_dtype() const { return work_dtype_; }
  void set_work_dtype(DType dtype);
  // Bytes per element of work_dtype().
  size_t elem_size() const { return elem_size_; }
  Deadline deadline() const { return deadline_; }
  // The wire tag of `phase` of this collective: sequence number << 8 | phase.
  uint64_t TagFor(uint32_t phase) const { return (seq_ << 8) | (phase & 0xffu); }

  // Messages of phase p of this collective are matched only with phase p (phases < 256).
  RequestPtr Send(int peer, const void* data, size_t bytes, uint32_t phase = 0);
  // Expects exactly `bytes` bytes.
  RequestPtr Recv(int peer, void* data, size_t bytes, uint32_t phase = 0);
  // dst = op(local, incoming) over bytes / elem_size() elements of work_dtype().
  RequestPtr RecvReduce(int peer, void* dst, const void* local, size_t bytes, uint32_t phase = 0);
  // Waits for every request (nulls skipped) and checks the headers of the receives.
  void Wait(std::span<Request* const> requests);
  void Wait(std::initializer_list<Request*> requests);
  void WaitAll(std::vector<RequestPtr>& requests);
  // Send to `to` and receive from `from` concurrently, then wait for both.
  void SendRecv(int to, const void* send, size_t send_bytes, int from, void* recv,
                size_t recv_bytes, uint32_t phase = 0);

  // dst = op(a, b) over `count` elements of work_dtype(), on this rank.
  void Reduce(void* dst, const void* a, const void* b, size_t count) const;

  // "allreduce (ring, 1024 x float32, sum) #5 on group 'world' (rank 2 of 4)".
  std::string Describe() const;

 private:
  MessageHeader HeaderFor(size_t bytes) const;
  // Throws PeerError if a completed (or failed) receive's header shows another collective or
  // other sizes; returns normally otherwise.
  void CheckHeader(const Request& request) const;

  Transport& transport_;
  OpInfo info_;
  uint64_t seq_;
  Deadline deadline_;
  Milliseconds timeout_;
  const std::string& group_;
  int rank_;
  int size_;
  DType work_dtype_;
  size_t elem_size_;
  // Expected byte size of each posted receive, by request.
  std::vector<std::pair<const Request*, size_t>> expected_;
};

}  // namespace switchyard::comm
