#include "comm/group_communicator.h"

#include <fmt/format.h>

#include <cstring>
#include <vector>

#include "comm/algorithms.h"
#include "switchyard/core/error.h"

namespace switchyard::comm {
namespace {

// Rethrows `e` with `message`, keeping its type (callers catch TimeoutError vs PeerError).
[[noreturn]] void RethrowAs(const Error& e, const std::string& message) {
  if (dynamic_cast<const TimeoutError*>(&e)) throw TimeoutError(message);
  if (dynamic_cast<const PeerError*>(&e)) throw PeerError(message);
  if (dynamic_cast<const InvalidArgument*>(&e)) throw InvalidArgument(message);
  if (dynamic_cast<const InternalError*>(&e)) throw InternalError(message);
  throw Error(message);
}

void CheckBuffer(CollectiveKind kind, const char* name, const void* p, size_t count) {
  SY_REQUIRE(count == 0 || p != nullptr, InvalidArgument, "{}: {} is null but holds {} elements",
             CollectiveName(kind), name, count);
}

// Per-peer counts and displacements (elements) of an all-to-all-v, checked and turned into bytes.
AllToAllLayout MakeLayout(CollectiveKind kind, int w, std::span<const int64_t> send_counts,
                          std::span<const int64_t> send_displs,
                          std::span<const int64_t> recv_counts,
                          std::span<const int64_t> recv_displs, size_t elem) {
  auto check = [&](const char* name, std::span<const int64_t> v, bool optional) {
    SY_REQUIRE((optional && v.empty()) || v.size() == static_cast<size_t>(w), InvalidArgument,
               "{}: {} has {} entries, expected {} (one per rank){}", CollectiveName(kind), name,
               v.size(), w, optional ? " or none" : "");
    for (size_t p = 0; p < v.size(); ++p) {
      SY_REQUIRE(v[p] >= 0, InvalidArgument, "{}: {}[{}] = {} is negative", CollectiveName(kind),
                 name, p, v[p]);
    }
  };
  check("send_counts", send_counts, false);
  check("recv_counts", recv_counts, false);
  check("send_displs", send_displs, true);
  check("recv_displs", recv_displs, true);
  AllToAllLayout layout;
  size_t send_packed = 0, recv_packed = 0;
  for (size_t p = 0; p < static_cast<size_t>(w); ++p) {
    layout.send_bytes.push_back(static_cast<size_t>(send_counts[p]) * elem);
    layout.recv_bytes.push_back(static_cast<size_t>(recv_counts[p]) * elem);
    layout.send_offsets.push_back(send_displs.empty() ? send_packed
                                                      : static_cast<size_t>(send_displs[p]) * elem);
    layout.recv_offsets.push_back(recv_displs.empty() ? recv_packed
                                                      : static_cast<size_t>(recv_displs[p]) * elem);
    send_packed += layout.send_bytes.back();
    recv_packed += layout.recv_bytes.back();
  }
  return layout;
}

// ---- bfloat16 reductions accumulate in float32 ----

void WidenBFloat16(const void* src, float* dst, size_t n) {
  const auto* s = static_cast<const BFloat16*>(src);
  for (size_t i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]);
}

void NarrowToBFloat16(const float* src, void* dst, size_t n) {
  auto* d = static_cast<BFloat16*>(dst);
  for (size_t i = 0; i < n; ++i) d[i] = BFloat16(src[i]);
}

// Runs the float32 form of a bfloat16 reduction: the input (count elements, W blocks of count for
// reduce_scatter) is widened into float32 scratch, `run` reduces it in float32 -- partial sums
// stay float32, on the wire too, which doubles the bytes -- in place (reduce_scatter: into a
// second scratch), and the result is rounded to bfloat16 into recv once (reduce: at the root
// only). A sum over W ranks is thus rounded once, not at every step of a ring.
void AccumulateInFloat32(OpContext& ctx, AlgorithmFn run, const CollectiveArgs& args) {
  const bool scatter = ctx.info().kind == CollectiveKind::kReduceScatter;
  const size_t send_count = scatter ? args.count * static_cast<size_t>(ctx.size()) : args.count;
  ctx.set_work_dtype(DType::kFloat32);
  auto* send32 = reinterpret_cast<float*>(Scratch(2, send_count * sizeof(float)));
  float* recv32 =
      scatter ? reinterpret_cast<float*>(Scratch(3, args.count * sizeof(float))) : send32;
  WidenBFloat16(args.send, send32, send_count);
  CollectiveArgs wide = args;
  wide.send = send32;
  wide.recv = recv32;
  run(ctx, wide);
  const bool writes = ctx.info().kind != CollectiveKind::kReduce || ctx.rank() == args.root;
  if (writes) NarrowToBFloat16(recv32, args.recv, args.count);
}

}  // namespace

