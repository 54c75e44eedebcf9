// RunSchedule (parallel/pipeline.h): one rank's operations of a pipeline schedule over the
// pipeline group's point-to-point Send/Recv.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <map>
#include <utility>
#include <vector>

#include "switchyard/core/clock.h"
#include "switchyard/core/error.h"
#include "switchyard/parallel/pipeline.h"

namespace switchyard::parallel {
namespace {

// FNV-1a over the configuration and every rank's operations.
int64_t Digest(const Schedule& s) {
  uint64_t h = 1469598103934665603ull;
  auto add = [&](int64_t x) {
    for (int i = 0; i < 8; ++i) {
      h ^= static_cast<uint64_t>(x >> (8 * i)) & 0xffu;
      h *= 1099511628211ull;
    }
  };
  add(s.config.stages);
  add(s.config.microbatches);
  add(s.config.virtual_stages);
  add(static_cast<int>(s.config.kind));
  for (const auto& ops : s.ops) {
    add(static_cast<int64_t>(ops.size()));
    for (const PipelineOp& op : ops) {
      add(static_cast<int>(op.kind));
      add(op.microbatch);
      add(op.chunk);
      add(op.peer);
    }
  }
  return static_cast<int64_t>(h);
}

}  // namespace

PipelineRunStats RunSchedule(comm::Communicator& group, const Schedule& schedule,
                             const PipelineStageCallbacks& cb) {
  const ScheduleConfig& c = schedule.config;
  const int p = group.size(), r = group.rank();
  SY_REQUIRE(c.stages == p, InvalidArgument,
             "pipeline schedule of {} stages on a pipeline group '{}' of {} ranks", c.stages,
             group.name(), p);
  SY_REQUIRE(static_cast<int>(schedule.ops.size()) == p, InvalidArgument,
             "pipeline schedule: {} ranks' lists for {} stages", schedule.ops.size(), p);
  // Every rank must run the same schedule: a different one would wait for messages never sent.
  std::vector<int64_t> digests(static_cast<size_t>(p));
  const int64_t mine = Digest(schedule);
  group.AllGather(&mine, digests.data(), 1, DType::kInt64).Wait();
  std::vector<int> differ;
  for (int q = 0; q < p; ++q) {
    if (digests[static_cast<size_t>(q)] != digests[0]) differ.push_back(q);
  }
  SY_REQUIRE(differ.empty(), InvalidArgument,
             "pipeline group '{}': ranks {} run another schedule than rank 0 (every stage must "
             "run the same kind, stages, micro-batches and virtual stages)",
             group.name(), fmt::join(differ, ", "));

  const int stages = c.stages * c.virtual_stages, last = stages - 1;
  auto stage_of = [&](int chunk) { return chunk * p + r; };
  // Tags name the message by its sender's virtual stage and micro-batch.
  auto tag = [&](int mb, int sender_stage, bool gradient) {
    return static_cast<uint32_t>((static_cast<int64_t>(mb) * stages + sender_stage) * 2 +
                                 (gradient ? 1 : 0));
  };
  PipelineRunStats stats;
  const double t0 = NowSeconds();
  using Key = std::pair<int, int>;  // (micro-batch, chunk)
  std::map<Key, Tensor> inputs, grads_in, outputs, grads_out;
  std::vector<std::pair<comm::Work, Tensor>> pending;  // sends and the tensors they read
  int in_flight = 0;
  auto timed = [&](auto&& fn) {
    const double s = NowSeconds();
    fn();
    stats.compute_seconds += NowSeconds() - s;
  };
  auto receive = [&](const PipelineOp& op, bool gradient, std::map<Key, Tensor>& into) {
    const int st = stage_of(op.chunk);
    // An activation has the shape of this chunk's input; the gradient of its output too (the
    // chunks of a model keep the activation's shape).
    Tensor t = Tensor::Empty(cb.input_shape(op.microbatch, op.chunk));
    const double s = NowSeconds();
    group
        .Recv(t.raw(), static_cast<size_t>(t.numel()), DType::kFloat32, op.peer,
              {.tag = tag(op.microbatch, gradient ? st + 1 : st - 1, gradient)})
        .Wait();
    stats.blocked_seconds += NowSeconds() - s;
    into[{op.microbatch, op.chunk}] = t;
  };
  auto send = [&](const PipelineOp& op, bool gradient, std::map<Key, Tensor>& from) {
    auto it = from.find({op.microbatch, op.chunk});
    SY_CHECK(it != from.end() && it->second.defined(), "pipeline: nothing to send for {}",
             OpKindName(op.kind));
    Tensor t = it->second.dtype() == DType::kFloat32 ? it->second : it->second.To(DType::kFloat32);
    from.erase(it);
    stats.bytes_sent += static_cast<int64_t>(t.nbytes());
    pending.emplace_back(
        group.Send(t.raw(), static_cast<size_t>(t.numel()), DType::kFloat32, op.peer,
                   {.tag = tag(op.microbatch, stage_of(op.chunk), gradient)}),
        t);
  };
  for (const PipelineOp& op : schedule.ops[static_cast<size_t>(r)]) {
    const Key key{op.microbatch, op.chunk};
    const int st = stage_of(op.chunk);
    switch (op.kind) {
      case OpKind::kRecvActivation: receive(op, false, inputs); break;
      case OpKind::kRecvGradient: receive(op, true, grads_in); break;
      case OpKind::kSendActivation: send(op, false, outputs); break;
      case OpKind::kSendGradient: send(op, true, grads_out); break;
      case OpKind::kForward: {
        Tensor input;
        if (st > 0) {
          input = inputs.at(key);
          inputs.erase(key);
        }
        Tensor out;
        timed([&] { out = cb.forward(op.microbatch, op.chunk, input); });
        if (st < last) outputs[key] = out;
        if (c.kind != ScheduleKind::kForwardOnly) {  // keeps its activations for the backward
          stats.peak_in_flight = std::max(stats.peak_in_flight, ++in_flight);
        }
        break;
      }
      case OpKind::kBackward:
      case OpKind::kBackwardInput: {
        Tensor grad;
        if (st < last) {
          grad = grads_in.at(key);
          grads_in.erase(key);
        }
        Tensor dx;
        const bool input_only = op.kind == OpKind::kBackwardInput;
        timed([&] { dx = cb.backward(op.microbatch, op.chunk, grad, input_only); });
        if (st > 0) grads_out[key] = dx;
        if (!input_only) --in_flight;
        break;
      }
      case OpKind::kBackwardWeight:
        timed([&] {
          if (cb.backward_weight) cb.backward_weight(op.microbatch, op.chunk);
        });
        --in_flight;
        break;
    }
  }
  const double s = NowSeconds();
  for (auto& [work, tensor] : pending) work.Wait();
  stats.blocked_seconds += NowSeconds() - s;
  stats.seconds = NowSeconds() - t0;
  return stats;
}

}  // namespace switchyard::parallel
