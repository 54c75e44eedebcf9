#include "comm/group_communicator.h"

#include <cstring>
#include <functional>
#include <numeric>
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

// A reduction algorithm on (send, recv) in `dtype` (float32 when called by AccumulateInFloat32).
using ReductionRun = std::function<void(OpContext& ctx, const void* send, void* recv, DType dtype)>;

// Runs the float32 form of a bfloat16 reduction: send (send_count elements) is widened into
// float32 scratch, `run` reduces it in float32 -- partial sums stay float32, on the wire too,
// which doubles the bytes -- into recv32 (the same scratch if in_place, else its own), and
// recv32 is rounded to bfloat16 into recv (recv_count elements; null = nothing to write) once.
// A sum over W ranks is thus rounded once, not at every step of a ring.
void AccumulateInFloat32(OpContext& ctx, const ReductionRun& run, const void* send,
                         size_t send_count, void* recv, size_t recv_count, bool in_place) {
  ctx.set_work_dtype(DType::kFloat32);
  auto* send32 = reinterpret_cast<float*>(Scratch(2, send_count * sizeof(float)));
  float* recv32 =
      in_place ? send32 : reinterpret_cast<float*>(Scratch(3, recv_count * sizeof(float)));
  WidenBFloat16(send, send32, send_count);
  run(ctx, send32, recv32, DType::kFloat32);
  if (recv != nullptr) NarrowToBFloat16(recv32, recv, recv_count);
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

Algorithm GroupCommunicator::Select(CollectiveKind kind, Algorithm requested, size_t bytes) const {
  return SelectAlgorithm(kind, requested, bytes, size(), transport_->topology(),
                         transport_->native() != nullptr, transport_->kind());
}

void GroupCommunicator::CheckRoot(CollectiveKind kind, int root) const {
  SY_REQUIRE(root >= 0 && root < size(), InvalidArgument,
             "{}: root {} is not a rank of group '{}' of {} ranks", CollectiveName(kind), root,
             name_, size());
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

Work GroupCommunicator::Barrier(const BarrierOptions& options) {
  OpInfo info{CollectiveKind::kBarrier, Select(CollectiveKind::kBarrier, options.algorithm, 0)};
  info.user_tag = options.tag;
  if (info.algorithm == Algorithm::kNative) {
    return Submit(info, options.timeout,
                  [this](OpContext& ctx) { transport_->native()->Barrier(ctx.deadline()); });
  }
  return Submit(info, options.timeout, [](OpContext& ctx) { BarrierDissemination(ctx); });
}

Work GroupCommunicator::Broadcast(void* buffer, size_t count, DType dtype,
                                  const BroadcastOptions& options) {
  const auto kind = CollectiveKind::kBroadcast;
  CheckRoot(kind, options.root);
  CheckBuffer(kind, "buffer", buffer, count);
  OpInfo info{kind, Select(kind, options.algorithm, count * DTypeSize(dtype)), dtype};
  info.count = count;
  info.root = options.root;
  info.has_root = true;
  info.user_tag = options.tag;
  int root = options.root;
  switch (info.algorithm) {
    case Algorithm::kNative:
      return Submit(info, options.timeout, [=, this](OpContext& ctx) {
        transport_->native()->Broadcast(buffer, count, dtype, root, ctx.deadline());
      });
    case Algorithm::kScatterAllGather:
      return Submit(info, options.timeout,
                    [=](OpContext& ctx) { BroadcastScatterAllGather(ctx, buffer, count, root); });
    default:
      return Submit(info, options.timeout,
                    [=](OpContext& ctx) { BroadcastTree(ctx, buffer, count, root); });
  }
}

Work GroupCommunicator::Reduce(const void* send, void* recv, size_t count, DType dtype,
                               const ReduceOptions& options) {
  const auto kind = CollectiveKind::kReduce;
  CheckRoot(kind, options.root);
  CheckBuffer(kind, "send", send, count);
  if (rank() == options.root) CheckBuffer(kind, "recv (at root)", recv, count);
  OpInfo info{kind, Select(kind, options.algorithm, count * DTypeSize(dtype)), dtype,
              options.reduce_op};
  info.count = count;
  info.root = options.root;
  info.has_root = true;
  info.has_reduce_op = true;
  info.user_tag = options.tag;
  int root = options.root;
  ReduceOp op = options.reduce_op;
  ReductionRun run;
  switch (info.algorithm) {
    case Algorithm::kNative:
      run = [=, this](OpContext& ctx, const void* s, void* r, DType t) {
        transport_->native()->Reduce(s, r, count, t, op, root, ctx.deadline());
      };
      break;
    case Algorithm::kReduceScatterGather:
      run = [=](OpContext& ctx, const void* s, void* r, DType) {
        ReduceScatterGather(ctx, s, r, count, root);
      };
      break;
    default:
      run = [=](OpContext& ctx, const void* s, void* r, DType) {
        ReduceTree(ctx, s, r, count, root);
      };
  }
  if (dtype == DType::kBFloat16) {
    // In place on the float32 copy; only the root writes recv.
    return Submit(info, options.timeout, [=](OpContext& ctx) {
      AccumulateInFloat32(ctx, run, send, count, ctx.rank() == root ? recv : nullptr, count,
                          /*in_place=*/true);
    });
  }
  return Submit(info, options.timeout, [=](OpContext& ctx) { run(ctx, send, recv, dtype); });
}

Work GroupCommunicator::AllReduce(const void* send, void* recv, size_t count, DType dtype,
                                  const AllReduceOptions& options) {
  const auto kind = CollectiveKind::kAllReduce;
  CheckBuffer(kind, "send", send, count);
  CheckBuffer(kind, "recv", recv, count);
  OpInfo info{kind, Select(kind, options.algorithm, count * DTypeSize(dtype)), dtype,
              options.reduce_op};
  info.count = count;
  info.has_reduce_op = true;
  info.user_tag = options.tag;
  ReduceOp op = options.reduce_op;
  ReductionRun run;
  switch (info.algorithm) {
    case Algorithm::kNative:
      run = [=, this](OpContext& ctx, const void* s, void* r, DType t) {
        transport_->native()->AllReduce(s, r, count, t, op, ctx.deadline());
      };
      break;
    case Algorithm::kTree:
      run = [=](OpContext& ctx, const void* s, void* r, DType) { AllReduceTree(ctx, s, r, count); };
      break;
    default:
      run = [=](OpContext& ctx, const void* s, void* r, DType) { AllReduceRing(ctx, s, r, count); };
  }
  if (dtype == DType::kBFloat16) {
    return Submit(info, options.timeout, [=](OpContext& ctx) {
      AccumulateInFloat32(ctx, run, send, count, recv, count, /*in_place=*/true);
    });
  }
  return Submit(info, options.timeout, [=](OpContext& ctx) { run(ctx, send, recv, dtype); });
}

Work GroupCommunicator::AllGather(const void* send, void* recv, size_t count, DType dtype,
                                  const AllGatherOptions& options) {
  const auto kind = CollectiveKind::kAllGather;
  CheckBuffer(kind, "send", send, count);
  CheckBuffer(kind, "recv", recv, count);
  OpInfo info{kind, Select(kind, options.algorithm, count * DTypeSize(dtype) * size()), dtype};
  info.count = count;
  info.user_tag = options.tag;
  if (info.algorithm == Algorithm::kNative) {
    return Submit(info, options.timeout, [=, this](OpContext& ctx) {
      transport_->native()->AllGather(send, recv, count, dtype, ctx.deadline());
    });
  }
  if (info.algorithm == Algorithm::kLinear) {
    return Submit(info, options.timeout,
                  [=](OpContext& ctx) { AllGatherLinear(ctx, send, recv, count); });
  }
  return Submit(info, options.timeout,
                [=](OpContext& ctx) { AllGatherRing(ctx, send, recv, count); });
}

Work GroupCommunicator::ReduceScatter(const void* send, void* recv, size_t count, DType dtype,
                                      const ReduceScatterOptions& options) {
  const auto kind = CollectiveKind::kReduceScatter;
  CheckBuffer(kind, "send", send, count);
  CheckBuffer(kind, "recv", recv, count);
  OpInfo info{kind, Select(kind, options.algorithm, count * DTypeSize(dtype) * size()), dtype,
              options.reduce_op};
  info.count = count;
  info.has_reduce_op = true;
  info.user_tag = options.tag;
  ReduceOp op = options.reduce_op;
  ReductionRun run;
  if (info.algorithm == Algorithm::kNative) {
    run = [=, this](OpContext& ctx, const void* s, void* r, DType t) {
      transport_->native()->ReduceScatter(s, r, count, t, op, ctx.deadline());
    };
  } else {
    run = [=](OpContext& ctx, const void* s, void* r, DType) {
      ReduceScatterRing(ctx, s, r, count);
    };
  }
  if (dtype == DType::kBFloat16) {
    const size_t send_count = count * static_cast<size_t>(size());
    return Submit(info, options.timeout, [=](OpContext& ctx) {
      AccumulateInFloat32(ctx, run, send, send_count, recv, count, /*in_place=*/false);
    });
  }
  return Submit(info, options.timeout, [=](OpContext& ctx) { run(ctx, send, recv, dtype); });
}

Work GroupCommunicator::AllToAll(const void* send, void* recv, size_t count, DType dtype,
                                 const AllToAllOptions& options) {
  const auto kind = CollectiveKind::kAllToAll;
  CheckBuffer(kind, "send", send, count);
  CheckBuffer(kind, "recv", recv, count);
  const int w = size();
  OpInfo info{kind, Select(kind, options.algorithm, count * DTypeSize(dtype) * w), dtype};
  info.count = count;
  info.user_tag = options.tag;
  switch (info.algorithm) {
    case Algorithm::kNative:
      return Submit(info, options.timeout, [=, this](OpContext& ctx) {
        transport_->native()->AllToAll(send, recv, count, dtype, ctx.deadline());
      });
    case Algorithm::kHierarchical: {
      int per = options.ranks_per_node > 0 ? options.ranks_per_node : topology().ranks_per_node;
      SY_REQUIRE(per >= 1 && w % per == 0, InvalidArgument,
                 "alltoall (hierarchical): ranks_per_node {} must divide the group size {}", per,
                 w);
      return Submit(info, options.timeout,
                    [=](OpContext& ctx) { AllToAllHierarchical(ctx, send, recv, count, per); });
    }
    default: {
      std::vector<int64_t> counts(static_cast<size_t>(w), static_cast<int64_t>(count));
      AllToAllLayout layout = MakeLayout(kind, w, counts, {}, counts, {}, DTypeSize(dtype));
      bool linear = info.algorithm == Algorithm::kLinear;
      return Submit(info, options.timeout, [=](OpContext& ctx) {
        if (linear) {
          AllToAllLinear(ctx, send, recv, layout);
        } else {
          AllToAllPairwise(ctx, send, recv, layout);
        }
      });
    }
  }
}

Work GroupCommunicator::AllToAllV(const void* send, std::span<const int64_t> send_counts,
                                  std::span<const int64_t> send_displs, void* recv,
                                  std::span<const int64_t> recv_counts,
                                  std::span<const int64_t> recv_displs, DType dtype,
                                  const AllToAllOptions& options) {
  const auto kind = CollectiveKind::kAllToAllV;
  const int w = size();
  const size_t elem = DTypeSize(dtype);
  AllToAllLayout layout =
      MakeLayout(kind, w, send_counts, send_displs, recv_counts, recv_displs, elem);
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
  OpInfo info{kind, Select(kind, options.algorithm, 0), dtype};
  info.user_tag = options.tag;
  switch (info.algorithm) {
    case Algorithm::kNative: {
      std::vector<int64_t> sc(send_counts.begin(), send_counts.end());
      std::vector<int64_t> rc(recv_counts.begin(), recv_counts.end());
      std::vector<int64_t> sd, rd;
      for (size_t p = 0; p < static_cast<size_t>(w); ++p) {
        sd.push_back(static_cast<int64_t>(layout.send_offsets[p] / elem));
        rd.push_back(static_cast<int64_t>(layout.recv_offsets[p] / elem));
      }
      return Submit(info, options.timeout, [=, this](OpContext& ctx) {
        transport_->native()->AllToAllV(send, sc, sd, recv, rc, rd, dtype, ctx.deadline());
      });
    }
    case Algorithm::kLinear:
      return Submit(info, options.timeout,
                    [=](OpContext& ctx) { AllToAllLinear(ctx, send, recv, layout); });
    default:
      return Submit(info, options.timeout,
                    [=](OpContext& ctx) { AllToAllPairwise(ctx, send, recv, layout); });
  }
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
  OpInfo info{kind, Select(kind, options.algorithm, 0), dtype};
  info.user_tag = options.tag;
  std::vector<int64_t> rows(send_rows.begin(), send_rows.end());
  const size_t row_bytes = static_cast<size_t>(row_elems) * DTypeSize(dtype);
  Algorithm algorithm = info.algorithm;
  NativeCollectives* native = transport_->native();
  return Submit(info, options.timeout, [=](OpContext& ctx) {
    auto allocate = [&](int64_t total_rows) -> void* {
      Shape shape{total_rows};
      shape.insert(shape.end(), row_shape.begin(), row_shape.end());
      result->output = Tensor::Empty(shape, dtype);
      return result->output.raw();
    };
    std::vector<int64_t> recv_rows;
    if (algorithm == Algorithm::kNative) {
      // Counts through MPI_Alltoall, rows through MPI_Alltoallv (in elements).
      recv_rows.assign(static_cast<size_t>(w), 0);
      native->AllToAll(rows.data(), recv_rows.data(), 1, DType::kInt64, ctx.deadline());
      std::vector<int64_t> sc, sd, rc, rd;
      int64_t s_off = 0, r_off = 0;
      for (size_t p = 0; p < static_cast<size_t>(w); ++p) {
        sc.push_back(rows[p] * row_elems);
        sd.push_back(s_off);
        s_off += sc.back();
        rc.push_back(recv_rows[p] * row_elems);
        rd.push_back(r_off);
        r_off += rc.back();
      }
      void* recv = allocate(r_off / std::max<int64_t>(row_elems, 1));
      native->AllToAllV(send, sc, sd, recv, rc, rd, dtype, ctx.deadline());
    } else {
      recv_rows = AllToAllVTwoPhase(ctx, send, rows, row_bytes, algorithm, allocate);
    }
    result->recv_counts = recv_rows;
    result->recv_displs.assign(static_cast<size_t>(w), 0);
    for (size_t p = 1; p < static_cast<size_t>(w); ++p) {
      result->recv_displs[p] = result->recv_displs[p - 1] + recv_rows[p - 1];
    }
  });
}

Work GroupCommunicator::Scatter(const void* send, void* recv, size_t count, DType dtype,
                                const RootedOptions& options) {
  const auto kind = CollectiveKind::kScatter;
  CheckRoot(kind, options.root);
  if (rank() == options.root) CheckBuffer(kind, "send (at root)", send, count);
  CheckBuffer(kind, "recv", recv, count);
  OpInfo info{kind, Select(kind, options.algorithm, count * DTypeSize(dtype)), dtype};
  info.count = count;
  info.root = options.root;
  info.has_root = true;
  info.user_tag = options.tag;
  int root = options.root;
  if (info.algorithm == Algorithm::kNative) {
    return Submit(info, options.timeout, [=, this](OpContext& ctx) {
      transport_->native()->Scatter(send, recv, count, dtype, root, ctx.deadline());
    });
  }
  return Submit(info, options.timeout,
                [=](OpContext& ctx) { ScatterLinear(ctx, send, recv, count, root); });
}

Work GroupCommunicator::Gather(const void* send, void* recv, size_t count, DType dtype,
                               const RootedOptions& options) {
  const auto kind = CollectiveKind::kGather;
  CheckRoot(kind, options.root);
  CheckBuffer(kind, "send", send, count);
  if (rank() == options.root) CheckBuffer(kind, "recv (at root)", recv, count);
  OpInfo info{kind, Select(kind, options.algorithm, count * DTypeSize(dtype)), dtype};
  info.count = count;
  info.root = options.root;
  info.has_root = true;
  info.user_tag = options.tag;
  int root = options.root;
  if (info.algorithm == Algorithm::kNative) {
    return Submit(info, options.timeout, [=, this](OpContext& ctx) {
      transport_->native()->Gather(send, recv, count, dtype, root, ctx.deadline());
    });
  }
  return Submit(info, options.timeout,
                [=](OpContext& ctx) { GatherLinear(ctx, send, recv, count, root); });
}

}  // namespace switchyard::comm
