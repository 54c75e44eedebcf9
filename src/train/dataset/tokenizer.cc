#include "switchyard/train/dataset/tokenizer.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>
#include <sys/stat.h>

#include <string>
#include <unordered_map>

#include "switchyard/core/error.h"
#include "switchyard/core/file_util.h"

namespace switchyard::train::dataset {
namespace {

void RequireRegularFile(const std::string& path, std::string_view what) {
  struct stat st {};
  SY_REQUIRE(::stat(path.c_str(), &st) == 0, IoError, "{} '{}' does not exist", what, path);
  SY_REQUIRE(S_ISREG(st.st_mode), IoError, "{} '{}' is not a regular file", what, path);
}

}  // namespace

std::vector<int32_t> ByteTokenizer::Encode(std::string_view text) const {
  std::vector<int32_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
  return ids;
}

std::string ByteTokenizer::Decode(std::span<const int32_t> ids) const {
  std::string text(ids.size(), '\0');
  for (size_t i = 0; i < ids.size(); ++i) {
    SY_REQUIRE(ids[i] >= 0 && ids[i] < 256, InvalidArgument,
               "byte tokenizer: id {} at position {} is outside the vocabulary [0, 256)", ids[i],
               i);
    text[i] = static_cast<char>(ids[i]);
  }
  return text;
}

struct SentencePieceTokenizer::Impl {
  sentencepiece::SentencePieceProcessor processor;
};

SentencePieceTokenizer::SentencePieceTokenizer(const std::string& path)
    : path_(path), impl_(std::make_unique<Impl>()) {
  RequireRegularFile(path, "tokenizer model");
  // Read through our own reader (regular files only), then parse: SentencePiece's Load(path)
  // would report a missing file without naming the flag's value clearly.
  const std::string bytes = ReadTextFile(path);
  const auto status = impl_->processor.LoadFromSerializedProto(bytes);
  SY_REQUIRE(status.ok(), InvalidArgument,
             "tokenizer model '{}': not a SentencePiece model ({}); expected a .model file written "
             "by `switchyard tokenizer train` or spm_train",
             path, status.ToString());
}

SentencePieceTokenizer::~SentencePieceTokenizer() = default;

int64_t SentencePieceTokenizer::vocab_size() const { return impl_->processor.GetPieceSize(); }

std::vector<int32_t> SentencePieceTokenizer::Encode(std::string_view text) const {
  std::vector<int> ids;
  const auto status = impl_->processor.Encode(absl::string_view(text.data(), text.size()), &ids);
  SY_REQUIRE(status.ok(), InvalidArgument, "{}: encoding failed: {}", name(), status.ToString());
  return {ids.begin(), ids.end()};
}

std::string SentencePieceTokenizer::Decode(std::span<const int32_t> ids) const {
  const int64_t vocab = vocab_size();
  for (size_t i = 0; i < ids.size(); ++i) {
    SY_REQUIRE(ids[i] >= 0 && ids[i] < vocab, InvalidArgument,
               "{}: id {} at position {} is outside the vocabulary [0, {})", name(), ids[i], i,
               vocab);
  }
  std::string text;
  const auto status = impl_->processor.Decode(std::vector<int>(ids.begin(), ids.end()), &text);
  SY_REQUIRE(status.ok(), InvalidArgument, "{}: decoding failed: {}", name(), status.ToString());
  return text;
}

std::optional<int32_t> SentencePieceTokenizer::eod_id() const {
  const int eos = impl_->processor.eos_id();
  if (eos < 0) return std::nullopt;
  return eos;
}

std::unique_ptr<Tokenizer> LoadTokenizer(const std::string& spec) {
  if (spec == "bytes") return std::make_unique<ByteTokenizer>();
  return std::make_unique<SentencePieceTokenizer>(spec);
}

std::string TrainSentencePiece(const SentencePieceTrainOptions& options,
                               const std::string& out_prefix) {
  SY_REQUIRE(!options.inputs.empty(), InvalidArgument,
             "tokenizer train: --input: expected at least one text file");
  std::string inputs;
  for (const std::string& in : options.inputs) {
    RequireRegularFile(in, "--input");
    SY_REQUIRE(in.find(',') == std::string::npos, InvalidArgument,
               "--input '{}': SentencePiece takes its inputs as a comma-separated list, so a file "
               "name may not contain ','",
               in);
    inputs += (inputs.empty() ? "" : ",") + in;
  }
  SY_REQUIRE(options.vocab_size >= 8 && options.vocab_size <= (1 << 30), InvalidArgument,
             "--vocab-size {}: expected 8 .. 2^30", options.vocab_size);
  std::string out = out_prefix + ".model";
  CheckOutputPath(out);
  std::unordered_map<std::string, std::string> kwargs{
      {"input", inputs},
      {"model_prefix", ""},
      {"vocab_size", std::to_string(options.vocab_size)},
      {"model_type", options.model_type == SentencePieceModelType::kBpe ? "bpe" : "unigram"},
      {"character_coverage", std::to_string(options.character_coverage)},
      {"input_sentence_size", std::to_string(options.input_sentence_size)},
      {"shuffle_input_sentence", "true"},
      {"num_threads", std::to_string(options.threads)},
      // Ids 0..2: <unk>, <s>, </s> (SentencePiece's defaults, stated so they do not drift).
      {"unk_id", "0"},
      {"bos_id", "1"},
      {"eos_id", "2"},
      {"pad_id", "-1"},
      // SentencePiece's per-step INFO lines only when asked for; its warnings always.
      {"minloglevel", options.verbose ? "0" : "1"},
  };
  std::string model;
  const auto status = sentencepiece::SentencePieceTrainer::Train(kwargs, nullptr, &model);
  SY_REQUIRE(status.ok(), InvalidArgument,
             "tokenizer train: SentencePiece could not train a {} model of {} pieces on {}: {}",
             kwargs["model_type"], options.vocab_size, inputs, status.ToString());
  WriteFileAtomic(out, std::as_bytes(std::span<const char>(model.data(), model.size())));
  return out;
}

}  // namespace switchyard::train::dataset
