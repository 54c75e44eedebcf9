// The progress thread of a communicator: runs its collectives one after another, in the order
// they were submitted, while the submitting thread goes on computing.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace switchyard::comm {

class Executor;

namespace detail {
// State shared by a Work handle and the executor that runs it.
struct WorkState {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;                       // guarded by mu
  uint64_t seq = 0;                        // position in the communicator's order, set by Submit
  std::function<void(uint64_t seq)> body;  // released once run
  // Point-to-point operations are in no queue: the first Wait runs the body (a wait for the
  // transport's request) on the calling thread.
  bool run_on_wait = false;
  std::atomic<bool> claimed{false};
  std::shared_ptr<Executor> executor;  // while queued: lets Wait() run it inline
  // When the body started and finished running (set by Run; read after done, under mu).
  std::chrono::steady_clock::time_point started{}, finished{};
  // The error as its type and message (guarded by mu, set before done). Each Wait() throws a
  // fresh exception, so an exception object is never shared between threads.
  enum class ErrorKind : uint8_t {
    kNone,
    kTimeout,
    kPeer,
    kInvalidArgument,
    kIo,
    kInternal,
    kOther
  };
  ErrorKind error = ErrorKind::kNone;
  std::string error_message;

  // Throws the stored error, if any.
  void Rethrow() const;
};
}  // namespace detail

// The thread starts with the first queued collective, so a communicator that is never used costs
// none. A synchronous executor (for groups of one rank, whose collectives never wait for a peer)
// has no thread at all: Submit runs each collective on the calling thread before it returns.
class Executor {
 public:
  explicit Executor(bool synchronous = false);
  ~Executor();  // Shutdown()
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Queues `state` (its body must be set) and assigns its sequence number.
  void Submit(const std::shared_ptr<detail::WorkState>& state, std::shared_ptr<Executor> self);
  // Runs `state` on the calling thread if it is next in line and nothing is running.
  bool TryRunInline(const std::shared_ptr<detail::WorkState>& state);
  // Fails what has not started ("communicator destroyed"), waits for the running collective,
  // stops the thread. Idempotent.
  void Shutdown();

  // Runs `state`'s body and completes it.
  static void Run(detail::WorkState& state);

 private:
  void Loop();

  const bool synchronous_;
  std::mutex sync_mu_;  // synchronous: serializes the collectives run by Submit
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<detail::WorkState>> queue_;
  uint64_t next_seq_ = 0;
  bool running_ = false;
  bool stopping_ = false;  // Shutdown is waiting for the running collective
  bool stop_ = false;
  std::thread thread_;  // guarded by mu_; started by the first Submit
};

}  // namespace switchyard::comm
