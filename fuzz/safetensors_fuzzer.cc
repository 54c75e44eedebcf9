// Fuzzes the safetensors parser. Every input must either parse or throw IoError: any other
// exception, crash or sanitizer report is a bug. What parses must survive a round trip: written
// back and parsed again, it gives the same tensors.
#include <cstdint>
#include <cstring>
#include <span>

#include "switchyard/core/safetensors.h"

namespace {

bool Same(const switchyard::Tensor& a, const switchyard::Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() && a.nbytes() == b.nbytes() &&
         (a.nbytes() == 0 || std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  switchyard::TensorMap tensors;
  try {
    tensors = switchyard::ParseSafetensors(bytes, "fuzz input");
  } catch (const switchyard::IoError&) {
    return 0;
  }
  std::vector<std::byte> written = switchyard::SerializeSafetensors(tensors);
  switchyard::TensorMap again = switchyard::ParseSafetensors(written, "round trip");
  if (again.size() != tensors.size()) __builtin_trap();
  for (const auto& [name, t] : tensors) {
    auto it = again.find(name);
    if (it == again.end() || !Same(it->second, t)) __builtin_trap();
  }
  // Writing is canonical: a second round trip gives the same bytes.
  if (switchyard::SerializeSafetensors(again) != written) __builtin_trap();
  return 0;
}
