// Tokenizers: text <-> token ids (docs/data.md, "Tokenizers").
//
//   ByteTokenizer            every byte is its id (vocabulary 256); no end-of-document id. The
//                            default of `switchyard train`.
//   SentencePieceTokenizer   a SentencePiece model (PREFIX.model, from `switchyard tokenizer
//                            train` or any SentencePiece trainer); the end-of-document id is the
//                            model's </s> (eos) id, as Megatron-LM's SentencePiece tokenizer has
//                            it.
//
// Thread-safety: a tokenizer is immutable after construction; Encode/Decode may be called from
// several threads at once.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace switchyard::train::dataset {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Ids are in [0, vocab_size()).
  virtual int64_t vocab_size() const = 0;
  virtual std::vector<int32_t> Encode(std::string_view text) const = 0;
  // InvalidArgument for an id outside the vocabulary.
  virtual std::string Decode(std::span<const int32_t> ids) const = 0;
  // The id that ends a document in preprocessed data (`preprocess --append-eod`), if any.
  virtual std::optional<int32_t> eod_id() const = 0;
  // "bytes" or "sentencepiece:PATH", for messages and run summaries.
  virtual std::string name() const = 0;
};

class ByteTokenizer final : public Tokenizer {
 public:
  int64_t vocab_size() const override { return 256; }
  std::vector<int32_t> Encode(std::string_view text) const override;
  std::string Decode(std::span<const int32_t> ids) const override;
  std::optional<int32_t> eod_id() const override { return std::nullopt; }
  std::string name() const override { return "bytes"; }
};

class SentencePieceTokenizer final : public Tokenizer {
 public:
  // Loads PATH (a serialized SentencePiece model). IoError naming the file when it is missing or
  // not a regular file, InvalidArgument when it is not a SentencePiece model.
  explicit SentencePieceTokenizer(const std::string& path);
  ~SentencePieceTokenizer() override;

  int64_t vocab_size() const override;
  std::vector<int32_t> Encode(std::string_view text) const override;
  std::string Decode(std::span<const int32_t> ids) const override;
  std::optional<int32_t> eod_id() const override;
  std::string name() const override { return "sentencepiece:" + path_; }

 private:
  struct Impl;
  std::string path_;
  std::unique_ptr<Impl> impl_;
};

// "bytes" -> ByteTokenizer, anything else -> SentencePieceTokenizer(path).
std::unique_ptr<Tokenizer> LoadTokenizer(const std::string& spec);

enum class SentencePieceModelType { kBpe, kUnigram };

struct SentencePieceTrainOptions {
  std::vector<std::string> inputs;  // text files, one sentence (document) per line
  int64_t vocab_size = 8000;
  SentencePieceModelType model_type = SentencePieceModelType::kBpe;
  // Sentences read for training (0: all); SentencePiece samples them when there are more.
  int64_t input_sentence_size = 0;
  double character_coverage = 0.9995;
  int threads = 1;
  bool verbose = false;  // SentencePiece's progress log on stderr
};

// Trains a model and writes it to `out_prefix` + ".model" (atomically: a temporary file renamed
// into place). The inputs must be regular files (IoError naming the one that is not); a
// vocabulary SentencePiece cannot reach on this text is an InvalidArgument with its reason.
// Returns the path written.
std::string TrainSentencePiece(const SentencePieceTrainOptions& options,
                               const std::string& out_prefix);

}  // namespace switchyard::train::dataset
