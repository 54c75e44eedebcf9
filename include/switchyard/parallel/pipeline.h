// Pipeline schedules as data: a generator turns (stages p, micro-batches m, virtual stages v,
// kind) into one list of operations per pipeline rank, a validator proves the lists complete and
// deadlock-free before anything runs, and a simulator predicts their timeline (bubble fraction,
// micro-batches in flight). The trainer's executor (train/pipeline.h) runs any valid schedule;
// docs/pipeline.md draws the four kinds.
//
// Model chunks. The model's blocks are cut into p * v consecutive pieces, the virtual stages
// s = 0 .. p*v - 1 (v = 1 without interleaving). Pipeline rank r holds the v chunks
// s = r, r + p, r + 2p, ... (Megatron's interleaved layout); PipelineOp::chunk is the index
// c = 0 .. v - 1 of the chunk on its rank, so its virtual stage is s = c * p + r. Activations
// flow s -> s + 1 (rank r -> r + 1, and from rank p - 1 to rank 0 between chunks), gradients the
// other way. Virtual stage 0 starts from the micro-batch's tokens, stage p*v - 1 ends in the loss.
//
// Operations of one rank run in list order; sends are asynchronous (the executor keeps the
// buffer until the send completes), receives block until their message arrives.
//   kForward         F of (microbatch, chunk): its input is the tokens (s = 0) or the activation
//                    received earlier by a kRecvActivation of the same (microbatch, chunk).
//   kBackward        B: input and weight gradients of (microbatch, chunk). Its incoming gradient
//                    is the loss's (last virtual stage) or the one received by a kRecvGradient.
//   kBackwardInput   zero-bubble B: the input gradient only (what the previous stage waits for)
//   kBackwardWeight  zero-bubble W: the weight gradient of a (microbatch, chunk) whose
//                    kBackwardInput ran before
//   kSendActivation  F's output of (microbatch, chunk) to the rank holding virtual stage s + 1
//   kRecvActivation  the input of (microbatch, chunk) from the rank holding s - 1
//   kSendGradient    the input gradient of (microbatch, chunk) to the rank holding s - 1
//   kRecvGradient    the output gradient of (microbatch, chunk) from the rank holding s + 1
// `peer` is the pipeline rank of the other side of a send/receive (-1 for compute ops).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "switchyard/comm/communicator.h"
#include "switchyard/core/tensor.h"

