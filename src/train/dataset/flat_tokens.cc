#include "switchyard/train/dataset/flat_tokens.h"

#include <algorithm>
#include <cstring>

#include "switchyard/core/error.h"
#include "train/dataset/element_reader.h"
#include "train/dataset/mapped_file.h"

namespace switchyard::train::dataset {
namespace {

// A stream of uint16 ids at a byte offset of a mapped file, cut into fixed-size documents.
class FlatSource final : public TokenSource {
 public:
  FlatSource(std::unique_ptr<MappedFile> file, int64_t data_offset, int64_t tokens,
             const OpenOptions& options)
      : file_(std::move(file)),
        data_offset_(data_offset),
        num_tokens_(tokens),
        vocab_size_(options.vocab_size),
        doc_tokens_(options.flat_document_tokens) {
    SY_REQUIRE(doc_tokens_ > 0, InvalidArgument,
               "flat_document_tokens {}: expected a positive number of tokens per document",
               doc_tokens_);
    num_documents_ = (num_tokens_ + doc_tokens_ - 1) / doc_tokens_;
    if (vocab_size_ > 0 && vocab_size_ <= detail::MaxIdOf(MegatronDtype::kUint16)) {
      detail::SampledVocabularyCheck(*this);
    }
  }

  const std::string& name() const override { return file_->path(); }
  int64_t num_documents() const override { return num_documents_; }
  int64_t num_tokens() const override { return num_tokens_; }
  int64_t vocab_size() const override { return vocab_size_; }
  int64_t document_length(int64_t doc) const override {
    SY_CHECK(doc >= 0 && doc < num_documents_, "document {} of {}", doc, num_documents_);
    return std::min(doc_tokens_, num_tokens_ - doc * doc_tokens_);
  }
  void Read(int64_t doc, int64_t offset, std::span<int32_t> out) const override {
    SY_CHECK(offset >= 0 && offset + static_cast<int64_t>(out.size()) <= document_length(doc),
             "read [{}, +{}) of document {}", offset, out.size(), doc);
    const int64_t first = doc * doc_tokens_ + offset;
    detail::ConvertElements(MegatronDtype::kUint16,
                            file_->bytes().data() + data_offset_ + 2 * first, out);
    detail::CheckTokenIds(name(), doc, offset, out, vocab_size_);
  }

 private:
  std::unique_ptr<MappedFile> file_;
  int64_t data_offset_;
  int64_t num_tokens_;
  int64_t vocab_size_;
  int64_t doc_tokens_;
  int64_t num_documents_ = 0;
};

}  // namespace

std::unique_ptr<TokenSource> OpenNanoGptTokens(const std::string& path,
                                               const OpenOptions& options) {
  auto file = std::make_unique<MappedFile>(path);
  const uint64_t size = file->size();
  SY_REQUIRE(size > 0, InvalidArgument,
             "{}: empty dataset (0 bytes); expected nanoGPT uint16 token ids", path);
  SY_REQUIRE(size % 2 == 0, InvalidArgument,
             "{}: {} bytes, an odd number: expected nanoGPT uint16 token ids, 2 bytes each "
             "(truncated?)",
             path, size);
  return std::make_unique<FlatSource>(std::move(file), 0, static_cast<int64_t>(size / 2), options);
}

std::unique_ptr<TokenSource> OpenLlmcTokens(const std::string& path, const OpenOptions& options) {
  auto file = std::make_unique<MappedFile>(path);
  const uint64_t size = file->size();
  constexpr uint64_t kHeaderBytes = kLlmcHeaderInts * 4;
  SY_REQUIRE(size >= kHeaderBytes, InvalidArgument,
             "{}: {} bytes, shorter than llm.c's {}-byte header (256 int32; truncated?)", path,
             size, kHeaderBytes);
  int32_t header[3];
  std::memcpy(header, file->bytes().data(), sizeof(header));
  SY_REQUIRE(header[0] == kLlmcTokenMagic, InvalidArgument,
             "{}: magic {}; expected llm.c's token file magic {} in the first int32", path,
             header[0], kLlmcTokenMagic);
  SY_REQUIRE(header[1] == kLlmcTokenVersion, InvalidArgument,
             "{}: llm.c token file version {}; expected {} (uint16 tokens)", path, header[1],
             kLlmcTokenVersion);
  const int64_t tokens = header[2];
  SY_REQUIRE(tokens > 0, InvalidArgument,
             "{}: empty dataset (the header's token count is {}); expected at least one token",
             path, tokens);
  const uint64_t expected = kHeaderBytes + 2 * static_cast<uint64_t>(tokens);
  SY_REQUIRE(size == expected, InvalidArgument,
             "{}: {} bytes, but the header's {} tokens need {} ({})", path, size, tokens, expected,
             size < expected ? "truncated" : "trailing bytes after the tokens");
  return std::make_unique<FlatSource>(std::move(file), kHeaderBytes, tokens, options);
}

}  // namespace switchyard::train::dataset
