// Loss figures that compare across tokenizers (docs/data.md, "Metrics").
//
// A per-token loss depends on the tokenizer: a model that predicts 4-byte tokens has a larger
// loss per token than one predicting bytes, for the same text and the same quality. Bits per
// byte divide the loss by the text it covers:
//   bits_per_byte = loss_nats_per_token / (ln 2 * bytes_per_token)
// where bytes_per_token is the evaluated text's UTF-8 bytes over its tokens (1 for the byte
// tokenizer, about 3.5-4.5 for a SentencePiece model of 8-32k pieces on English text).
#pragma once

#include <cstdint>
#include <span>

#include "switchyard/train/dataset/tokenizer.h"

namespace switchyard::train::dataset {

// exp(loss); the loss is the mean cross-entropy in nats per token.
double Perplexity(double loss_nats_per_token);
// The formula above. InvalidArgument when bytes_per_token is not positive and finite.
double BitsPerByte(double loss_nats_per_token, double bytes_per_token);
// Bytes per token of `ids`: the length of their decoded text over their count (InvalidArgument
// for an empty span). Over a whole evaluation set, pass all of it (or sum the two counts): a
// ratio of sums, not a mean of ratios.
double BytesPerToken(const Tokenizer& tokenizer, std::span<const int32_t> ids);

}  // namespace switchyard::train::dataset
