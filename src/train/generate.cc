#include "switchyard/train/generate.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "switchyard/core/rng.h"

namespace switchyard::train {

std::string GenerateText(TransformerLm& model, const SampleOptions& o) {
  ForwardOptions fo;
  fo.training = false;
  fo.save_for_backward = false;
  fo.threads = o.threads;
  return GenerateText(
      model.config(),
      [&](const Tensor& tokens) { return model.Forward(tokens, Tensor(), fo).logits; }, o);
}

std::vector<int32_t> GenerateTokens(const ModelConfig& c, const LogitsFunction& logits_of,
                                    const SampleOptions& o, std::vector<int32_t> context) {
  SY_REQUIRE(o.temperature > 0, InvalidArgument, "temperature must be > 0, got {}", o.temperature);
  SY_REQUIRE(o.max_tokens >= 0 && o.top_k >= 0, InvalidArgument,
             "max_tokens ({}) and top_k ({}) must be >= 0", o.max_tokens, o.top_k);
  SY_REQUIRE(!context.empty(), InvalidArgument, "GenerateTokens: the prompt holds no token");
  const int64_t vocab = c.vocab_size;
  for (int32_t id : context) {
    SY_REQUIRE(id >= 0 && id < vocab, InvalidArgument,
               "GenerateTokens: prompt id {} is outside the vocabulary [0, {})", id, vocab);
  }
  CounterRng rng(o.seed, kStreamSample);
  std::vector<int32_t> out;
  std::vector<double> p(static_cast<size_t>(vocab));
  std::vector<int> order(static_cast<size_t>(vocab));
  for (int64_t i = 0; i < o.max_tokens; ++i) {
    int64_t n = std::min<int64_t>(static_cast<int64_t>(context.size()), c.seq_len);
    std::vector<int32_t> window(context.end() - n, context.end());
    Tensor tokens = Tensor::FromVector(window, {1, n});
    Tensor logits = logits_of(tokens);
    ExpectShape("GenerateText logits", logits, {n, vocab});
    const float* last = logits.data<float>() + (n - 1) * vocab;
    double mx = *std::max_element(last, last + vocab);
    for (int64_t v = 0; v < vocab; ++v) p[v] = std::exp((last[v] - mx) / o.temperature);
    if (o.top_k > 0 && o.top_k < vocab) {
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b]; });
      for (size_t r = static_cast<size_t>(o.top_k); r < order.size(); ++r) p[order[r]] = 0;
    }
    double total = std::accumulate(p.begin(), p.end(), 0.0);
    double u = rng.Uniform(static_cast<uint64_t>(i)) * total;
    int chosen = -1, last_possible = 0;
    for (int v = 0; v < vocab && chosen < 0; ++v) {
      if (p[v] <= 0) continue;
      last_possible = v;
      u -= p[v];
      if (u <= 0) chosen = v;
    }
    if (chosen < 0) chosen = last_possible;  // rounding left u slightly above 0
    context.push_back(chosen);
    out.push_back(chosen);
  }
  return out;
}

std::string GenerateText(const ModelConfig& c, const LogitsFunction& logits_of,
                         const SampleOptions& o) {
  SY_REQUIRE(c.vocab_size == 256, InvalidArgument,
             "GenerateText: byte-level models only (vocab_size 256), got {}", c.vocab_size);
  std::vector<int32_t> context;
  for (unsigned char ch : o.prompt.empty() ? std::string("\n") : o.prompt) context.push_back(ch);
  std::string out;
  for (int32_t id : GenerateTokens(c, logits_of, o, std::move(context))) {
    out.push_back(static_cast<char>(id));
  }
  return out;
}

std::string EscapeForTerminal(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  auto escape = [&](unsigned char ch) { out += fmt::format("\\x{:02x}", ch); };
  const size_t n = text.size();
  for (size_t i = 0; i < n;) {
    const auto ch = static_cast<unsigned char>(text[i]);
    if (ch < 0x80) {
      bool control = (ch < 0x20 && ch != '\n' && ch != '\t') || ch == 0x7f;
      if (control) {
        escape(ch);
      } else {
        out += static_cast<char>(ch);
      }
      ++i;
      continue;
    }
    // A well-formed UTF-8 sequence: lead byte, its length, continuation bytes 10xxxxxx, no
    // overlong forms (C0, C1, E0 80..9F, F0 80..8F), no surrogates (ED A0..BF), <= U+10FFFF.
    size_t len = ch >= 0xC2 && ch <= 0xDF   ? 2
                 : ch >= 0xE0 && ch <= 0xEF ? 3
                 : ch >= 0xF0 && ch <= 0xF4 ? 4
                                            : 0;
    bool ok = len > 0 && i + len <= n;
    for (size_t j = 1; ok && j < len; ++j) {
      ok = (static_cast<unsigned char>(text[i + j]) & 0xC0) == 0x80;
    }
    if (ok) {
      const auto second = static_cast<unsigned char>(text[i + 1]);
      if ((ch == 0xE0 && second < 0xA0) || (ch == 0xED && second > 0x9F) ||
          (ch == 0xF0 && second < 0x90) || (ch == 0xF4 && second > 0x8F) ||
          (ch == 0xC2 && second < 0xA0)) {  // C1 controls U+0080..U+009F drive terminals too
        ok = false;
      }
    }
    if (!ok) {
      escape(ch);
      ++i;
      continue;
    }
    out.append(text.substr(i, len));
    i += len;
  }
  return out;
}

}  // namespace switchyard::train