GroupCommunicator::GroupCommunicator(std::unique_ptr<Transport> transport, std::string name,
                                     Milliseconds timeout)
    : transport_(std::move(transport)),
      name_(std::move(name)),
      timeout_(timeout),
      executor_(std::make_shared<Executor>(/*synchronous=*/transport_->size() == 1)) {
  SY_REQUIRE(timeout_.count() > 0, InvalidArgument, "communicator '{}': timeout must be > 0 ms",
             name_);
}

GroupCommunicator::~GroupCommunicator() { executor_->Shutdown(); }

Work GroupCommunicator::Submit(const OpInfo& info, Milliseconds timeout, Body body) {
  auto state = std::make_shared<detail::WorkState>();
  Milliseconds t = timeout.count() > 0 ? timeout : timeout_;
  state->body = [this, info, t, body = std::move(body)](uint64_t seq) {
    Execute(info, t, seq, body);
  };
  executor_->Submit(state, executor_);
  return Work(std::move(state));
}

void GroupCommunicator::Execute(const OpInfo& info, Milliseconds timeout, uint64_t seq,
                                const Body& body) {
  OpContext ctx(*transport_, info, seq, Clock::now() + timeout, timeout, name_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_.empty()) {
      throw PeerError(fmt::format("{}: the communicator is unusable after an earlier failure: {}",
                                  ctx.Describe(), broken_));
    }
  }
  try {
    body(ctx);
  } catch (const Error& e) {
    std::string message = fmt::format("{}: {}", ctx.Describe(), e.what());
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (broken_.empty()) broken_ = message;
    }
    transport_->Abort(message);
    RethrowAs(e, message);
  }
}

void GroupCommunicator::CheckRoot(CollectiveKind kind, int root) const {
  SY_REQUIRE(root >= 0 && root < size(), InvalidArgument,
             "{}: root {} is not a rank of group '{}' of {} ranks", CollectiveName(kind), root,
             name_, size());
}

Work GroupCommunicator::Launch(CollectiveKind kind, size_t bytes, CollectiveArgs args,
                               const LaunchOptions& options) {
  const Algorithm algorithm =
      SelectAlgorithm(kind, options.algorithm, bytes, size(), transport_->topology(),
                      transport_->native() != nullptr, transport_->kind());
  const AlgorithmEntry& entry = FindAlgorithm(kind, algorithm);
  if (entry.prepare != nullptr) entry.prepare(args, size(), transport_->topology());
  OpInfo info{kind, algorithm, args.dtype};
  info.count = args.count;
  info.user_tag = options.tag;
  if (HasRoot(kind)) {
    info.root = args.root;
    info.has_root = true;
  }
  if (IsReduction(kind)) {
    info.reduce_op = args.reduce_op;
    info.has_reduce_op = true;
  }
  AlgorithmFn run = entry.run;
  if (IsReduction(kind) && args.dtype == DType::kBFloat16) {
    return Submit(info, options.timeout, [run, args = std::move(args)](OpContext& ctx) {
      AccumulateInFloat32(ctx, run, args);
    });
  }
  return Submit(info, options.timeout,
                [run, args = std::move(args)](OpContext& ctx) { run(ctx, args); });
}

