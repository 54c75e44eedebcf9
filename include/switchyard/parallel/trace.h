// A timeline of what the parallel MoE layer did on each rank, written as a Chrome trace-event file
// (opens in Perfetto or chrome://tracing): one track per rank and stream, "compute" (gate,
// encode, each chunk's experts, decode, ...) and "comm" (each collective, with its bytes).
//
// Times are steady-clock seconds, which are comparable between the processes of one machine (MPI
// ranks), so the events of several processes merge into one timeline. Recording costs one mutex
// acquisition per event; with no tracer set the layer records nothing (one null check).
//
// Thread-safety: Add, Merge and the readers may be called from any thread.
#pragma once

#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace switchyard::parallel {

enum class TraceStream : int { kCompute = 0, kComm = 1 };
// "compute", "comm".
std::string_view TraceStreamName(TraceStream stream);

struct TraceEvent {
  std::string name;      // e.g. "experts c1", "dispatch c2", "allreduce"
  std::string category;  // "forward", "backward", "sync"
  int rank = 0;          // world rank
  TraceStream stream = TraceStream::kCompute;
  double begin_s = 0;  // steady clock, seconds
  double end_s = 0;
  std::vector<std::pair<std::string, double>> args;  // e.g. {"bytes", 65536}, {"chunk", 1}
};

class Tracer {
 public:
  void Add(TraceEvent event);
  std::vector<TraceEvent> Events() const;
  size_t size() const;

  // The Chrome trace-event JSON document: {"traceEvents": [...], "displayTimeUnit": "ms"} with
  // one complete event ("ph": "X", ts/dur in microseconds from the earliest event) per event,
  // pid 0, tid = 2 * rank + stream, and thread_name / thread_sort_index metadata naming each
  // track "rank R compute" / "rank R comm".
  std::string ToJson() const;
  // Writes ToJson() to `path` (IoError naming the path on failure).
  void WriteJson(const std::string& path) const;

  // A compact text form of the events (for sending them to another process) and its inverse,
  // which appends the events it holds (InvalidArgument on malformed text).
  std::string Serialize() const;
  void Merge(std::string_view serialized);

 private:
  mutable std::mutex mu_;
  std::vector<TraceEvent> events_;
};

}  // namespace switchyard::parallel
