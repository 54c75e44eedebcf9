// Fuzzes the layer.json reader (LayerFileFromJson: the layer's keys plus the calls' "training").
// Every input must either give a valid LayerConfig or throw InvalidArgument (a one-line error for
// the user); an InternalError, any other exception, a crash or a sanitizer report is a bug. A file
// that was accepted must survive ToJson and parse back to the same configuration and mode.
#include <cstdint>
#include <string_view>

#include "switchyard/core/error.h"
#include "switchyard/moe/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  switchyard::moe::LayerFile file;
  try {
    file = switchyard::moe::LayerFileFromJson(text);
  } catch (const switchyard::InvalidArgument&) {
    return 0;
  }
  std::string json = switchyard::moe::ToJson(file.config, file.training);
  switchyard::moe::LayerFile again = switchyard::moe::LayerFileFromJson(json);
  if (again.training != file.training) __builtin_trap();
  if (switchyard::moe::ToJson(again.config, again.training) != json) __builtin_trap();
  return 0;
}
