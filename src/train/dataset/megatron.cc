#include "switchyard/train/dataset/megatron.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "switchyard/core/error.h"
#include "train/dataset/element_reader.h"
#include "train/dataset/mapped_file.h"

namespace switchyard::train::dataset {
namespace {

template <typename T>
T Load(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <typename T>
void AppendBytes(std::vector<std::byte>& out, const T& v) {
  const auto* p = reinterpret_cast<const std::byte*>(&v);
  out.insert(out.end(), p, p + sizeof(T));
}

class MegatronSource final : public TokenSource {
 public:
  MegatronSource(const std::string& prefix, const OpenOptions& options)
      : name_(prefix + ".bin"),
        idx_(prefix + ".idx"),
        bin_(prefix + ".bin"),
        vocab_size_(options.vocab_size) {
    ParseIndex();
    CheckSequences();
    // Unsigned elements that cannot reach the vocabulary's size cannot hold a bad id.
    const bool is_unsigned = dtype_ == MegatronDtype::kUint8 || dtype_ == MegatronDtype::kUint16;
    if (!(is_unsigned && vocab_size_ > detail::MaxIdOf(dtype_))) {
      detail::SampledVocabularyCheck(*this);
    }
  }

  const std::string& name() const override { return name_; }
  int64_t num_documents() const override { return num_documents_; }
  int64_t num_tokens() const override { return num_tokens_; }
  int64_t vocab_size() const override { return vocab_size_; }

  int64_t document_length(int64_t doc) const override {
    SY_CHECK(doc >= 0 && doc < num_documents_, "document {} of {}", doc, num_documents_);
    if (!doc_token_start_.empty()) {
      return doc_token_start_[static_cast<size_t>(doc + 1)] -
             doc_token_start_[static_cast<size_t>(doc)];
    }
    return Length(DocumentIndex(doc));  // one sequence per document
  }

  void Read(int64_t doc, int64_t offset, std::span<int32_t> out) const override {
    const int64_t n = static_cast<int64_t>(out.size());
    SY_CHECK(offset >= 0 && offset + n <= document_length(doc),
             "read [{}, +{}) of document {} ({} tokens)", offset, n, doc, document_length(doc));
    int64_t done = 0;
    int64_t skip = offset;
    for (int64_t s = DocumentIndex(doc); done < n; ++s) {
      const int64_t len = Length(s);
      if (skip >= len) {
        skip -= len;
        continue;
      }
      const int64_t take = std::min(len - skip, n - done);
      const std::byte* src = bin_.bytes().data() + Pointer(s) + skip * element_size_;
      auto part = out.subspan(static_cast<size_t>(done), static_cast<size_t>(take));
      const int64_t wide = detail::ConvertElements(dtype_, src, part);
      if (wide >= 0) {
        int64_t id = 0;
        std::memcpy(&id, src + wide * element_size_, sizeof(id));
        detail::ThrowTokenOutOfVocabulary(name_, doc, offset + done + wide, id,
                                          vocab_size_ > 0 ? vocab_size_ : INT32_MAX);
      }
      detail::CheckTokenIds(name_, doc, offset + done, part, vocab_size_);
      done += take;
      skip = 0;
    }
  }

 private:
  [[noreturn]] void Bad(const std::string& what) const {
    throw InvalidArgument(fmt::format("{}: not a valid Megatron index: {}", idx_.path(), what));
  }

  void ParseIndex() {
    const auto bytes = idx_.bytes();
    if (static_cast<int64_t>(bytes.size()) < kMegatronIndexHeaderBytes) {
      Bad(fmt::format("{} bytes, shorter than the {}-byte header (truncated?)", bytes.size(),
                      kMegatronIndexHeaderBytes));
    }
    if (std::memcmp(bytes.data(), kMegatronIndexMagic, sizeof(kMegatronIndexMagic)) != 0) {
      Bad("wrong magic: expected the bytes \"MMIDIDX\\0\\0\" at its start");
    }
    const auto version = Load<uint64_t>(bytes.data() + 9);
    if (version != 1) Bad(fmt::format("version {}; expected 1", version));
    const auto code = Load<uint8_t>(bytes.data() + 17);
    if (MegatronDtypeSize(code) == 0) {
      Bad(fmt::format("dtype code {}; expected one of 1..8 (Megatron's DType table)", code));
    }
    if (code == static_cast<uint8_t>(MegatronDtype::kFloat32) ||
        code == static_cast<uint8_t>(MegatronDtype::kFloat64)) {
      Bad(fmt::format("dtype {} (code {}) cannot hold token ids; expected an integer type",
                      MegatronDtypeName(code), code));
    }
    dtype_ = static_cast<MegatronDtype>(code);
    element_size_ = MegatronDtypeSize(code);
    const auto sequences = Load<uint64_t>(bytes.data() + 18);
    const auto doc_entries = Load<uint64_t>(bytes.data() + 26);
    // Each count is bounded by the file size before any multiplication can overflow.
    const uint64_t body = bytes.size() - kMegatronIndexHeaderBytes;
    if (sequences > body / 12 || doc_entries > body / 8 ||
        sequences * 12 + doc_entries * 8 > body) {
      Bad(fmt::format(
          "{} bytes cannot hold the index its header announces ({} sequences, {} "
          "document index entries: {} bytes expected; truncated?)",
          bytes.size(), sequences, doc_entries,
          static_cast<double>(kMegatronIndexHeaderBytes) + 12.0 * sequences + 8.0 * doc_entries));
    }
    const uint64_t expected = kMegatronIndexHeaderBytes + sequences * 12 + doc_entries * 8;
    // Multimodal indexes carry one int8 mode per sequence after the document index (ignored).
    if (bytes.size() != expected && bytes.size() != expected + sequences) {
      Bad(fmt::format("{} bytes; its header announces {} (or {} with sequence modes)", bytes.size(),
                      expected, expected + sequences));
    }
    if (doc_entries == 0) Bad("the document index is empty; expected at least the entry 0");
    num_sequences_ = static_cast<int64_t>(sequences);
    num_documents_ = static_cast<int64_t>(doc_entries) - 1;
    lengths_ = bytes.data() + kMegatronIndexHeaderBytes;
    pointers_ = lengths_ + 4 * sequences;
    documents_ = pointers_ + 8 * sequences;
  }

  void CheckSequences() {
    if (DocumentIndex(0) != 0) {
      Bad(fmt::format("the document index starts at {}; expected 0", DocumentIndex(0)));
    }
    bool one_per_doc = true;
    for (int64_t d = 0; d < num_documents_; ++d) {
      const int64_t a = DocumentIndex(d), b = DocumentIndex(d + 1);
      if (b < a || b > num_sequences_) {
        Bad(
            fmt::format("document index entry {} is {} after {}; expected a non-decreasing run "
                        "up to the sequence count {}",
                        d + 1, b, a, num_sequences_));
      }
      one_per_doc = one_per_doc && b == a + 1;
    }
    if (DocumentIndex(num_documents_) != num_sequences_) {
      Bad(fmt::format("the document index ends at {}; expected the sequence count {}",
                      DocumentIndex(num_documents_), num_sequences_));
    }
    const auto bin_size = static_cast<int64_t>(bin_.size());
    for (int64_t s = 0; s < num_sequences_; ++s) {
      const int64_t len = Length(s), ptr = Pointer(s);
      if (len < 0) Bad(fmt::format("sequence {} has length {}; expected >= 0", s, len));
      if (ptr < 0 || ptr > bin_size || len > (bin_size - ptr) / element_size_) {
        throw InvalidArgument(fmt::format(
            "{}: sequence {} ({} tokens of {} at byte {}) runs past the end of {} ({} bytes): "
            "the .bin is truncated or does not belong to this .idx",
            idx_.path(), s, len, MegatronDtypeName(static_cast<uint8_t>(dtype_)), ptr, bin_.path(),
            bin_size));
      }
      num_tokens_ += len;
    }
    if (num_tokens_ == 0) {
      throw InvalidArgument(
          fmt::format("{}: empty dataset ({} documents, {} sequences, no "
                      "tokens); expected at least one token",
                      idx_.path(), num_documents_, num_sequences_));
    }
    if (!one_per_doc) {
      doc_token_start_.assign(static_cast<size_t>(num_documents_) + 1, 0);
      for (int64_t d = 0; d < num_documents_; ++d) {
        int64_t n = 0;
        for (int64_t s = DocumentIndex(d); s < DocumentIndex(d + 1); ++s) n += Length(s);
        doc_token_start_[static_cast<size_t>(d + 1)] = doc_token_start_[static_cast<size_t>(d)] + n;
      }
    }
  }

  int64_t Length(int64_t s) const { return Load<int32_t>(lengths_ + 4 * s); }
  int64_t Pointer(int64_t s) const { return Load<int64_t>(pointers_ + 8 * s); }
  int64_t DocumentIndex(int64_t d) const { return Load<int64_t>(documents_ + 8 * d); }

  std::string name_;
  MappedFile idx_;
  MappedFile bin_;
  int64_t vocab_size_;
  MegatronDtype dtype_ = MegatronDtype::kUint16;
  int element_size_ = 2;
  int64_t num_sequences_ = 0;
  int64_t num_documents_ = 0;
  int64_t num_tokens_ = 0;
  const std::byte* lengths_ = nullptr;
  const std::byte* pointers_ = nullptr;
  const std::byte* documents_ = nullptr;
  std::vector<int64_t> doc_token_start_;  // only when a document has other than one sequence
};

constexpr size_t kWriteBufferBytes = 1 << 20;

}  // namespace

int MegatronDtypeSize(uint8_t code) {
  switch (code) {
    case 1:
    case 2: return 1;
    case 3:
    case 8: return 2;
    case 4:
    case 7: return 4;
    case 5:
    case 6: return 8;
    default: return 0;
  }
}

std::string MegatronDtypeName(uint8_t code) {
  static constexpr const char* kNames[] = {"unknown", "uint8",   "int8",    "int16", "int32",
                                           "int64",   "float64", "float32", "uint16"};
  return code < 9 ? kNames[code] : "unknown";
}

MegatronDtype MegatronDtypeForVocabulary(int64_t vocab_size) {
  return vocab_size < 65500 ? MegatronDtype::kUint16 : MegatronDtype::kInt32;
}

std::string MegatronPrefix(const std::string& path) {
  if (path.ends_with(".bin") || path.ends_with(".idx")) return path.substr(0, path.size() - 4);
  return path;
}

std::unique_ptr<TokenSource> OpenMegatronDataset(const std::string& prefix,
                                                 const OpenOptions& options) {
  return std::make_unique<MegatronSource>(MegatronPrefix(prefix), options);
}

MegatronWriter::MegatronWriter(std::string prefix, MegatronDtype dtype)
    : prefix_(std::move(prefix)),
      dtype_(dtype),
      element_size_(MegatronDtypeSize(static_cast<uint8_t>(dtype))),
      bin_(prefix_ + ".bin") {
  SY_REQUIRE(dtype == MegatronDtype::kUint16 || dtype == MegatronDtype::kInt32 ||
                 dtype == MegatronDtype::kInt64 || dtype == MegatronDtype::kUint8,
             InvalidArgument,
             "{}: the writer stores token ids as uint8, uint16, int32 or int64; "
             "got {}",
             prefix_, MegatronDtypeName(static_cast<uint8_t>(dtype)));
  CheckOutputPath(prefix_ + ".idx");
  buffer_.reserve(kWriteBufferBytes);
}

MegatronWriter::~MegatronWriter() = default;

void MegatronWriter::AddSequence(std::span<const int32_t> tokens) {
  SY_CHECK(!finished_, "AddSequence after Finish");
  const int64_t max_id = detail::MaxIdOf(dtype_);
  for (size_t i = 0; i < tokens.size(); ++i) {
    const int32_t t = tokens[i];
    SY_REQUIRE(t >= 0 && t <= max_id, InvalidArgument,
               "{}.bin: token id {} (sequence {}, position {}) does not fit the dataset's element "
               "type {}; expected 0..{}",
               prefix_, t, lengths_.size(), i, MegatronDtypeName(static_cast<uint8_t>(dtype_)),
               max_id);
    switch (dtype_) {
      case MegatronDtype::kUint8: AppendBytes(buffer_, static_cast<uint8_t>(t)); break;
      case MegatronDtype::kUint16: AppendBytes(buffer_, static_cast<uint16_t>(t)); break;
      case MegatronDtype::kInt64: AppendBytes(buffer_, static_cast<int64_t>(t)); break;
      default: AppendBytes(buffer_, t); break;
    }
    if (buffer_.size() >= kWriteBufferBytes) Flush();
  }
  SY_REQUIRE(tokens.size() <= static_cast<size_t>(std::numeric_limits<int32_t>::max()),
             InvalidArgument, "{}: a sequence of {} tokens does not fit the index's int32 length",
             prefix_, tokens.size());
  lengths_.push_back(static_cast<int32_t>(tokens.size()));
  num_tokens_ += static_cast<int64_t>(tokens.size());
}

void MegatronWriter::EndDocument() { document_index_.push_back(num_sequences()); }

void MegatronWriter::AddDocument(std::span<const int32_t> tokens) {
  AddSequence(tokens);
  EndDocument();
}

void MegatronWriter::Flush() {
  if (buffer_.empty()) return;
  bin_.Append(buffer_);
  buffer_.clear();
}

void MegatronWriter::Finish() {
  SY_CHECK(!finished_, "Finish called twice");
  Flush();
  std::vector<std::byte> idx;
  idx.reserve(static_cast<size_t>(kMegatronIndexHeaderBytes) + lengths_.size() * 12 +
              document_index_.size() * 8);
  idx.insert(idx.end(), reinterpret_cast<const std::byte*>(kMegatronIndexMagic),
             reinterpret_cast<const std::byte*>(kMegatronIndexMagic) + sizeof(kMegatronIndexMagic));
  AppendBytes(idx, uint64_t{1});
  AppendBytes(idx, static_cast<uint8_t>(dtype_));
  AppendBytes(idx, static_cast<uint64_t>(lengths_.size()));
  AppendBytes(idx, static_cast<uint64_t>(document_index_.size()));
  for (int32_t len : lengths_) AppendBytes(idx, len);
  int64_t pointer = 0;
  for (int32_t len : lengths_) {
    AppendBytes(idx, pointer);
    pointer += static_cast<int64_t>(len) * element_size_;
  }
  for (int64_t d : document_index_) AppendBytes(idx, d);
  AtomicFileWriter idx_writer(prefix_ + ".idx");
  idx_writer.Append(idx);
  bin_.Commit();
  idx_writer.Commit();
  finished_ = true;
}

}  // namespace switchyard::train::dataset
