// Fuzzes the Megatron index (.idx) reader against a fixed .bin of 64 uint16 ids (0..63). Every
// input must either be refused with switchyard::Error or give a dataset whose every token reads
// back inside the .bin (so in 0..63, checked through a vocabulary of 64) — no crash, no read out
// of bounds (AddressSanitizer), no hang. The files live in a temporary directory of this process.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "switchyard/core/error.h"
#include "switchyard/train/dataset/token_source.h"

namespace {

// The temporary directory with d.bin (and d.idx, rewritten per input); removed at exit.
struct Files {
  std::string dir, prefix;
  Files() {
    char name[] = "/tmp/sy_fuzz_megatron_XXXXXX";
    if (::mkdtemp(name) == nullptr) std::abort();
    dir = name;
    prefix = dir + "/d";
    FILE* bin = std::fopen((prefix + ".bin").c_str(), "wb");
    for (uint16_t i = 0; i < 64; ++i) std::fwrite(&i, sizeof(i), 1, bin);
    std::fclose(bin);
  }
  ~Files() {
    std::remove((prefix + ".bin").c_str());
    std::remove((prefix + ".idx").c_str());
    ::rmdir(dir.c_str());
  }
};

const std::string& Prefix() {
  static const Files files;
  return files.prefix;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& prefix = Prefix();
  FILE* idx = std::fopen((prefix + ".idx").c_str(), "wb");
  if (size > 0) std::fwrite(data, 1, size, idx);
  std::fclose(idx);
  namespace ds = switchyard::train::dataset;
  try {
    const auto source =
        ds::OpenTokenSource(prefix, {.format = ds::Format::kMegatron, .vocab_size = 64});
    source->CheckAllTokens();
  } catch (const switchyard::Error&) {
  }
  return 0;
}
