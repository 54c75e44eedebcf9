// Fuzzes the layer.json reader. Every input must either give a valid LayerConfig or throw
// InvalidArgument (a one-line error for the user); an InternalError, any other exception, a crash
// or a sanitizer report is a bug. A config that was accepted must survive ToJson and parse back
// to the same configuration.
#include <cstdint>
#include <string_view>

#include "switchyard/core/error.h"
#include "switchyard/moe/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  switchyard::moe::LayerConfig config;
  try {
    config = switchyard::moe::LayerConfigFromJson(text);
  } catch (const switchyard::InvalidArgument&) {
    return 0;
  }
  std::string json = switchyard::moe::ToJson(config);
  switchyard::moe::LayerConfig again = switchyard::moe::LayerConfigFromJson(json);
  if (switchyard::moe::ToJson(again) != json) __builtin_trap();
  return 0;
}
