// Fuzzes the numeric keys of layer.json (moe::LayerConfigFromJson) with values where number
// parsing and float-to-integer conversions break: huge, tiny, negative, fractional where an
// integer is expected, beyond int64 / uint64 / float range, -0, exponents that overflow to
// infinity. The input bytes choose keys and values (structure-aware, so every run reaches the
// number handling instead of the JSON syntax errors layer_config_fuzzer mostly finds). Every
// input must give a valid LayerConfig or throw InvalidArgument; any other exception, a crash or
// a sanitizer report (UBSan: float-cast-overflow) is a bug. An accepted config must survive
// ToJson and parse back to the same configuration.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "switchyard/core/error.h"
#include "switchyard/moe/config.h"

namespace {

constexpr const char* kNumericKeys[] = {"model_dim",
                                        "hidden_dim",
                                        "num_experts",
                                        "top_k",
                                        "noise_std",
                                        "jitter_eps",
                                        "expert_bias_update_rate",
                                        "capacity_factor",
                                        "min_capacity",
                                        "alignment",
                                        "capacity",
                                        "aux_loss_coef",
                                        "z_loss_coef",
                                        "shared_expert_hidden",
                                        "num_groups",
                                        "group_topk",
                                        "topk_scaling_factor",
                                        "sequence_length",
                                        "seed"};

// Value texts as they may appear in a file (nlohmann parses each; some overflow on the way).
constexpr const char* kEdgeValues[] = {"0",
                                       "-0",
                                       "1",
                                       "-1",
                                       "2",
                                       "0.5",
                                       "1.0",
                                       "-0.0",
                                       "1e30",
                                       "-1e30",
                                       "3e18",
                                       "9.2e18",
                                       "9223372036854775807",
                                       "9223372036854775808",
                                       "-9223372036854775808",
                                       "-9223372036854775809",
                                       "18446744073709551615",
                                       "18446744073709551616",
                                       "1e308",
                                       "-1e308",
                                       "1e400",
                                       "-1e400",
                                       "4.9e-324",
                                       "1e-45",
                                       "3.4028235e38",
                                       "3.5e38",
                                       "-3.5e38",
                                       "9007199254740993",
                                       "2147483648",
                                       "-2147483649",
                                       "1e-400",
                                       "65536",
                                       "1099511627776",
                                       "null",
                                       "true",
                                       "\"8\""};

class Bytes {
 public:
  Bytes(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  bool empty() const { return pos_ >= size_; }
  uint8_t Byte() { return pos_ < size_ ? data_[pos_++] : 0; }
  template <typename T>
  T Raw() {
    T v{};
    uint8_t buf[sizeof(T)] = {};
    for (uint8_t& b : buf) b = Byte();
    std::memcpy(&v, buf, sizeof(T));
    return v;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

std::string ValueText(Bytes& in) {
  const uint8_t kind = in.Byte() % 4;
  if (kind == 0 || kind == 1) {
    return kEdgeValues[in.Byte() % (sizeof(kEdgeValues) / sizeof(kEdgeValues[0]))];
  }
  if (kind == 2) return std::to_string(in.Raw<int64_t>());
  const double d = in.Raw<double>();
  if (d != d || d - d != 0) return "1e999";  // nan / inf have no JSON form: an overflow instead
  char text[64];
  std::snprintf(text, sizeof(text), "%.17g", d);
  return text;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Bytes in(data, size);
  // A valid base the fuzzed keys override (a later duplicate key overrides an earlier one in
  // nlohmann's parser; the base keys come first).
  std::string json = R"({"model_dim": 8, "hidden_dim": 16, "num_experts": 4)";
  const uint8_t preset = in.Byte() % 3;
  if (preset == 1) json += R"(, "preset": "deepspeed")";
  for (int i = 0; i < 6 && !in.empty(); ++i) {
    const char* key = kNumericKeys[in.Byte() % (sizeof(kNumericKeys) / sizeof(kNumericKeys[0]))];
    json += std::string(", \"") + key + "\": " + ValueText(in);
  }
  json += "}";
  switchyard::moe::LayerConfig config;
  try {
    config = switchyard::moe::LayerConfigFromJson(json);
  } catch (const switchyard::InvalidArgument&) {
    return 0;
  }
  const std::string text = switchyard::moe::ToJson(config);
  switchyard::moe::LayerConfig again = switchyard::moe::LayerConfigFromJson(text);
  if (switchyard::moe::ToJson(again) != text) __builtin_trap();
  return 0;
}
