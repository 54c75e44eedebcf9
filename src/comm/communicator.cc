// The Tensor forms of the collectives: shape and dtype checks, then the raw forms.
#include "switchyard/comm/communicator.h"

#include <fmt/format.h>

#include <vector>

#include "switchyard/core/error.h"

namespace switchyard::comm {
namespace {

// Elements per row (dim 0) of t; 1 for a 1-D tensor.
int64_t RowElems(const Tensor& t) {
  int64_t elems = 1;
  for (int64_t d = 1; d < t.dim(); ++d) elems *= t.size(d);
  return elems;
}

Shape RowShape(const Tensor& t) { return Shape(t.shape().begin() + 1, t.shape().end()); }

void ExpectRows(std::string_view op, std::string_view name, const Tensor& t, int64_t rows,
                const Shape& row_shape, DType dtype) {
  SY_REQUIRE(t.defined() && t.dim() >= 1, InvalidArgument,
             "{}: {} must be a defined tensor with at least one dimension", op, name);
  Shape expected{rows};
  expected.insert(expected.end(), row_shape.begin(), row_shape.end());
  ExpectShape(fmt::format("{}: {}", op, name), t, expected);
  ExpectDType(fmt::format("{}: {}", op, name), t, dtype);
}

int64_t Sum(std::span<const int64_t> v) {
  int64_t s = 0;
  for (int64_t x : v) s += x;
  return s;
}

}  // namespace

Work Communicator::Send(const void*, size_t, DType, int, const PointToPointOptions&) {
  throw InvalidArgument(
      fmt::format("communicator '{}' ({}) has no point-to-point Send", name(), transport_kind()));
}

Work Communicator::Recv(void*, size_t, DType, int, const PointToPointOptions&) {
  throw InvalidArgument(
      fmt::format("communicator '{}' ({}) has no point-to-point Recv", name(), transport_kind()));
}

Work Communicator::AllReduce(const Tensor& tensor, const AllReduceOptions& options) {
  SY_REQUIRE(tensor.defined(), InvalidArgument, "allreduce: tensor is undefined");
  return AllReduce(tensor.raw(), tensor.raw(), static_cast<size_t>(tensor.numel()), tensor.dtype(),
                   options);
}

Work Communicator::Broadcast(const Tensor& tensor, const BroadcastOptions& options) {
  SY_REQUIRE(tensor.defined(), InvalidArgument, "broadcast: tensor is undefined");
  return Broadcast(tensor.raw(), static_cast<size_t>(tensor.numel()), tensor.dtype(), options);
}

Work Communicator::AllGather(const Tensor& input, const Tensor& output,
                             const AllGatherOptions& options) {
  SY_REQUIRE(input.defined() && input.dim() >= 1, InvalidArgument,
             "allgather: input must be a defined tensor with at least one dimension");
  ExpectRows("allgather", "output", output, size() * input.size(0), RowShape(input), input.dtype());
  return AllGather(input.raw(), output.raw(), static_cast<size_t>(input.numel()), input.dtype(),
                   options);
}

Work Communicator::ReduceScatter(const Tensor& input, const Tensor& output,
                                 const ReduceScatterOptions& options) {
  SY_REQUIRE(output.defined() && output.dim() >= 1, InvalidArgument,
             "reduce_scatter: output must be a defined tensor with at least one dimension");
  ExpectRows("reduce_scatter", "input", input, size() * output.size(0), RowShape(output),
             output.dtype());
  return ReduceScatter(input.raw(), output.raw(), static_cast<size_t>(output.numel()),
                       output.dtype(), options);
}

Work Communicator::AllToAll(const Tensor& input, const Tensor& output,
                            const AllToAllOptions& options) {
  SY_REQUIRE(input.defined() && input.dim() >= 1, InvalidArgument,
             "alltoall: input must be a defined tensor with at least one dimension");
  SY_REQUIRE(input.size(0) % size() == 0, InvalidArgument,
             "alltoall: input has {} rows, not a multiple of the group size {}", input.size(0),
             size());
  ExpectRows("alltoall", "output", output, input.size(0), RowShape(input), input.dtype());
  return AllToAll(input.raw(), output.raw(), static_cast<size_t>(input.numel() / size()),
                  input.dtype(), options);
}

Work Communicator::AllToAllV(const Tensor& input, std::span<const int64_t> send_rows,
                             const Tensor& output, std::span<const int64_t> recv_rows,
                             const AllToAllOptions& options) {
  SY_REQUIRE(input.defined() && input.dim() >= 1, InvalidArgument,
             "alltoallv: input must be a defined tensor with at least one dimension");
  ExpectRows("alltoallv", "input", input, Sum(send_rows), RowShape(input), input.dtype());
  ExpectRows("alltoallv", "output", output, Sum(recv_rows), RowShape(input), input.dtype());
  const int64_t row = RowElems(input);
  std::vector<int64_t> send_counts, recv_counts;
  for (int64_t r : send_rows) send_counts.push_back(r * row);
  for (int64_t r : recv_rows) recv_counts.push_back(r * row);
  return AllToAllV(input.raw(), send_counts, {}, output.raw(), recv_counts, {}, input.dtype(),
                   options);
}

Work Communicator::AllToAllVDynamic(const Tensor& input, std::span<const int64_t> send_rows,
                                    AllToAllVResult* result, const AllToAllOptions& options) {
  SY_REQUIRE(input.defined() && input.dim() >= 1, InvalidArgument,
             "alltoallv_dynamic: input must be a defined tensor with at least one dimension");
  ExpectRows("alltoallv_dynamic", "input", input, Sum(send_rows), RowShape(input), input.dtype());
  return AllToAllVDynamicRows(input.raw(), send_rows, RowElems(input), RowShape(input),
                              input.dtype(), result, options);
}

Work Communicator::AllToAllVDynamic(const void* send, std::span<const int64_t> send_counts,
                                    DType dtype, AllToAllVResult* result,
                                    const AllToAllOptions& options) {
  return AllToAllVDynamicRows(send, send_counts, 1, {}, dtype, result, options);
}

}  // namespace switchyard::comm
