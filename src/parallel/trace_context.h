// Where the parallel layer's code records trace events: a per-thread context (tracer, rank,
// category) that ParallelMoeLayer sets for the duration of a call, so that helpers deep down
// (collectives.cc, the pipeline) record without a tracer argument. Private to src/parallel.
#pragma once

#include <chrono>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "switchyard/comm/communicator.h"
#include "switchyard/core/clock.h"
#include "switchyard/parallel/trace.h"

namespace switchyard::parallel::internal {

struct TraceContext {
  Tracer* tracer = nullptr;
  int rank = 0;
  const char* category = "";
};

// This thread's context (no tracer by default).
TraceContext& CurrentTrace();

// Sets this thread's context for its scope (tracer may be null: records nothing).
class ScopedTraceContext {
 public:
  ScopedTraceContext(Tracer* tracer, int rank, const char* category) : saved_(CurrentTrace()) {
    CurrentTrace() = TraceContext{tracer, rank, category};
  }
  ~ScopedTraceContext() { CurrentTrace() = saved_; }
  ScopedTraceContext(const ScopedTraceContext&) = delete;
  ScopedTraceContext& operator=(const ScopedTraceContext&) = delete;

 private:
  TraceContext saved_;
};

inline bool Tracing() { return CurrentTrace().tracer != nullptr; }

// Records [begin_s, end_s] on this thread's context, if any.
void RecordEvent(std::string name, TraceStream stream, double begin_s, double end_s,
                 std::vector<std::pair<std::string, double>> args = {});

// Records a completed collective on the comm track, from the times the Work reports (else
// [fallback_begin, fallback_end]).
void RecordWork(std::string name, const comm::Work& work, double fallback_begin_s,
                double fallback_end_s, std::vector<std::pair<std::string, double>> args = {});

// Seconds of a steady-clock time point (the clock of NowSeconds()).
double Seconds(comm::Clock::time_point t);

// A compute-track event for its scope (nothing when not tracing).
class TraceSpan {
 public:
  explicit TraceSpan(std::string_view name);
  ~TraceSpan();
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;
  void Arg(const char* key, double value) {
    if (active_) args_.emplace_back(key, value);
  }

 private:
  bool active_;
  std::string name_;
  double begin_ = 0;
  std::vector<std::pair<std::string, double>> args_;
};

}  // namespace switchyard::parallel::internal
