// MPI's own collectives: each starts MPI's non-blocking form on the transport's communicator and
// polls it against the deadline (see mpi_collectives.h).
#include "comm/mpi_collectives.h"

#include <climits>
#include <utility>
#include <vector>

#include "switchyard/comm/reduce.h"

namespace switchyard::comm::mpi {
namespace {

// bfloat16 reductions for MPI's own collectives: MPI has no bfloat16.
template <ReduceOp kOp>
void BFloat16Op(void* in, void* inout, int* len, MPI_Datatype*) {
  ReduceInto(inout, in, inout, static_cast<size_t>(*len), DType::kBFloat16, kOp);
}

MPI_Op bf16_ops[3] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};  // [ReduceOp]

MPI_Datatype ToMpi(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return MPI_FLOAT;
    case DType::kBFloat16: return MPI_UINT16_T;
    case DType::kInt32: return MPI_INT32_T;
    case DType::kInt64: return MPI_INT64_T;
    case DType::kInt16: return MPI_INT16_T;
  }
  return MPI_BYTE;
}

MPI_Op ToMpi(ReduceOp op, DType dtype) {
  if (dtype == DType::kBFloat16) return bf16_ops[static_cast<size_t>(op)];
  switch (op) {
    case ReduceOp::kSum: return MPI_SUM;
    case ReduceOp::kMax: return MPI_MAX;
    case ReduceOp::kMin: return MPI_MIN;
  }
  return MPI_OP_NULL;
}

class MpiCollectives final : public NativeCollectives {
 public:
  MpiCollectives(MPI_Comm comm, PollFn poll) : comm_(comm), poll_(std::move(poll)) {
    MPI_Comm_rank(comm_, &rank_);
  }

