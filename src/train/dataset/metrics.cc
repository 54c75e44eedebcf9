#include "switchyard/train/dataset/metrics.h"

#include <cmath>
#include <numbers>

#include "switchyard/core/error.h"

namespace switchyard::train::dataset {

double Perplexity(double loss_nats_per_token) { return std::exp(loss_nats_per_token); }

double BitsPerByte(double loss_nats_per_token, double bytes_per_token) {
  SY_REQUIRE(std::isfinite(bytes_per_token) && bytes_per_token > 0, InvalidArgument,
             "bits per byte: bytes per token {}: expected a positive number", bytes_per_token);
  return loss_nats_per_token / (std::numbers::ln2 * bytes_per_token);
}

double BytesPerToken(const Tokenizer& tokenizer, std::span<const int32_t> ids) {
  SY_REQUIRE(!ids.empty(), InvalidArgument, "bytes per token: expected at least one token");
  return static_cast<double>(tokenizer.Decode(ids).size()) / static_cast<double>(ids.size());
}

}  // namespace switchyard::train::dataset
