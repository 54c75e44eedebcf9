// Tokenized training data as documents of token ids, whatever the file format (docs/data.md).
//
// A TokenSource is what the sample construction (dataset/samples.h) reads: a number of documents,
// each a run of token ids. The readers of the field's formats (Megatron-LM's indexed dataset,
// nanoGPT's and llm.c's flat token files) implement it over a memory mapping, so opening a file
// of any size costs only its header and index; InMemoryTokenSource holds documents in memory
// (text that a tokenizer encoded, tests).
//
// Token ids are checked against the model's vocabulary (OpenOptions::vocab_size):
//   - at open, cheaply: nothing to check when the file's element type cannot hold an id at or
//     above the vocabulary (uint16 data and a vocabulary >= 65536); otherwise the first and last
//     documents and up to kVocabularyCheckDocuments documents spread over the file are scanned;
//   - lazily, always: every Read() checks the ids it returns.
// Either way an id outside [0, vocab_size) is an InvalidArgument naming the file, the document,
// the position, the id and the vocabulary size. A full scan up front is CheckAllTokens().
//
// Thread-safety: sources are immutable after construction; Read() may be called concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace switchyard::train::dataset {

// File formats of tokenized data. kText is plain text that a tokenizer encodes when the run
// starts (the trainer's corpus loader); the others are token files.
enum class Format { kAuto, kText, kMegatron, kNanoGpt, kLlmc };

// "auto", "text", "megatron", "nanogpt", "llmc".
std::string_view FormatName(Format format);
// The inverse; InvalidArgument naming `flag` and the accepted names otherwise.
Format ParseFormat(std::string_view name, std::string_view flag = "--data-format");

// The format of `path` for kAuto (docs/data.md, "Format detection"):
//   PREFIX, PREFIX.bin or PREFIX.idx where PREFIX.idx exists                        -> kMegatron
//   *.bin whose first int32 is 20240520 (llm.c's magic)                              -> kLlmc
//   any other *.bin                                                                   -> kNanoGpt
//   anything else (a .txt file, a directory of text files)                            -> kText
// A `requested` format other than kAuto is returned as it is.
Format DetectFormat(const std::string& path, Format requested = Format::kAuto);

// Up to this many documents are scanned by the check at open (plus the first and the last).
inline constexpr int64_t kVocabularyCheckDocuments = 64;

struct OpenOptions {
  Format format = Format::kAuto;
  // Ids must be < vocab_size; 0 checks nothing.
  int64_t vocab_size = 0;
  // Flat token files (nanoGPT, llm.c) have no document boundaries of their own: they are cut
  // into pieces of this many tokens, which the sample construction shuffles and splits as
  // documents (the EOT tokens inside the stream stay where they are).
  int64_t flat_document_tokens = 65536;
};

class TokenSource {
 public:
  virtual ~TokenSource() = default;

  // The file (or prefix) for messages.
  virtual const std::string& name() const = 0;
  virtual int64_t num_documents() const = 0;
  // Tokens of document `doc`, 0 <= doc < num_documents().
  virtual int64_t document_length(int64_t doc) const = 0;
  // Copies tokens [offset, offset + out.size()) of document `doc` into `out`, checking each id
  // against the vocabulary (see above). The range must lie inside the document (InternalError).
  virtual void Read(int64_t doc, int64_t offset, std::span<int32_t> out) const = 0;
  // Sum of all document lengths.
  virtual int64_t num_tokens() const = 0;
  // The vocabulary the ids are checked against (0: none).
  virtual int64_t vocab_size() const = 0;

  // The whole document (convenience for tests and small data).
  std::vector<int32_t> Document(int64_t doc) const;
  // Reads every token once, checking the vocabulary (a full scan: seconds per GB).
  void CheckAllTokens() const;
};

// Opens a token file of any format but kText (InvalidArgument for kText: text is tokenized by
// the caller). `path` is a Megatron prefix (or its .bin / .idx) or a flat .bin file. Throws
// IoError / InvalidArgument naming the file and what was expected for every malformed input:
// missing or non-regular files, a wrong magic or version, a truncated file, index entries that
// point past the data, an empty dataset, an id outside the vocabulary.
std::unique_ptr<TokenSource> OpenTokenSource(const std::string& path,
                                             const OpenOptions& options = {});

// Documents held in memory. `name` is used in messages.
class InMemoryTokenSource final : public TokenSource {
 public:
  InMemoryTokenSource(std::string name, std::vector<std::vector<int32_t>> documents,
                      int64_t vocab_size = 0);

  const std::string& name() const override { return name_; }
  int64_t num_documents() const override { return static_cast<int64_t>(documents_.size()); }
  int64_t document_length(int64_t doc) const override;
  void Read(int64_t doc, int64_t offset, std::span<int32_t> out) const override;
  int64_t num_tokens() const override { return num_tokens_; }
  int64_t vocab_size() const override { return vocab_size_; }

 private:
  std::string name_;
  std::vector<std::vector<int32_t>> documents_;
  int64_t vocab_size_;
  int64_t num_tokens_ = 0;
};

namespace detail {
// Throws the vocabulary error for id `id` at (doc, position) of `source`.
[[noreturn]] void ThrowTokenOutOfVocabulary(const std::string& source, int64_t doc,
                                            int64_t position, int64_t id, int64_t vocab_size);
// Checks ids in `tokens` (document `doc`, starting at `offset`) against [0, vocab_size).
void CheckTokenIds(const std::string& source, int64_t doc, int64_t offset,
                   std::span<const int32_t> tokens, int64_t vocab_size);
// The check at open described above, on any source.
void SampledVocabularyCheck(const TokenSource& source);
}  // namespace detail

}  // namespace switchyard::train::dataset
