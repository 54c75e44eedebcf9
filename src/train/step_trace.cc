#include "train/step_trace.h"

#include <chrono>
#include <filesystem>
#include <utility>

#include "switchyard/core/clock.h"
#include "switchyard/core/file_util.h"

namespace switchyard::train::internal {

StepTrace::StepTrace(comm::Communicator& world, int64_t step, std::string path)
    : world_(world), step_(step), path_(std::move(path)) {}

void StepTrace::Begin(int64_t step) {
  if (step != step_) return;
  active_ = true;
  step_begin_s_ = NowSeconds();
  for (parallel::ParallelMoeLayer* layer : layers_) layer->set_tracer(&tracer_);
}

void StepTrace::Add(const char* name, const char* category, parallel::TraceStream stream,
                    double begin_s, double end_s) {
  if (!active_) return;
  parallel::TraceEvent e;
  e.name = name;
  e.category = category;
  e.rank = world_.rank();
  e.stream = stream;
  e.begin_s = begin_s;
  e.end_s = end_s;
  tracer_.Add(std::move(e));
}

void StepTrace::End(int64_t step) {
  if (step != step_ || !active_) return;
  active_ = false;
  for (parallel::ParallelMoeLayer* layer : layers_) layer->set_tracer(nullptr);
  // Every rank's events to every rank (one broadcast per rank: a single step's events are small),
  // as int32 words after the exact byte count.
  parallel::Tracer all;
  for (int r = 0; r < world_.size(); ++r) {
    std::string text;
    if (r == world_.rank()) text = tracer_.Serialize();
    int64_t size[1] = {static_cast<int64_t>(text.size())};
    world_.Broadcast(size, 1, DType::kInt64, {.root = r}).Wait();
    const size_t words = (static_cast<size_t>(size[0]) + 3) / 4;
    text.resize(words * 4);
    world_.Broadcast(text.data(), words, DType::kInt32, {.root = r}).Wait();
    text.resize(static_cast<size_t>(size[0]));
    if (world_.rank() == 0) all.Merge(text);
  }
  if (world_.rank() == 0) {
    const std::filesystem::path dir = std::filesystem::path(path_).parent_path();
    if (!dir.empty()) std::filesystem::create_directories(dir);
    WriteTextFileAtomic(path_, all.ToJson());
  }
}

StepTrace::Span::Span(StepTrace* trace, const char* name, const char* category,
                      parallel::TraceStream stream)
    : trace_(trace != nullptr && trace->active() ? trace : nullptr),
      name_(name),
      category_(category),
      stream_(stream),
      begin_s_(trace_ != nullptr ? NowSeconds() : 0) {}

StepTrace::Span::~Span() {
  if (trace_ != nullptr) trace_->Add(name_, category_, stream_, begin_s_, NowSeconds());
}

}  // namespace switchyard::train::internal