namespace switchyard::parallel {

enum class ScheduleKind : uint8_t {
  kFthenB,           // GPipe: all forwards, then all backwards
  k1F1B,             // PipeDream-flush: warm-up forwards, then one forward / one backward
  kInterleaved1F1B,  // Megatron's virtual pipeline: v chunks per rank, 1F1B over them
  kZeroBubbleH1,     // ZB-H1: 1F1B with B split into B (input) and W (weight), W filling bubbles
  kForwardOnly       // evaluation and sampling: every chunk's forwards, chunk by chunk, no backward
};
// "fthenb", "1f1b", "interleaved", "zb-h1", "forward"; FromName throws InvalidArgument listing
// them.
std::string_view ScheduleKindName(ScheduleKind kind);
ScheduleKind ScheduleKindFromName(std::string_view name);

enum class OpKind : uint8_t {
  kForward,
  kBackward,
  kBackwardInput,
  kBackwardWeight,
  kSendActivation,
  kRecvActivation,
  kSendGradient,
  kRecvGradient
};
// "F", "B", "Bi", "W", "send_act", "recv_act", "send_grad", "recv_grad".
std::string_view OpKindName(OpKind kind);

struct PipelineOp {
  OpKind kind = OpKind::kForward;
  int microbatch = 0;  // 0 .. m - 1
  int chunk = 0;       // 0 .. v - 1: the chunk on this rank (virtual stage chunk * p + rank)
  int peer = -1;       // sends/receives: the other pipeline rank
  bool operator==(const PipelineOp&) const = default;
};

struct ScheduleConfig {
  int stages = 1;          // p >= 1 pipeline ranks
  int microbatches = 1;    // m >= 1
  int virtual_stages = 1;  // v >= 1 chunks per rank (> 1 only for kInterleaved1F1B)
  ScheduleKind kind = ScheduleKind::k1F1B;
};

struct Schedule {
  ScheduleConfig config;
  std::vector<std::vector<PipelineOp>> ops;  // [pipeline rank] -> operations in order
};

// Throws InvalidArgument naming the field for a config the kind cannot schedule (p, m, v < 1;
// v > 1 except interleaved and forward-only; interleaved with m not a multiple of p, as Megatron
// requires).
void ValidateScheduleConfig(const ScheduleConfig& config);
// An upper bound on the memory MakeSchedule and SimulateSchedule take for `config`: the op lists
// and the validator's and the simulator's bookkeeping, kScheduleBytesPerPass bytes per
// (micro-batch, virtual stage) pass on a rank, p * m * v of them (computed without overflow;
// saturates). Measured: `switchyard schedule --json` peaks at 4.5-4.6 KB per pass for every kind
// (p 64, m 4096: 1.19 GB; p 256, m 4096: 4.78 GB).
inline constexpr uint64_t kScheduleBytesPerPass = 5120;
uint64_t ScheduleMemoryBytes(const ScheduleConfig& config);
// The schedule of `config` (validated by ValidateSchedule before it is returned). First refuses,
// with InvalidArgument, a schedule whose ScheduleMemoryBytes exceed the memory available
// (RequireMemory, core/limits.h), before building any of it.
Schedule MakeSchedule(const ScheduleConfig& config);

// Proves a schedule runnable: every (microbatch, virtual stage) has exactly one forward and one
// backward (B, or Bi followed later by W on the same rank; forward-only: no backward and no
// gradient message), each compute op finds its input
// (tokens, a received activation, the loss, a received gradient) already there, every send has a
// matching receive on `peer` (same kind, microbatch and chunk, in the same order between each pair
// of ranks), and running all ranks with asynchronous sends and blocking receives finishes (no
// deadlock). Throws InvalidArgument naming the rank, the op's position and what is wrong.
void ValidateSchedule(const Schedule& schedule);

// Relative costs for the simulator (time units); communication is free unless `send` > 0.
struct ScheduleCosts {
  double forward = 1.0;
  double backward = 2.0;         // B (input and weight gradients)
  double backward_input = 1.0;   // Bi
  double backward_weight = 1.0;  // W
  double send = 0.0;             // latency of one activation/gradient message
};

struct TimedOp {
  PipelineOp op;
  double start = 0;
  double end = 0;
};

struct ScheduleSimulation {
  double makespan = 0;
  // Idle share of the ranks' time between the first start and the makespan:
  // 1 - (sum of compute time) / (p * makespan).
  double bubble_fraction = 0;
  // Per rank: the most micro-batch chunks whose forward has run and whose backward (B, or W for
  // zero-bubble) has not, at any time (the activations it holds; 0 for forward-only, which keeps
  // none).
  std::vector<int> peak_in_flight;
  std::vector<std::vector<TimedOp>> timeline;  // [rank] compute ops with their times
};
// Runs the schedule in simulated time (each rank in list order, a receive waiting for its send).
ScheduleSimulation SimulateSchedule(const Schedule& schedule, const ScheduleCosts& costs = {});

// The textbook bubble fraction (idle share of p x makespan) with F = 1, B = 2 (Bi = W = 1):
// (p - 1) / (m + p - 1) for FthenB and 1F1B, (p - 1) / (v m + p - 1) interleaved (Megatron quotes
// the same as bubble over ideal time, (p - 1) / (v m)), and for ZB-H1 (p - 1) / (3 m + p - 1)
// (the zero-bubble paper's (p - 1)(F + Bi - W) idle time per rank, a third of 1F1B's); for
// forward-only (p - 1) / (v m + p - 1) (with v > 1, when m >= p: a rank's next chunk then never
// waits for the pipeline's other ranks).
double TheoreticalBubbleFraction(const ScheduleConfig& config);

// ---- The executor ----

// What a pipeline rank computes; the executor moves the tensors between the ranks.
struct PipelineStageCallbacks {
  // Shape of the activation entering (microbatch, chunk), which is also the shape of the input
  // gradient it sends back (float32): sizes the receive buffers.
  std::function<Shape(int microbatch, int chunk)> input_shape;
  // F. `input` is the received activation (undefined at virtual stage 0). Returns the output
  // activation to send on (undefined at the last virtual stage, which ends in the loss).
  std::function<Tensor(int microbatch, int chunk, const Tensor& input)> forward;
  // B (input_only false) or zero-bubble Bi (true). `grad_output` is the received gradient
  // (undefined at the last virtual stage). Returns the input gradient to send back (undefined at
  // virtual stage 0).
  std::function<Tensor(int microbatch, int chunk, const Tensor& grad_output, bool input_only)>
      backward;
  // W after a Bi of the same (microbatch, chunk).
  std::function<void(int microbatch, int chunk)> backward_weight;
};

struct PipelineRunStats {
  double seconds = 0;          // wall time of the run
  double compute_seconds = 0;  // in the callbacks
  double blocked_seconds = 0;  // waiting for receives (and for sends at the end)
  int64_t bytes_sent = 0;
  int peak_in_flight = 0;  // most (microbatch, chunk) between F and the end of B/W
};

// Runs this rank's operations of `schedule` over `group` (the pipeline group: group.rank() is the
// pipeline rank, group.size() == schedule.config.stages) with Send/Recv, then waits for its sends.
// First checks, collectively, that every rank runs the same schedule (InvalidArgument naming the
// ranks whose schedule differs). Receives wait at most the group's deadline: a stage that never
// sends (it died, or runs another schedule) becomes TimeoutError naming the operation.
PipelineRunStats RunSchedule(comm::Communicator& group, const Schedule& schedule,
                             const PipelineStageCallbacks& callbacks);

}  // namespace switchyard::parallel
