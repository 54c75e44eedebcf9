// Text sampling from a byte-level model: autoregressive, temperature and optional top-k,
// deterministic for a seed (draw i uses CounterRng(seed, kStreamSample) at index i).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "switchyard/train/model.h"

namespace switchyard::train {

// The CounterRng stream of sampling (core/rng.h's streams stop at kStreamData = 64).
inline constexpr uint64_t kStreamSample = 65;

struct SampleOptions {
  std::string prompt;        // bytes to continue; empty: start after a newline
  int64_t max_tokens = 300;  // tokens to generate
  float temperature = 0.8f;  // > 0; softmax(logits / temperature)
  int64_t top_k = 0;         // > 0: sample among the k most likely tokens only
  uint64_t seed = 0;
  int threads = 1;
};

// The generated continuation (without the prompt). The context is the last seq_len tokens.
// Throws InvalidArgument for temperature <= 0, a model whose vocab is not bytes (256), or
// negative sizes.
std::string GenerateText(TransformerLm& model, const SampleOptions& options);
// The same over any way of computing the logits (a pipelined model): `logits` maps tokens
// int32 [1, n] to float32 [n, vocab_size] for the model of `config`.
using LogitsFunction = std::function<Tensor(const Tensor& tokens)>;
std::string GenerateText(const ModelConfig& config, const LogitsFunction& logits,
                         const SampleOptions& options);

// The ids a model of any vocabulary generates after the ids `prompt` (not empty, each in
// [0, vocab_size)), drawn as GenerateText draws bytes; a tokenizer decodes them (the trainer's
// samples with a SentencePiece tokenizer).
std::vector<int32_t> GenerateTokens(const ModelConfig& config, const LogitsFunction& logits,
                                    const SampleOptions& options, std::vector<int32_t> prompt);

// `text` made safe to print on a terminal: newlines, tabs and well-formed UTF-8 are kept; every
// other byte (control bytes, C1 controls, bytes of malformed or overlong UTF-8 sequences) becomes
// "\xNN". A byte-level model emits any byte, and raw ones would drive the terminal.
std::string EscapeForTerminal(std::string_view text);

}  // namespace switchyard::train
