#include "comm/op_context.h"

#include <algorithm>

#include "comm/algorithms.h"
#include "switchyard/comm/reduce.h"
#include "switchyard/core/error.h"

namespace switchyard::comm {
namespace {

// Header words: 0 = kind | algorithm << 8 | dtype << 16 | reduce_op << 24 | user_tag << 32,
// 1 = sequence number, 2 = count, 3 = message bytes | (root + 1) << 48 (0 = no root) | 1 << 63
// (marks a header sent by a collective; an all-zero header means none arrived).
constexpr uint64_t kBytesMask = (uint64_t{1} << 48) - 1;
constexpr uint64_t kValidBit = uint64_t{1} << 63;

OpInfo DecodeInfo(const MessageHeader& h) {
  OpInfo info;
  info.kind = static_cast<CollectiveKind>(h[0] & 0xff);
  info.algorithm = static_cast<Algorithm>((h[0] >> 8) & 0xff);
  info.dtype = static_cast<DType>((h[0] >> 16) & 0xff);
  info.reduce_op = static_cast<ReduceOp>((h[0] >> 24) & 0xff);
  info.user_tag = static_cast<uint32_t>(h[0] >> 32);
  info.count = h[2];
  uint64_t root = (h[3] >> 48) & 0x7fff;
  info.has_root = root != 0;
  info.root = static_cast<int>(root) - 1;
  info.has_reduce_op = IsReduction(info.kind);
  return info;
}

}  // namespace

std::string DescribeOp(const OpInfo& info) {
  std::string s = fmt::format("{} ({}", CollectiveName(info.kind), AlgorithmName(info.algorithm));
  if (info.kind != CollectiveKind::kBarrier && info.kind != CollectiveKind::kSplit) {
    s += fmt::format(", {} x {}", info.count, DTypeName(info.dtype));
  }
  if (info.has_reduce_op) s += fmt::format(", {}", ReduceOpName(info.reduce_op));
  if (info.has_root) s += fmt::format(", root {}", info.root);
  if (info.user_tag != 0) s += fmt::format(", tag {}", info.user_tag);
  return s + ")";
}

OpContext::OpContext(Transport& transport, const OpInfo& info, uint64_t seq, Deadline deadline,
                     Milliseconds timeout, const std::string& group)
    : transport_(transport),
      info_(info),
      seq_(seq),
      deadline_(deadline),
      timeout_(timeout),
      group_(group),
      rank_(transport.rank()),
      size_(transport.size()),
      work_dtype_(info.dtype),
      elem_size_(DTypeSize(info.dtype)) {}

void OpContext::set_work_dtype(DType dtype) {
  work_dtype_ = dtype;
  elem_size_ = DTypeSize(dtype);
}

std::string OpContext::Describe() const {
  return fmt::format("{} #{} on group '{}' (rank {} of {})", DescribeOp(info_), seq_, group_, rank_,
                     size_);
}

MessageHeader OpContext::HeaderFor(size_t bytes) const {
  MessageHeader h{};
  h[0] = static_cast<uint64_t>(info_.kind) | static_cast<uint64_t>(info_.algorithm) << 8 |
         static_cast<uint64_t>(info_.dtype) << 16 | static_cast<uint64_t>(info_.reduce_op) << 24 |
         static_cast<uint64_t>(info_.user_tag) << 32;
  h[1] = seq_;
  h[2] = info_.count;
  h[3] = (static_cast<uint64_t>(bytes) & kBytesMask) |
         (info_.has_root ? static_cast<uint64_t>(info_.root + 1) << 48 : 0) | kValidBit;
  return h;
}

RequestPtr OpContext::Send(int peer, const void* data, size_t bytes, uint32_t phase) {
  return transport_.Isend(peer, TagFor(phase), data, bytes, HeaderFor(bytes));
}

RequestPtr OpContext::Recv(int peer, void* data, size_t bytes, uint32_t phase) {
  RequestPtr r = transport_.Irecv(peer, TagFor(phase), data, bytes);
  expected_.emplace_back(r.get(), bytes);
  return r;
}

RequestPtr OpContext::RecvReduce(int peer, void* dst, const void* local, size_t bytes,
                                 uint32_t phase) {
  RecvReduction reduction{local, work_dtype_, info_.reduce_op};
  RequestPtr r = transport_.Irecv(peer, TagFor(phase), dst, bytes, &reduction);
  expected_.emplace_back(r.get(), bytes);
  return r;
}

void OpContext::CheckHeader(const Request& request) const {
  const MessageHeader& h = request.header();
  if (!(h[3] & kValidBit)) return;  // no header arrived (request failed before matching)
  int peer = request.peer();
  std::string who = fmt::format("rank {} (world rank {})", peer, transport_.WorldRank(peer));
  OpInfo theirs = DecodeInfo(h);
  if (h[1] != seq_ || theirs.kind != info_.kind || theirs.user_tag != info_.user_tag) {
    throw PeerError(fmt::format("{} called {} #{} while this rank called {} #{}", who,
                                DescribeOp(theirs), h[1], DescribeOp(info_), seq_));
  }
  if (theirs.count != info_.count || theirs.dtype != info_.dtype) {
    throw PeerError(
        fmt::format("mismatched sizes: {} called {} with {} x {}, this rank with {} x {}", who,
                    CollectiveName(info_.kind), theirs.count, DTypeName(theirs.dtype), info_.count,
                    DTypeName(info_.dtype)));
  }
  if (info_.has_root && theirs.root != info_.root) {
    throw PeerError(fmt::format("{} called {} with root {}, this rank with root {}", who,
                                CollectiveName(info_.kind), theirs.root, info_.root));
  }
  if (info_.has_reduce_op && theirs.reduce_op != info_.reduce_op) {
    throw PeerError(fmt::format("{} called {} with reduce op {}, this rank with {}", who,
                                CollectiveName(info_.kind), ReduceOpName(theirs.reduce_op),
                                ReduceOpName(info_.reduce_op)));
  }
  if (theirs.algorithm != info_.algorithm) {
    throw PeerError(fmt::format("{} runs {} with algorithm {}, this rank with {}", who,
                                CollectiveName(info_.kind), AlgorithmName(theirs.algorithm),
                                AlgorithmName(info_.algorithm)));
  }
  size_t their_bytes = static_cast<size_t>(h[3] & kBytesMask);
  for (const auto& [r, expected] : expected_) {
    if (r == &request && their_bytes != expected) {
      throw PeerError(fmt::format(
          "mismatched sizes: {} sent {} bytes ({} x {}) in {}, this rank expected {} bytes", who,
          their_bytes, their_bytes / elem_size_, DTypeName(work_dtype_), CollectiveName(info_.kind),
          expected));
    }
  }
}

void OpContext::Wait(std::span<Request* const> requests) {
  try {
    transport_.Wait(requests, deadline_);
  } catch (const PeerError&) {
    // A receive that failed on size may carry the header of another collective: say so. Only
    // receives whose header arrived: a peer may still be matching the others.
    for (Request* r : requests) {
      if (r && !r->is_send() && r->HeaderArrived()) CheckHeader(*r);
    }
    throw;
  } catch (const TimeoutError& e) {
    throw TimeoutError(fmt::format("{} (deadline {} ms)", e.what(), timeout_.count()));
  }
  for (Request* r : requests) {
    if (r && !r->is_send()) CheckHeader(*r);
  }
  // Forget the expectations of the requests just completed.
  std::erase_if(expected_, [&](const auto& e) {
    return std::find(requests.begin(), requests.end(), e.first) != requests.end();
  });
}

void OpContext::Wait(std::initializer_list<Request*> requests) {
  Wait(std::span<Request* const>(requests.begin(), requests.size()));
}

void OpContext::WaitAll(std::vector<RequestPtr>& requests) {
  std::vector<Request*> raw;
  raw.reserve(requests.size());
  for (auto& r : requests) raw.push_back(r.get());
  Wait(raw);
}

void OpContext::SendRecv(int to, const void* send, size_t send_bytes, int from, void* recv,
                         size_t recv_bytes, uint32_t phase) {
  RequestPtr r = Recv(from, recv, recv_bytes, phase);
  RequestPtr s = Send(to, send, send_bytes, phase);
  Wait({r.get(), s.get()});
}

void OpContext::Reduce(void* dst, const void* a, const void* b, size_t count) const {
  ReduceInto(dst, a, b, count, work_dtype_, info_.reduce_op);
}

}  // namespace switchyard::comm
