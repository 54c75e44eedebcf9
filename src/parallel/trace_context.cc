#include "parallel/trace_context.h"

#include "parallel/collectives.h"

namespace switchyard::parallel::internal {

TraceContext& CurrentTrace() {
  thread_local TraceContext context;
  return context;
}

double Seconds(comm::Clock::time_point t) {
  return std::chrono::duration<double>(t.time_since_epoch()).count();
}

void RecordEvent(std::string name, TraceStream stream, double begin_s, double end_s,
                 std::vector<std::pair<std::string, double>> args) {
  const TraceContext& c = CurrentTrace();
  if (c.tracer == nullptr) return;
  c.tracer->Add(
      TraceEvent{std::move(name), c.category, c.rank, stream, begin_s, end_s, std::move(args)});
}

void RecordWork(std::string name, const comm::Work& work, double fallback_begin_s,
                double fallback_end_s, std::vector<std::pair<std::string, double>> args) {
  if (!Tracing()) return;
  comm::Clock::time_point started, finished;
  if (work.Times(&started, &finished)) {
    fallback_begin_s = Seconds(started);
    fallback_end_s = Seconds(finished);
  }
  RecordEvent(std::move(name), TraceStream::kComm, fallback_begin_s, fallback_end_s,
              std::move(args));
}

TraceSpan::TraceSpan(std::string_view name) : active_(Tracing()) {
  if (!active_) return;
  name_ = name;
  begin_ = NowSeconds();
}

TraceSpan::~TraceSpan() {
  if (active_)
    RecordEvent(std::move(name_), TraceStream::kCompute, begin_, NowSeconds(), std::move(args_));
}

}  // namespace switchyard::parallel::internal
