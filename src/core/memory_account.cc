#include "switchyard/core/memory_account.h"

#include <utility>

namespace switchyard {
namespace {

std::shared_ptr<MemoryAccount>& ThreadAccount() {
  thread_local std::shared_ptr<MemoryAccount> account;
  return account;
}

}  // namespace

void MemoryAccount::Charge(int64_t bytes) {
  const int64_t now = live_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  int64_t peak = peak_.load(std::memory_order_relaxed);
  while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

const std::shared_ptr<MemoryAccount>& CurrentMemoryAccount() { return ThreadAccount(); }

ScopedMemoryAccount::ScopedMemoryAccount(std::shared_ptr<MemoryAccount> account)
    : previous_(std::exchange(ThreadAccount(), std::move(account))) {}

ScopedMemoryAccount::~ScopedMemoryAccount() { ThreadAccount() = std::move(previous_); }

}  // namespace switchyard
