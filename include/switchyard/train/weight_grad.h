// Deferred weight gradients, for zero-bubble pipeline schedules (docs/pipeline.md).
//
// A zero-bubble schedule splits a chunk's backward into B (the input gradient, which the previous
// stage waits for) and W (the weight gradients, which nobody waits for and which fill the
// schedule's bubbles). A layer's backward computes both; inside a DeferWeightGrads scope on the
// calling thread it computes the input gradient now and queues the weight-gradient work, which
// WeightGradQueue::Run performs later (the schedule's W). Outside a scope the work runs at once.
//
// What is deferred: the weight (and bias) gradients of the dense linear layers (Linear, and
// through it the tensor-parallel layers without comm-GEMM overlap) and of the output head. The
// rest (norms, embeddings, experts, the overlapped rings) computes its weight gradients in B.
//
// Thread-safety: a scope applies to the thread that opened it; a queue is used by one thread.
#pragma once

#include <functional>
#include <vector>

namespace switchyard::train {

class WeightGradQueue {
 public:
  // Runs the queued work in the order it was queued, then empties the queue.
  void Run();
  bool empty() const { return work_.empty(); }
  size_t size() const { return work_.size(); }

 private:
  friend void RunOrDeferWeightGrad(std::function<void()> work);
  std::vector<std::function<void()>> work_;
};

// While alive, RunOrDeferWeightGrad on this thread queues into `queue` (scopes nest: the inner
// one wins until it ends).
class DeferWeightGrads {
 public:
  explicit DeferWeightGrads(WeightGradQueue& queue);
  ~DeferWeightGrads();
  DeferWeightGrads(const DeferWeightGrads&) = delete;
  DeferWeightGrads& operator=(const DeferWeightGrads&) = delete;

 private:
  WeightGradQueue* previous_;
};

// Runs `work` now, or queues it when a DeferWeightGrads scope is open on this thread. The work
// must own (or share) every buffer it reads: the caller may change its own after returning.
void RunOrDeferWeightGrad(std::function<void()> work);

// True inside a DeferWeightGrads scope on this thread (a caller that must copy a buffer it will
// change before the work runs asks first).
bool DeferringWeightGrads();

}  // namespace switchyard::train
