// Fuzzes the .npy parser. Every input must either parse or throw IoError; what parses must give
// the same tensor after a write/parse round trip.
#include <cstdint>
#include <cstring>
#include <span>

#include "switchyard/core/npy.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  switchyard::Tensor t;
  try {
    t = switchyard::ParseNpy(bytes, "fuzz input");
  } catch (const switchyard::IoError&) {
    return 0;
  }
  std::vector<std::byte> written = switchyard::SerializeNpy(t);
  switchyard::Tensor again = switchyard::ParseNpy(written, "round trip");
  if (again.dtype() != t.dtype() || again.shape() != t.shape() ||
      (t.nbytes() > 0 && std::memcmp(again.raw(), t.raw(), t.nbytes()) != 0)) {
    __builtin_trap();
  }
  return 0;
}