std::unique_ptr<Communicator> GroupCommunicator::Split(int color, int key, std::string name) {
  SY_REQUIRE(color >= 0 || color == kNoColor, InvalidArgument,
             "split: color must be >= 0 or kNoColor, got {}", color);
  OpInfo info{CollectiveKind::kSplit, Algorithm::kAuto};
  auto result = std::make_shared<std::unique_ptr<Transport>>();
  Work work = Submit(info, Milliseconds{0}, [this, color, key, result](OpContext& ctx) {
    *result = transport_->Split(color, key, ctx.TagFor(0xff), ctx.deadline());
  });
  work.Wait();
  if (!*result) return nullptr;
  if (name.empty()) name = fmt::format("{}.{}", name_, color);
  return std::make_unique<GroupCommunicator>(std::move(*result), std::move(name), timeout_);
}

// ---- Point-to-point ----

namespace {

// Point-to-point messages use tags with the top bit set; collectives' tags ((sequence << 8) |
// phase) never reach it.
constexpr uint64_t kPointToPointTag = uint64_t{1} << 63;
constexpr uint64_t kPointToPointMagic = 0x7032700000000000;  // "p2p" in the header

}  // namespace

Work GroupCommunicator::PointToPoint(bool send, void* data, size_t count, DType dtype, int peer,
                                     const PointToPointOptions& options) {
  const char* what = send ? "send" : "recv";
  SY_REQUIRE(peer >= 0 && peer < size(), InvalidArgument,
             "{} on group '{}': peer {} is not a rank of the group (0..{})", what, name_, peer,
             size() - 1);
  SY_REQUIRE(count == 0 || data != nullptr, InvalidArgument,
             "{} on group '{}': the buffer is null but holds {} elements", what, name_, count);
  {
    std::lock_guard<std::mutex> lock(mu_);
    SY_REQUIRE(broken_.empty(), PeerError, "{} on group '{}': the communicator is unusable: {}",
               what, name_, broken_);
  }
  const size_t bytes = count * DTypeSize(dtype);
  const uint64_t tag = kPointToPointTag | options.tag;
  const Milliseconds timeout = options.timeout.count() > 0 ? options.timeout : timeout_;
  const Deadline deadline = Clock::now() + timeout;
  MessageHeader header{kPointToPointMagic | options.tag, static_cast<uint64_t>(dtype), bytes, 0};
  std::shared_ptr<Request> request = send ? transport_->Isend(peer, tag, data, bytes, header)
                                          : transport_->Irecv(peer, tag, data, bytes);
  const std::string describe =
      fmt::format("{} of {} bytes (tag {}) with rank {} on group '{}' (rank {} of {})", what, bytes,
                  options.tag, peer, name_, rank(), size());
  auto state = std::make_shared<detail::WorkState>();
  state->run_on_wait = true;
  Transport* transport = transport_.get();
  state->body = [transport, request, deadline, describe, send, bytes](uint64_t) {
    Request* r = request.get();
    try {
      transport->Wait(std::span<Request* const>(&r, 1), deadline);
    } catch (const Error& e) {
      RethrowAs(e, describe + ": " + e.what());
    }
    if (send) return;
    const MessageHeader& h = r->header();
    SY_REQUIRE((h[0] & ~uint64_t{0xffffffff}) == kPointToPointMagic, PeerError,
               "{}: the peer sent a message of another operation", describe);
    SY_REQUIRE(r->received_bytes() == bytes, PeerError,
               "{}: the peer sent {} bytes, {} were expected", describe, r->received_bytes(),
               bytes);
  };
  return Work(std::move(state));
}

Work GroupCommunicator::Send(const void* data, size_t count, DType dtype, int peer,
                             const PointToPointOptions& options) {
  return PointToPoint(true, const_cast<void*>(data), count, dtype, peer, options);
}

