#include "comm/executor.h"

#include "switchyard/comm/communicator.h"
#include "switchyard/core/error.h"
#include "switchyard/core/thread_pool.h"

namespace switchyard::comm {

Executor::Executor(bool synchronous) : synchronous_(synchronous) {}

Executor::~Executor() { Shutdown(); }

void Executor::Submit(const std::shared_ptr<detail::WorkState>& state,
                      std::shared_ptr<Executor> self) {
  std::unique_lock<std::mutex> sync_lock(sync_mu_, std::defer_lock);
  if (synchronous_) sync_lock.lock();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) {
      std::lock_guard<std::mutex> state_lock(state->mu);
      state->error = detail::WorkState::ErrorKind::kPeer;
      state->error_message = "collective submitted to a communicator that is being destroyed";
      state->done = true;
      state->body = nullptr;
      return;
    }
    state->seq = next_seq_++;
    if (!synchronous_) {
      state->executor = std::move(self);
      queue_.push_back(state);
      if (!thread_.joinable()) {
        thread_ = std::thread([this] { Loop(); });
        SetThreadName(thread_, "sy-progress");
      }
    }
  }
  if (synchronous_) {
    Run(*state);
    return;
  }
  cv_.notify_all();
}

bool Executor::TryRunInline(const std::shared_ptr<detail::WorkState>& state) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (running_ || queue_.empty() || queue_.front() != state) return false;
    queue_.pop_front();
    running_ = true;
  }
  Run(*state);
  bool wake;
  {
    std::lock_guard<std::mutex> lock(mu_);
    running_ = false;
    // Only the worker (if more is queued) or Shutdown (waiting for !running_) care; waking an idle
    // worker for nothing costs a context switch per collective.
    wake = !queue_.empty() || stopping_;
  }
  if (wake) cv_.notify_all();
  return true;
}

void Executor::Run(detail::WorkState& state) {
  using Kind = detail::WorkState::ErrorKind;
  Kind kind = Kind::kNone;
  std::string message;
  const auto started = std::chrono::steady_clock::now();
  try {
    state.body(state.seq);
  } catch (const TimeoutError& e) {
    kind = Kind::kTimeout;
    message = e.what();
  } catch (const PeerError& e) {
    kind = Kind::kPeer;
    message = e.what();
  } catch (const InvalidArgument& e) {
    kind = Kind::kInvalidArgument;
    message = e.what();
  } catch (const IoError& e) {
    kind = Kind::kIo;
    message = e.what();
  } catch (const InternalError& e) {
    kind = Kind::kInternal;
    message = e.what();
  } catch (const std::exception& e) {
    kind = Kind::kOther;
    message = e.what();
  } catch (...) {
    kind = Kind::kOther;
    message = "non-standard exception";
  }
  std::shared_ptr<Executor> keep;  // released outside the lock
  std::function<void(uint64_t)> body;
  {
    std::lock_guard<std::mutex> lock(state.mu);
    state.started = started;
    state.finished = std::chrono::steady_clock::now();
    state.error = kind;
    state.error_message = std::move(message);
    state.done = true;
    keep = std::move(state.executor);
    body = std::move(state.body);
  }
  state.cv.notify_all();
}

void Executor::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || (!running_ && !queue_.empty()); });
    if (stop_) return;
    std::shared_ptr<detail::WorkState> state = std::move(queue_.front());
    queue_.pop_front();
    running_ = true;
    lock.unlock();
    Run(*state);
    state.reset();
    lock.lock();
    running_ = false;
    cv_.notify_all();
  }
}

void Executor::Shutdown() {
  std::deque<std::shared_ptr<detail::WorkState>> abandoned;
  // Synchronous: wait for the collective Submit may be running.
  std::unique_lock<std::mutex> sync_lock(sync_mu_, std::defer_lock);
  if (synchronous_) sync_lock.lock();
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (stop_ && !thread_.joinable()) return;
    // Let a collective running inline on another thread finish first.
    stopping_ = true;
    cv_.wait(lock, [&] { return !running_; });
    stop_ = true;
    abandoned.swap(queue_);
  }
  cv_.notify_all();
  for (auto& state : abandoned) {
    std::shared_ptr<Executor> keep;
    {
      std::lock_guard<std::mutex> lock(state->mu);
      state->error = detail::WorkState::ErrorKind::kPeer;
      state->error_message = "communicator destroyed before this collective started";
      state->done = true;
      state->body = nullptr;
      keep = std::move(state->executor);
    }
    state->cv.notify_all();
    keep.reset();
  }
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

void detail::WorkState::Rethrow() const {
  switch (error) {
    case ErrorKind::kNone: return;
    case ErrorKind::kTimeout: throw TimeoutError(error_message);
    case ErrorKind::kPeer: throw PeerError(error_message);
    case ErrorKind::kInvalidArgument: throw InvalidArgument(error_message);
    case ErrorKind::kIo: throw IoError(error_message);
    case ErrorKind::kInternal: throw InternalError(error_message);
    case ErrorKind::kOther: throw Error(error_message);
  }
}

// ---- Work ----

bool Work::IsCompleted() const {
  if (!state_) return true;
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->done;
}

bool Work::Times(Clock::time_point* started, Clock::time_point* finished) const {
  if (!state_) return false;
  std::lock_guard<std::mutex> lock(state_->mu);
  if (!state_->done || state_->started == Clock::time_point{}) return false;
  *started = state_->started;
  *finished = state_->finished;
  return true;
}

void Work::Wait() const {
  if (!state_) return;
  if (state_->run_on_wait && !state_->claimed.exchange(true)) Executor::Run(*state_);
  std::shared_ptr<Executor> executor;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (!state_->done) executor = state_->executor;
  }
  if (executor) executor->TryRunInline(state_);
  executor.reset();
  // Running on the progress thread: yield for a little while before sleeping (a sleep + wake
  // costs more than most collectives).
  Deadline spin_until = Clock::now() + std::chrono::microseconds(50);
  std::unique_lock<std::mutex> lock(state_->mu);
  while (!state_->done && Clock::now() < spin_until) {
    lock.unlock();
    std::this_thread::yield();
    lock.lock();
  }
  state_->cv.wait(lock, [&] { return state_->done; });
  state_->Rethrow();
}

void Work::Wait(Milliseconds timeout) const {
  if (!state_) return;
  // A point-to-point operation's own deadline bounds it; it runs here.
  if (state_->run_on_wait && !state_->claimed.exchange(true)) Executor::Run(*state_);
  // Never runs the collective inline: that could block past `timeout`.
  Deadline deadline = Clock::now() + timeout;
  std::unique_lock<std::mutex> lock(state_->mu);
  if (!state_->cv.wait_until(lock, deadline, [&] { return state_->done; })) {
    throw TimeoutError(fmt::format("Work::Wait: collective #{} still running after {} ms",
                                   state_->seq, timeout.count()));
  }
  state_->Rethrow();
}

}  // namespace switchyard::comm
