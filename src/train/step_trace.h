// The timeline of one training step on every rank (TrainConfig::trace_step): the MoE blocks'
// events (parallel::Tracer: gate, experts, each chunk's sends and returns, every collective with
// its bytes) and the trainer's own phases of the step on each rank (forward + backward of the
// micro-batches, gradient reduction, gradient norm, optimizer step, ZeRO-3 parameter gathering),
// gathered to world rank 0 and written as one Chrome trace-event file.
//
// Thread-safety: one StepTrace per rank; End is collective over the world on the traced step.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "switchyard/comm/communicator.h"
#include "switchyard/parallel/moe_parallel.h"
#include "switchyard/parallel/trace.h"

namespace switchyard::train::internal {

class StepTrace {
 public:
  // `step`: the 1-based step to trace; `path`: the file world rank 0 writes (atomically).
  StepTrace(comm::Communicator& world, int64_t step, std::string path);

  // A layer whose events go into the trace while the traced step runs.
  void AddLayer(parallel::ParallelMoeLayer* layer) { layers_.push_back(layer); }
  // Step `step` (1-based) starts: on the traced step, the layers record from here.
  void Begin(int64_t step);
  // Step `step` ended: on the traced step every rank's events go to rank 0, which writes the
  // file (collective over the world on that step only).
  void End(int64_t step);
  bool active() const { return active_; }
  // A phase of the step on this rank (no-op unless active).
  void Add(const char* name, const char* category, parallel::TraceStream stream, double begin_s,
           double end_s);

  // Records [construction, destruction) as a phase when the trace is active.
  class Span {
   public:
    Span(StepTrace* trace, const char* name, const char* category, parallel::TraceStream stream);
    ~Span();
    Span(const Span&) = delete;
    Span& operator=(const Span&) = delete;

   private:
    StepTrace* trace_;
    const char* name_;
    const char* category_;
    parallel::TraceStream stream_;
    double begin_s_;
  };

  // When the traced step began on this rank (its forward + backward phase starts there).
  double step_begin_s() const { return step_begin_s_; }

 private:
  comm::Communicator& world_;
  int64_t step_;
  std::string path_;
  std::vector<parallel::ParallelMoeLayer*> layers_;
  parallel::Tracer tracer_;
  bool active_ = false;
  double step_begin_s_ = 0;
};

}  // namespace switchyard::train::internal