Work GroupCommunicator::Recv(void* data, size_t count, DType dtype, int peer,
                             const PointToPointOptions& options) {
  return PointToPoint(false, data, count, dtype, peer, options);
}

Work GroupCommunicator::Barrier(const BarrierOptions& options) {
  return Launch(CollectiveKind::kBarrier, 0, {}, options);
}

Work GroupCommunicator::Broadcast(void* buffer, size_t count, DType dtype,
                                  const BroadcastOptions& options) {
  const auto kind = CollectiveKind::kBroadcast;
  CheckRoot(kind, options.root);
  CheckBuffer(kind, "buffer", buffer, count);
  return Launch(kind, count * DTypeSize(dtype),
                {.recv = buffer, .count = count, .dtype = dtype, .root = options.root}, options);
}

Work GroupCommunicator::Reduce(const void* send, void* recv, size_t count, DType dtype,
                               const ReduceOptions& options) {
  const auto kind = CollectiveKind::kReduce;
  CheckRoot(kind, options.root);
  CheckBuffer(kind, "send", send, count);
  if (rank() == options.root) CheckBuffer(kind, "recv (at root)", recv, count);
  return Launch(kind, count * DTypeSize(dtype),
                {.send = send,
                 .recv = recv,
                 .count = count,
                 .dtype = dtype,
                 .reduce_op = options.reduce_op,
                 .root = options.root},
                options);
}

Work GroupCommunicator::AllReduce(const void* send, void* recv, size_t count, DType dtype,
                                  const AllReduceOptions& options) {
  const auto kind = CollectiveKind::kAllReduce;
  CheckBuffer(kind, "send", send, count);
  CheckBuffer(kind, "recv", recv, count);
  return Launch(
      kind, count * DTypeSize(dtype),
      {.send = send, .recv = recv, .count = count, .dtype = dtype, .reduce_op = options.reduce_op},
      options);
}

Work GroupCommunicator::AllGather(const void* send, void* recv, size_t count, DType dtype,
                                  const AllGatherOptions& options) {
  const auto kind = CollectiveKind::kAllGather;
  CheckBuffer(kind, "send", send, count);
  CheckBuffer(kind, "recv", recv, count);
  return Launch(kind, count * DTypeSize(dtype) * size(),
                {.send = send, .recv = recv, .count = count, .dtype = dtype}, options);
}

Work GroupCommunicator::ReduceScatter(const void* send, void* recv, size_t count, DType dtype,
                                      const ReduceScatterOptions& options) {
  const auto kind = CollectiveKind::kReduceScatter;
  CheckBuffer(kind, "send", send, count);
  CheckBuffer(kind, "recv", recv, count);
  return Launch(
      kind, count * DTypeSize(dtype) * size(),
      {.send = send, .recv = recv, .count = count, .dtype = dtype, .reduce_op = options.reduce_op},
      options);
}

Work GroupCommunicator::AllToAll(const void* send, void* recv, size_t count, DType dtype,
                                 const AllToAllOptions& options) {
  const auto kind = CollectiveKind::kAllToAll;
  CheckBuffer(kind, "send", send, count);
  CheckBuffer(kind, "recv", recv, count);
  const int w = size();
  std::vector<int64_t> counts(static_cast<size_t>(w), static_cast<int64_t>(count));
  return Launch(kind, count * DTypeSize(dtype) * w,
                {.send = send,
                 .recv = recv,
                 .count = count,
                 .dtype = dtype,
                 .ranks_per_node = options.ranks_per_node,
                 .layout = MakeLayout(kind, w, counts, {}, counts, {}, DTypeSize(dtype))},
                options);
}

