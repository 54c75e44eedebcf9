// Per-thread scratch memory of the algorithms (see Scratch in algorithms.h).
#include <memory>

#include "comm/algorithms.h"
#include "switchyard/core/error.h"

namespace switchyard::comm {

std::byte* Scratch(int slot, size_t bytes) {
  struct Buffer {
    std::unique_ptr<std::byte[]> data;
    size_t size = 0;
  };
  thread_local Buffer buffers[kScratchSlots];
  SY_CHECK(slot >= 0 && slot < kScratchSlots, "scratch slot {}", slot);
  Buffer& b = buffers[slot];
  if (b.size < bytes) {
    size_t grown = std::max(bytes, b.size + b.size / 2);
    b.data.reset(new std::byte[grown]);  // default-initialized: no zero fill
    b.size = grown;
  }
  return b.data.get();
}

}  // namespace switchyard::comm
