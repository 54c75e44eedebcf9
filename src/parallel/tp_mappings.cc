// The tensor- and sequence-parallel forward/backward pairs (parallel/tp_mappings.h), on the
// counted collectives of parallel/collectives.h.
#include "switchyard/parallel/tp_mappings.h"

#include <string_view>

#include "parallel/collectives.h"
#include "switchyard/core/error.h"

namespace switchyard::parallel {

using internal::SwapMiddle;

namespace {

// x defined, float32, at least one dimension; InvalidArgument naming `what` otherwise.
void CheckRows(std::string_view what, const Tensor& x) {
  SY_REQUIRE(x.defined() && x.dim() >= 1, InvalidArgument, "{}: expected [rows, ...], got {}", what,
             x.defined() ? ShapeToString(x.shape()) : "undefined");
  ExpectDType(what, x, DType::kFloat32);
}

// As CheckRows, and the rows divide by the group's size (split or reduce-scatter along them).
void CheckSplitRows(std::string_view what, const Tensor& x, const comm::Communicator& g) {
  CheckRows(what, x);
  SY_REQUIRE(x.size(0) % g.size() == 0, InvalidArgument,
             "{}: {} rows do not divide by the size {} of group '{}' (sequence parallelism needs "
             "the token count padded to a multiple of it)",
             what, x.size(0), g.size(), g.name());
}

Tensor AllReduceInPlace(comm::Communicator& g, const Tensor& x, CommStats* stats) {
  internal::AllReduceSum(g, x, Traffic::kTensor, stats);
  return x;
}

// x [batch * n, parts * W] sharded -> [batch * P * n, parts * W / P] (UlyssesSwap::Forward).
Tensor ToHeads(comm::Communicator& g, const Tensor& x, int64_t batch, int64_t parts,
               CommStats* stats) {
  const int64_t p = g.size(), rows = x.size(0), n = rows / batch, cols = x.size(1) / p;
  // send block q = this rank's rows of head group q: [rows, parts, P, W / P] -> [P, rows, parts,
  // W / P].
  Tensor send = Tensor::Empty({p * rows, cols}), recv = Tensor::Empty({p * rows, cols});
  SwapMiddle(x.data<float>(), send.data<float>(), 1, rows * parts, p, cols / parts);
  internal::AllToAll(g, send, recv, {}, Traffic::kContext, stats);
  // recv block q = rank q's rows [batch, n] of head group r: [P, batch, n * cols] -> [batch, P,
  // n * cols].
  Tensor out = Tensor::Empty({batch * p * n, cols});
  SwapMiddle(recv.data<float>(), out.data<float>(), 1, p, batch, n * cols);
  return out;
}

// The inverse of ToHeads (UlyssesSwap::Backward).
Tensor ToSequence(comm::Communicator& g, const Tensor& y, int64_t batch, int64_t parts,
                  CommStats* stats) {
  const int64_t p = g.size(), cols = y.size(1), rows = y.size(0) / p, n = rows / batch;
  Tensor send = Tensor::Empty({p * rows, cols}), recv = Tensor::Empty({p * rows, cols});
  SwapMiddle(y.data<float>(), send.data<float>(), 1, batch, p, n * cols);
  internal::AllToAll(g, send, recv, {}, Traffic::kContext, stats);
  Tensor out = Tensor::Empty({rows, p * cols});
  SwapMiddle(recv.data<float>(), out.data<float>(), 1, p, rows * parts, cols / parts);
  return out;
}

void CheckUlysses(std::string_view what, const Tensor& t, int64_t row_groups, int64_t batch,
                  int64_t parts, int64_t col_divisor, const comm::Communicator& g) {
  CheckRows(what, t);
  SY_REQUIRE(t.dim() == 2, InvalidArgument, "{}: expected [rows, cols], got {}", what,
             ShapeToString(t.shape()));
  SY_REQUIRE(batch > 0 && t.size(0) % (row_groups * batch) == 0, InvalidArgument,
             "{}: {} rows are not {} sequences x {} ranks' blocks (group '{}')", what, t.size(0),
             batch, row_groups, g.name());
  SY_REQUIRE(parts > 0 && t.size(1) % (parts * col_divisor) == 0, InvalidArgument,
             "{}: {} columns do not split into {} parts of a multiple of {} heads' columns "
             "(group '{}' of {} ranks)",
             what, t.size(1), parts, col_divisor, g.name(), g.size());
}

}  // namespace

Tensor CopyToTp::Forward(comm::Communicator&, const Tensor& x, CommStats*) {
  CheckRows("CopyToTp forward: x", x);
  return x;
}

Tensor CopyToTp::Backward(comm::Communicator& group, const Tensor& dy, CommStats* stats) {
  CheckRows("CopyToTp backward: dy", dy);
  if (group.size() == 1) return dy;
  return AllReduceInPlace(group, dy, stats);
}

Tensor ReduceFromTp::Forward(comm::Communicator& group, const Tensor& x, CommStats* stats) {
  CheckRows("ReduceFromTp forward: x", x);
  if (group.size() == 1) return x;
  return AllReduceInPlace(group, x, stats);
}

Tensor ReduceFromTp::Backward(comm::Communicator&, const Tensor& dy, CommStats*) {
  CheckRows("ReduceFromTp backward: dy", dy);
  return dy;
}

Tensor ScatterToSp::Forward(comm::Communicator& group, const Tensor& x, CommStats*) {
  CheckSplitRows("ScatterToSp forward: x", x, group);
  const int64_t n = x.size(0) / group.size();
  return group.size() == 1 ? x : x.Slice(group.rank() * n, (group.rank() + 1) * n);
}

Tensor ScatterToSp::Backward(comm::Communicator& group, const Tensor& dy, CommStats* stats) {
  CheckRows("ScatterToSp backward: dy", dy);
  if (group.size() == 1) return dy;
  return internal::AllGather(group, dy, Traffic::kTensor, stats);
}

Tensor GatherFromSp::Forward(comm::Communicator& group, const Tensor& x, CommStats* stats) {
  CheckRows("GatherFromSp forward: x", x);
  if (group.size() == 1) return x;
  return internal::AllGather(group, x, Traffic::kTensor, stats);
}

Tensor GatherFromSp::Backward(comm::Communicator& group, const Tensor& dy, CommStats* stats) {
  CheckSplitRows("GatherFromSp backward: dy", dy, group);
  if (group.size() == 1) return dy;
  return internal::ReduceScatter(group, dy, Traffic::kTensor, stats);
}

Tensor ReduceScatterToSp::Forward(comm::Communicator& group, const Tensor& x, CommStats* stats) {
  CheckSplitRows("ReduceScatterToSp forward: x", x, group);
  if (group.size() == 1) return x;
  return internal::ReduceScatter(group, x, Traffic::kTensor, stats);
}

Tensor ReduceScatterToSp::Backward(comm::Communicator& group, const Tensor& dy, CommStats* stats) {
  CheckRows("ReduceScatterToSp backward: dy", dy);
  if (group.size() == 1) return dy;
  return internal::AllGather(group, dy, Traffic::kTensor, stats);
}

Tensor UlyssesSwap::Forward(comm::Communicator& group, const Tensor& x, int64_t batch,
                            int64_t parts, CommStats* stats) {
  CheckUlysses("UlyssesSwap forward: x", x, 1, batch, parts, group.size(), group);
  if (group.size() == 1) return x;
  return ToHeads(group, x, batch, parts, stats);
}

Tensor UlyssesSwap::Backward(comm::Communicator& group, const Tensor& dy, int64_t batch,
                             int64_t parts, CommStats* stats) {
  CheckUlysses("UlyssesSwap backward: dy", dy, group.size(), batch, parts, 1, group);
  if (group.size() == 1) return dy;
  return ToSequence(group, dy, batch, parts, stats);
}

}  // namespace switchyard::parallel
