// Bytes of tensor storage held, counted per account. A thread that sets an account (for a
// scope: ScopedMemoryAccount) charges it every Tensor allocation it makes (Empty, Zeros, Full,
// Clone, To, ...) until that storage is freed, by whichever thread frees it. A rank of a run sets
// its own account on its thread, so the account's peak is the most tensor memory the rank held at
// once: parameters, gradients, optimizer state, activations, communication buffers made as
// Tensors. Not counted: storage wrapped with Tensor::FromBlob, std::vector scratch, tensors
// allocated on other threads (worker pools). For a given run and thread count the count is
// deterministic.
//
// Thread-safety: an account may be charged and released from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

namespace switchyard {

class MemoryAccount {
 public:
  int64_t live_bytes() const { return live_.load(std::memory_order_relaxed); }
  int64_t peak_bytes() const { return peak_.load(std::memory_order_relaxed); }
  // Starts a new peak from what is held now.
  void ResetPeak() { peak_.store(live_bytes(), std::memory_order_relaxed); }

  void Charge(int64_t bytes);
  void Release(int64_t bytes) { live_.fetch_sub(bytes, std::memory_order_relaxed); }

 private:
  std::atomic<int64_t> live_{0};
  std::atomic<int64_t> peak_{0};
};

// This thread's account; null when none is set.
const std::shared_ptr<MemoryAccount>& CurrentMemoryAccount();

// Sets `account` (may be null) as this thread's account until the end of the scope, then restores
// the previous one.
class ScopedMemoryAccount {
 public:
  explicit ScopedMemoryAccount(std::shared_ptr<MemoryAccount> account);
  ~ScopedMemoryAccount();
  ScopedMemoryAccount(const ScopedMemoryAccount&) = delete;
  ScopedMemoryAccount& operator=(const ScopedMemoryAccount&) = delete;

 private:
  std::shared_ptr<MemoryAccount> previous_;
};

}  // namespace switchyard