  void Barrier(Deadline deadline) override {
    MPI_Request r;
    SY_MPI_CALL(MPI_Ibarrier(comm_, &r));
    poll_(r, deadline, "MPI_Ibarrier");
  }
  void Broadcast(void* buffer, size_t count, DType dtype, int root, Deadline deadline) override {
    MPI_Request r;
    SY_MPI_CALL(MPI_Ibcast(buffer, ToInt(count, "count"), ToMpi(dtype), root, comm_, &r));
    poll_(r, deadline, "MPI_Ibcast");
  }
  void Reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op, int root,
              Deadline deadline) override {
    MPI_Request r;
    const void* s = (rank_ == root && send == recv) ? MPI_IN_PLACE : send;
    SY_MPI_CALL(MPI_Ireduce(s, recv, ToInt(count, "count"), ToMpi(dtype), ToMpi(op, dtype), root,
                            comm_, &r));
    poll_(r, deadline, "MPI_Ireduce");
  }
  void AllReduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                 Deadline deadline) override {
    MPI_Request r;
    const void* s = send == recv ? MPI_IN_PLACE : send;
    SY_MPI_CALL(
        MPI_Iallreduce(s, recv, ToInt(count, "count"), ToMpi(dtype), ToMpi(op, dtype), comm_, &r));
    poll_(r, deadline, "MPI_Iallreduce");
  }
  void AllGather(const void* send, void* recv, size_t count, DType dtype,
                 Deadline deadline) override {
    MPI_Request r;
    int n = ToInt(count, "count");
    const void* s = send == static_cast<const std::byte*>(recv) + count * DTypeSize(dtype) * rank_
                        ? MPI_IN_PLACE
                        : send;
    SY_MPI_CALL(MPI_Iallgather(s, n, ToMpi(dtype), recv, n, ToMpi(dtype), comm_, &r));
    poll_(r, deadline, "MPI_Iallgather");
  }
  void ReduceScatter(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                     Deadline deadline) override {
    MPI_Request r;
    SY_MPI_CALL(MPI_Ireduce_scatter_block(send, recv, ToInt(count, "count"), ToMpi(dtype),
                                          ToMpi(op, dtype), comm_, &r));
    poll_(r, deadline, "MPI_Ireduce_scatter_block");
  }
  void AllToAll(const void* send, void* recv, size_t count, DType dtype,
                Deadline deadline) override {
    MPI_Request r;
    int n = ToInt(count, "count");
    SY_MPI_CALL(MPI_Ialltoall(send, n, ToMpi(dtype), recv, n, ToMpi(dtype), comm_, &r));
    poll_(r, deadline, "MPI_Ialltoall");
  }
  void AllToAllV(const void* send, std::span<const int64_t> send_counts,
                 std::span<const int64_t> send_displs, void* recv,
                 std::span<const int64_t> recv_counts, std::span<const int64_t> recv_displs,
                 DType dtype, Deadline deadline) override {
    auto to_int = [](std::span<const int64_t> v) {
      std::vector<int> out;
      for (int64_t x : v) out.push_back(ToInt(static_cast<size_t>(x), "count or displacement"));
      return out;
    };
    std::vector<int> sc = to_int(send_counts), sd = to_int(send_displs);
    std::vector<int> rc = to_int(recv_counts), rd = to_int(recv_displs);
    MPI_Request r;
    SY_MPI_CALL(MPI_Ialltoallv(send, sc.data(), sd.data(), ToMpi(dtype), recv, rc.data(), rd.data(),
                               ToMpi(dtype), comm_, &r));
    poll_(r, deadline, "MPI_Ialltoallv");
  }
  void Scatter(const void* send, void* recv, size_t count, DType dtype, int root,
               Deadline deadline) override {
    Rooted(MPI_Iscatter, "MPI_Iscatter", send, recv, count, dtype, root, deadline);
  }
  void Gather(const void* send, void* recv, size_t count, DType dtype, int root,
              Deadline deadline) override {
    Rooted(MPI_Igather, "MPI_Igather", send, recv, count, dtype, root, deadline);
  }

 private:
  // MPI_Iscatter and MPI_Igather: one signature, `count` elements per block.
  using RootedCall = int (*)(const void*, int, MPI_Datatype, void*, int, MPI_Datatype, int,
                             MPI_Comm, MPI_Request*);
  void Rooted(RootedCall call, const char* what, const void* send, void* recv, size_t count,
              DType dtype, int root, Deadline deadline) {
    MPI_Request r;
    const int n = ToInt(count, "count");
    const int rc = call(send, n, ToMpi(dtype), recv, n, ToMpi(dtype), root, comm_, &r);
    if (rc != MPI_SUCCESS) throw PeerError(fmt::format("{} failed: {}", what, ErrorString(rc)));
    poll_(r, deadline, what);
  }

  MPI_Comm comm_;
  PollFn poll_;
  int rank_ = 0;
};

}  // namespace

std::string ErrorString(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  return std::string(text, static_cast<size_t>(len));
}

int ToInt(size_t n, const char* what) {
  SY_REQUIRE(n <= static_cast<size_t>(INT_MAX), InvalidArgument,
             "MPI transport: {} of {} exceeds INT_MAX (split the message)", what, n);
  return static_cast<int>(n);
}

void CreateBFloat16Ops() {
  if (bf16_ops[0] != MPI_OP_NULL) return;
  MPI_Op_create(&BFloat16Op<ReduceOp::kSum>, 1, &bf16_ops[0]);
  MPI_Op_create(&BFloat16Op<ReduceOp::kMax>, 1, &bf16_ops[1]);
  MPI_Op_create(&BFloat16Op<ReduceOp::kMin>, 1, &bf16_ops[2]);
}

void FreeBFloat16Ops() {
  for (MPI_Op& op : bf16_ops) {
    if (op != MPI_OP_NULL) MPI_Op_free(&op);
  }
}

std::unique_ptr<NativeCollectives> CreateMpiCollectives(MPI_Comm comm, PollFn poll) {
  return std::make_unique<MpiCollectives>(comm, std::move(poll));
}

}  // namespace switchyard::comm::mpi