Work GroupCommunicator::AllToAllV(const void* send, std::span<const int64_t> send_counts,
                                  std::span<const int64_t> send_displs, void* recv,
                                  std::span<const int64_t> recv_counts,
                                  std::span<const int64_t> recv_displs, DType dtype,
                                  const AllToAllOptions& options) {
  const auto kind = CollectiveKind::kAllToAllV;
  const int w = size();
  AllToAllLayout layout =
      MakeLayout(kind, w, send_counts, send_displs, recv_counts, recv_displs, DTypeSize(dtype));
  // The block a rank sends itself is a local copy, so a disagreement there is this caller's.
  const auto me = static_cast<size_t>(rank());
  SY_REQUIRE(send_counts[me] == recv_counts[me], InvalidArgument,
             "{}: send_counts[{}] = {} but recv_counts[{}] = {}: what rank {} sends itself must "
             "equal what it receives from itself",
             CollectiveName(kind), me, send_counts[me], me, recv_counts[me], me);
  size_t send_total = 0, recv_total = 0;
  for (size_t p = 0; p < static_cast<size_t>(w); ++p) {
    send_total += layout.send_bytes[p];
    recv_total += layout.recv_bytes[p];
  }
  CheckBuffer(kind, "send", send, send_total);
  CheckBuffer(kind, "recv", recv, recv_total);
  return Launch(kind, 0, {.send = send, .recv = recv, .dtype = dtype, .layout = std::move(layout)},
                options);
}

Work GroupCommunicator::AllToAllVDynamicRows(const void* send, std::span<const int64_t> send_rows,
                                             int64_t row_elems, const Shape& row_shape, DType dtype,
                                             AllToAllVResult* result,
                                             const AllToAllOptions& options) {
  const auto kind = CollectiveKind::kAllToAllVDynamic;
  const int w = size();
  SY_REQUIRE(result != nullptr, InvalidArgument, "{}: result is null", CollectiveName(kind));
  SY_REQUIRE(send_rows.size() == static_cast<size_t>(w), InvalidArgument,
             "{}: send_counts has {} entries, expected {} (one per rank)", CollectiveName(kind),
             send_rows.size(), w);
  int64_t total = 0;
  for (size_t p = 0; p < send_rows.size(); ++p) {
    SY_REQUIRE(send_rows[p] >= 0, InvalidArgument, "{}: send_counts[{}] = {} is negative",
               CollectiveName(kind), p, send_rows[p]);
    total += send_rows[p];
  }
  CheckBuffer(kind, "send", send, static_cast<size_t>(total * row_elems));
  return Launch(kind, 0,
                {.send = send,
                 .dtype = dtype,
                 .send_rows = std::vector<int64_t>(send_rows.begin(), send_rows.end()),
                 .row_elems = row_elems,
                 .row_shape = row_shape,
                 .result = result},
                options);
}

Work GroupCommunicator::Scatter(const void* send, void* recv, size_t count, DType dtype,
                                const RootedOptions& options) {
  const auto kind = CollectiveKind::kScatter;
  CheckRoot(kind, options.root);
  if (rank() == options.root) CheckBuffer(kind, "send (at root)", send, count);
  CheckBuffer(kind, "recv", recv, count);
  return Launch(kind, count * DTypeSize(dtype),
                {.send = send, .recv = recv, .count = count, .dtype = dtype, .root = options.root},
                options);
}

Work GroupCommunicator::Gather(const void* send, void* recv, size_t count, DType dtype,
                               const RootedOptions& options) {
  const auto kind = CollectiveKind::kGather;
  CheckRoot(kind, options.root);
  CheckBuffer(kind, "send", send, count);
  if (rank() == options.root) CheckBuffer(kind, "recv (at root)", recv, count);
  return Launch(kind, count * DTypeSize(dtype),
                {.send = send, .recv = recv, .count = count, .dtype = dtype, .root = options.root},
                options);
}

std::unique_ptr<Communicator> CreateCommunicator(std::unique_ptr<Transport> transport,
                                                 const CommunicatorOptions& options) {
  SY_REQUIRE(transport != nullptr, InvalidArgument, "CreateCommunicator: transport is null");
  return std::make_unique<GroupCommunicator>(std::move(transport), options.name, options.timeout);
}

}  // namespace switchyard::comm
