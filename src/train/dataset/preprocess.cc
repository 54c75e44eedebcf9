#include "switchyard/train/dataset/preprocess.h"

#include <sys/stat.h>

#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>

#include "switchyard/core/error.h"
#include "switchyard/core/file_util.h"
#include "switchyard/core/thread_pool.h"
#include "switchyard/train/dataset/megatron.h"

namespace switchyard::train::dataset {
namespace {

bool IsJsonLines(const std::string& path) {
  return path.ends_with(".jsonl") || path.ends_with(".json");
}

int64_t RegularFileSize(const std::string& path) {
  struct stat st {};
  SY_REQUIRE(::stat(path.c_str(), &st) == 0, IoError, "preprocess: --input '{}' does not exist",
             path);
  SY_REQUIRE(S_ISREG(st.st_mode), IoError,
             "preprocess: --input '{}' is not a regular file; expected a .txt or .jsonl file",
             path);
  return st.st_size;
}

// Reads documents from the inputs, one file after the other.
class DocumentReader {
 public:
  DocumentReader(const std::vector<std::string>& inputs, std::string json_key)
      : inputs_(inputs), json_key_(std::move(json_key)) {}

  // Up to `max` documents; fewer only at the end of the last input.
  std::vector<std::string> Next(int64_t max, int64_t* empty_skipped) {
    std::vector<std::string> docs;
    std::string line;
    while (static_cast<int64_t>(docs.size()) < max) {
      if (!in_.is_open()) {
        if (next_file_ == inputs_.size()) break;
        in_.open(inputs_[next_file_], std::ios::binary);
        SY_REQUIRE(in_.is_open(), IoError, "preprocess: cannot open --input '{}'",
                   inputs_[next_file_]);
        line_number_ = 0;
      }
      if (!std::getline(in_, line)) {
        SY_REQUIRE(in_.eof(), IoError, "preprocess: reading '{}' failed after line {}",
                   inputs_[next_file_], line_number_);
        in_.close();
        ++next_file_;
        continue;
      }
      bytes_read_ += static_cast<int64_t>(line.size()) + 1;
      ++line_number_;
      if (!line.empty() && line.back() == '\r') line.pop_back();
      std::string doc = IsJsonLines(inputs_[next_file_]) ? FromJson(line) : std::move(line);
      if (doc.empty()) {
        ++*empty_skipped;
        continue;
      }
      docs.push_back(std::move(doc));
    }
    return docs;
  }
  int64_t bytes_read() const { return bytes_read_; }

 private:
  std::string FromJson(const std::string& line) {
    if (line.find_first_not_of(" \t") == std::string::npos) return "";
    const std::string& file = inputs_[next_file_];
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      throw InvalidArgument(
          fmt::format("{}:{}: not a JSON object ({}); expected one JSON object "
                      "per line",
                      file, line_number_, e.what()));
    }
    SY_REQUIRE(j.is_object() && j.contains(json_key_) && j[json_key_].is_string(), InvalidArgument,
               "{}:{}: expected a JSON object with a string \"{}\" (--json-key)", file,
               line_number_, json_key_);
    return j[json_key_].get<std::string>();
  }

  const std::vector<std::string>& inputs_;
  std::string json_key_;
  size_t next_file_ = 0;
  std::ifstream in_;
  int64_t line_number_ = 0;
  int64_t bytes_read_ = 0;
};

std::optional<int32_t> EodOf(const Tokenizer& tokenizer, bool append_eod) {
  if (!append_eod) return std::nullopt;
  const auto eod = tokenizer.eod_id();
  SY_REQUIRE(eod.has_value(), InvalidArgument,
             "--append-eod: the tokenizer {} has no end-of-document id; expected a SentencePiece "
             "model with an eos piece",
             tokenizer.name());
  return eod;
}

}  // namespace

std::vector<std::vector<int32_t>> EncodeDocuments(const Tokenizer& tokenizer,
                                                  std::span<const std::string_view> documents,
                                                  bool append_eod, int workers) {
  SY_REQUIRE(workers >= 1 && workers <= 256, InvalidArgument, "--workers {}: expected 1 .. 256",
             workers);
  const std::optional<int32_t> eod = EodOf(tokenizer, append_eod);
  std::vector<std::vector<int32_t>> ids(documents.size());
  const auto n = static_cast<int64_t>(documents.size());
  const int64_t tasks = std::min<int64_t>(workers, n);
  if (tasks == 0) return ids;
  LocalPool(workers).Run(tasks, [&](int64_t t) {
    for (int64_t i = n * t / tasks; i < n * (t + 1) / tasks; ++i) {
      auto& doc = ids[static_cast<size_t>(i)];
      doc = tokenizer.Encode(documents[static_cast<size_t>(i)]);
      if (eod) doc.push_back(*eod);
    }
  });
  return ids;
}

PreprocessResult Preprocess(const Tokenizer& tokenizer, const PreprocessOptions& options,
                            const std::string& out_prefix) {
  SY_REQUIRE(!options.inputs.empty(), InvalidArgument,
             "preprocess: --input: expected at least one text file");
  SY_REQUIRE(options.workers >= 1 && options.workers <= 256, InvalidArgument,
             "preprocess: --workers {}: expected 1 .. 256", options.workers);
  SY_REQUIRE(options.chunk_documents >= 1, InvalidArgument,
             "preprocess: chunk of {} documents: expected >= 1", options.chunk_documents);
  (void)EodOf(tokenizer, options.append_eod);  // refused before anything is read or written
  PreprocessProgress progress;
  for (const std::string& in : options.inputs) {
    progress.bytes_total += RegularFileSize(in);
    RequireDistinctOutput({"--out", out_prefix + ".bin"}, {{"--input", in}});
    RequireDistinctOutput({"--out", out_prefix + ".idx"}, {{"--input", in}});
  }
  const auto start = std::chrono::steady_clock::now();
  auto seconds = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  MegatronWriter writer(out_prefix, MegatronDtypeForVocabulary(tokenizer.vocab_size()));
  DocumentReader reader(options.inputs, options.json_key);
  PreprocessResult result;
  for (;;) {
    std::vector<std::string> docs = reader.Next(options.chunk_documents, &result.empty_skipped);
    if (docs.empty()) break;
    const std::vector<std::string_view> views(docs.begin(), docs.end());
    const auto ids = EncodeDocuments(tokenizer, views, options.append_eod, options.workers);
    for (size_t i = 0; i < docs.size(); ++i) {
      writer.AddDocument(ids[i]);
      result.text_bytes += static_cast<int64_t>(docs[i].size());
    }
    progress.bytes_read = reader.bytes_read();
    progress.documents = writer.num_documents();
    progress.tokens = writer.num_tokens();
    progress.seconds = seconds();
    if (options.progress) options.progress(progress);
  }
  SY_REQUIRE(writer.num_tokens() > 0, InvalidArgument,
             "preprocess: the inputs hold no document ({} empty lines skipped); expected at "
             "least one non-empty line",
             result.empty_skipped);
  writer.Finish();
  result.documents = writer.num_documents();
  result.tokens = writer.num_tokens();
  result.seconds = seconds();
  result.bin_path = out_prefix + ".bin";
  result.idx_path = out_prefix + ".idx";
  return result;
}

}  // namespace switchyard::train::dataset
