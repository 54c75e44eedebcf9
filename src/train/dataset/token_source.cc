#include "switchyard/train/dataset/token_source.h"

#include <sys/stat.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <fstream>

#include "switchyard/core/error.h"
#include "switchyard/train/dataset/flat_tokens.h"
#include "switchyard/train/dataset/megatron.h"

namespace switchyard::train::dataset {
namespace {

constexpr std::array<std::pair<Format, std::string_view>, 5> kFormatNames{{
    {Format::kAuto, "auto"},
    {Format::kText, "text"},
    {Format::kMegatron, "megatron"},
    {Format::kNanoGpt, "nanogpt"},
    {Format::kLlmc, "llmc"},
}};

bool IsFile(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && !S_ISDIR(st.st_mode);
}

// The first `n` bytes of `path` ("" when it cannot be read or is shorter). Regular files only:
// reading a FIFO here could block.
std::string Peek(const std::string& path, size_t n) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return "";
  std::ifstream in(path, std::ios::binary);
  std::string bytes(n, '\0');
  if (!in.read(bytes.data(), static_cast<std::streamsize>(n))) return "";
  return bytes;
}

}  // namespace

std::string_view FormatName(Format format) {
  for (const auto& [f, name] : kFormatNames) {
    if (f == format) return name;
  }
  return "unknown";
}

Format ParseFormat(std::string_view name, std::string_view flag) {
  for (const auto& [f, n] : kFormatNames) {
    if (n == name) return f;
  }
  throw InvalidArgument(
      fmt::format("{} '{}': expected one of auto, text, megatron, nanogpt, llmc", flag, name));
}

Format DetectFormat(const std::string& path, Format requested) {
  if (requested != Format::kAuto) return requested;
  // An index next to the path says Megatron even when its magic is damaged: the reader then
  // reports what is wrong with it, rather than the data being read as something else.
  if (IsFile(MegatronPrefix(path) + ".idx")) return Format::kMegatron;
  if (path.ends_with(".bin")) {
    const std::string head = Peek(path, 4);
    int32_t magic = 0;
    if (head.size() == 4) std::memcpy(&magic, head.data(), 4);
    return magic == kLlmcTokenMagic ? Format::kLlmc : Format::kNanoGpt;
  }
  return Format::kText;
}

std::unique_ptr<TokenSource> OpenTokenSource(const std::string& path, const OpenOptions& options) {
  const Format format = DetectFormat(path, options.format);
  switch (format) {
    case Format::kMegatron: return OpenMegatronDataset(MegatronPrefix(path), options);
    case Format::kNanoGpt: return OpenNanoGptTokens(path, options);
    case Format::kLlmc: return OpenLlmcTokens(path, options);
    default:
      throw InvalidArgument(fmt::format(
          "'{}' is text (format {}), not a token file: text is tokenized when the run starts; "
          "expected a Megatron prefix (PREFIX.bin + PREFIX.idx) or a nanoGPT / llm.c .bin file",
          path, FormatName(format)));
  }
}

std::vector<int32_t> TokenSource::Document(int64_t doc) const {
  std::vector<int32_t> out(static_cast<size_t>(document_length(doc)));
  Read(doc, 0, out);
  return out;
}

void TokenSource::CheckAllTokens() const {
  std::vector<int32_t> buffer(1 << 16);
  for (int64_t d = 0; d < num_documents(); ++d) {
    const int64_t n = document_length(d);
    for (int64_t off = 0; off < n; off += static_cast<int64_t>(buffer.size())) {
      const int64_t count = std::min<int64_t>(n - off, static_cast<int64_t>(buffer.size()));
      Read(d, off, std::span<int32_t>(buffer.data(), static_cast<size_t>(count)));
    }
  }
}

InMemoryTokenSource::InMemoryTokenSource(std::string name,
                                         std::vector<std::vector<int32_t>> documents,
                                         int64_t vocab_size)
    : name_(std::move(name)), documents_(std::move(documents)), vocab_size_(vocab_size) {
  for (const auto& d : documents_) num_tokens_ += static_cast<int64_t>(d.size());
  SY_REQUIRE(num_tokens_ > 0, InvalidArgument,
             "{}: empty dataset (no tokens); expected at least one", name_);
}

int64_t InMemoryTokenSource::document_length(int64_t doc) const {
  SY_CHECK(doc >= 0 && doc < num_documents(), "document {} of {}", doc, num_documents());
  return static_cast<int64_t>(documents_[static_cast<size_t>(doc)].size());
}

void InMemoryTokenSource::Read(int64_t doc, int64_t offset, std::span<int32_t> out) const {
  const auto& d = documents_[static_cast<size_t>(doc)];
  SY_CHECK(
      offset >= 0 && offset + static_cast<int64_t>(out.size()) <= static_cast<int64_t>(d.size()),
      "read [{}, +{}) of document {} ({} tokens)", offset, out.size(), doc, d.size());
  std::copy_n(d.begin() + offset, out.size(), out.begin());
  detail::CheckTokenIds(name_, doc, offset, out, vocab_size_);
}

namespace detail {

void ThrowTokenOutOfVocabulary(const std::string& source, int64_t doc, int64_t position, int64_t id,
                               int64_t vocab_size) {
  throw InvalidArgument(fmt::format(
      "{}: token id {} at document {}, position {} is outside the vocabulary: expected ids in "
      "[0, {}) (was the data made with a different tokenizer?)",
      source, id, doc, position, vocab_size));
}

void CheckTokenIds(const std::string& source, int64_t doc, int64_t offset,
                   std::span<const int32_t> tokens, int64_t vocab_size) {
  if (vocab_size <= 0) return;
  const auto limit = static_cast<uint32_t>(std::min<int64_t>(vocab_size, INT32_MAX));
  for (size_t i = 0; i < tokens.size(); ++i) {
    // One unsigned compare catches negative ids too.
    if (static_cast<uint32_t>(tokens[i]) >= limit) [[unlikely]] {
      ThrowTokenOutOfVocabulary(source, doc, offset + static_cast<int64_t>(i), tokens[i],
                                vocab_size);
    }
  }
}

void SampledVocabularyCheck(const TokenSource& source) {
  if (source.vocab_size() <= 0) return;
  const int64_t docs = source.num_documents();
  std::vector<int64_t> picks{0, docs - 1};
  const int64_t stride = std::max<int64_t>(1, docs / kVocabularyCheckDocuments);
  for (int64_t d = stride / 2; d < docs; d += stride) picks.push_back(d);
  std::sort(picks.begin(), picks.end());
  picks.erase(std::unique(picks.begin(), picks.end()), picks.end());
  for (int64_t d : picks) (void)source.Document(d);  // Read() checks the ids
}

}  // namespace detail
}  // namespace switchyard::train::dataset
