// Deferred weight gradients (train/weight_grad.h).
#include "switchyard/train/weight_grad.h"

#include <utility>

namespace switchyard::train {

namespace {
thread_local WeightGradQueue* current_queue = nullptr;
}  // namespace

void WeightGradQueue::Run() {
  std::vector<std::function<void()>> work = std::move(work_);
  work_.clear();
  for (auto& w : work) w();
}

DeferWeightGrads::DeferWeightGrads(WeightGradQueue& queue) : previous_(current_queue) {
  current_queue = &queue;
}

DeferWeightGrads::~DeferWeightGrads() { current_queue = previous_; }

void RunOrDeferWeightGrad(std::function<void()> work) {
  if (current_queue == nullptr) {
    work();
    return;
  }
  current_queue->work_.push_back(std::move(work));
}

bool DeferringWeightGrads() { return current_queue != nullptr; }

}  // namespace switchyard::train
