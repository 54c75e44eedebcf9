// `switchyard tokenizer train|encode|decode` (docs/data.md, "Tokenizers"):
//   train   --input FILES --vocab-size N --model-type bpe|unigram --out PREFIX  -> PREFIX.model
//   encode  --model M --input TEXT [--out IDS]   one line of text (without "\n" or "\r\n")
//                                                -> one line of ids
//   decode  --model M --input IDS  [--out TEXT]  one line of ids  -> one line of text
// --model is a SentencePiece .model file or "bytes" (the byte-level tokenizer).
#include <fmt/format.h>

#include <charconv>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "cli/command.h"
#include "switchyard/core/error.h"
#include "switchyard/core/file_util.h"
#include "switchyard/train/dataset/tokenizer.h"

namespace switchyard::cli {
namespace {

namespace ds = train::dataset;

struct TokenizerTrainOptions {
  std::vector<std::string> inputs;
  int64_t vocab_size = 8000;
  std::string model_type = "bpe";
  std::string out;
  double character_coverage = 0.9995;
  int64_t input_sentence_size = 0;
  int threads = 1;
  bool verbose = false;
};

struct CodecOptions {
  std::string model;
  std::string input;
  std::string out;
};

// Where encode/decode write: --out (atomically, when complete) or stdout.
class LineSink {
 public:
  explicit LineSink(const std::string& path) {
    if (!path.empty()) file_ = std::make_unique<AtomicFileWriter>(path);
  }
  void Line(std::string_view text) {
    if (file_) {
      file_->Append(text);
      file_->Append("\n");
    } else {
      fmt::print("{}\n", text);
    }
  }
  void Commit() {
    if (file_) file_->Commit();
  }

 private:
  std::unique_ptr<AtomicFileWriter> file_;
};

std::ifstream OpenInput(const CodecOptions& o) {
  RequireDistinctOutput({"--out", o.out}, {{"--input", o.input}, {"--model", o.model}});
  // ReadTextFile's checks (missing, directory, FIFO) without reading the file whole.
  RandomAccessFile check(o.input);
  std::ifstream in(o.input, std::ios::binary);
  SY_REQUIRE(in.is_open(), IoError, "--input '{}' cannot be opened", o.input);
  return in;
}

int RunEncode(const CodecOptions& o) {
  const auto tokenizer = ds::LoadTokenizer(o.model);
  std::ifstream in = OpenInput(o);
  LineSink sink(o.out);
  std::string line, ids;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();  // as preprocess reads lines
    ids.clear();
    for (int32_t id : tokenizer->Encode(line)) {
      if (!ids.empty()) ids += ' ';
      ids += std::to_string(id);
    }
    sink.Line(ids);
  }
  sink.Commit();
  return 0;
}

std::vector<int32_t> ParseIds(std::string_view line, const std::string& file, int64_t line_no) {
  std::vector<int32_t> ids;
  size_t i = 0;
  while (i < line.size()) {
    if (line[i] == ' ' || line[i] == '\t' || line[i] == '\r') {
      ++i;
      continue;
    }
    int32_t id = 0;
    const auto [end, ec] = std::from_chars(line.data() + i, line.data() + line.size(), id);
    SY_REQUIRE(
        ec == std::errc() &&
            (end == line.data() + line.size() || *end == ' ' || *end == '\t' || *end == '\r'),
        InvalidArgument, "{}:{}: '{}' is not a token id; expected integers separated by spaces",
        file, line_no, line.substr(i, line.find(' ', i) - i));
    ids.push_back(id);
    i = static_cast<size_t>(end - line.data());
  }
  return ids;
}

int RunDecode(const CodecOptions& o) {
  const auto tokenizer = ds::LoadTokenizer(o.model);
  std::ifstream in = OpenInput(o);
  LineSink sink(o.out);
  std::string line;
  int64_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    sink.Line(tokenizer->Decode(ParseIds(line, o.input, line_no)));
  }
  sink.Commit();
  return 0;
}

int RunTokenizerTrain(const TokenizerTrainOptions& o) {
  ds::SentencePieceTrainOptions options;
  options.inputs = o.inputs;
  options.vocab_size = o.vocab_size;
  options.model_type = o.model_type == "bpe" ? ds::SentencePieceModelType::kBpe
                                             : ds::SentencePieceModelType::kUnigram;
  options.character_coverage = o.character_coverage;
  options.input_sentence_size = o.input_sentence_size;
  options.threads = o.threads;
  options.verbose = o.verbose;
  for (const std::string& in : o.inputs) {
    RequireDistinctOutput({"--out", o.out + ".model"}, {{"--input", in}});
  }
  const std::string path = ds::TrainSentencePiece(options, o.out);
  const ds::SentencePieceTokenizer check(path);
  fmt::print("tokenizer train: {} model of {} pieces -> {}\n", o.model_type, check.vocab_size(),
             path);
  return 0;
}

void AddCodecOptions(CLI::App& app, CodecOptions& o, const char* input_help, const char* out_help) {
  app.add_option("--model", o.model, "SentencePiece .model file, or 'bytes'")
      ->required()
      ->type_name("PATH");
  app.add_option("--input", o.input, input_help)->required()->type_name("PATH");
  app.add_option("--out", o.out, out_help)->type_name("PATH");
}

SY_REGISTER_COMMAND(Command{
    "tokenizer", "train", "Train a SentencePiece model (bpe or unigram) on text files",
    [](CLI::App& app) -> Action {
      auto o = std::make_shared<TokenizerTrainOptions>();
      app.add_option("--input", o->inputs, "text files, one sentence or document per line")
          ->required()
          ->type_name("PATH");
      app.add_option("--vocab-size", o->vocab_size, "pieces in the vocabulary")
          ->check(CLI::Range(int64_t{8}, int64_t{1} << 30));
      app.add_option("--model-type", o->model_type, "bpe | unigram")
          ->check(CLI::IsMember({"bpe", "unigram"}));
      app.add_option("--out", o->out, "output prefix: writes PREFIX.model")
          ->required()
          ->type_name("PATH");
      app.add_option("--character-coverage", o->character_coverage,
                     "share of characters the vocabulary covers (SentencePiece's option)")
          ->check(CLI::Range(0.5, 1.0));
      app.add_option("--input-sentence-size", o->input_sentence_size,
                     "lines sampled for training (0: all)")
          ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
      app.add_option("--threads", o->threads, "training threads")->check(CLI::Range(1, 256));
      app.add_flag("--verbose", o->verbose, "print SentencePiece's training log");
      return [o] { return RunTokenizerTrain(*o); };
    }});

SY_REGISTER_COMMAND(Command{"tokenizer", "encode", "Text to token ids, one line to one line",
                            [](CLI::App& app) -> Action {
                              auto o = std::make_shared<CodecOptions>();
                              AddCodecOptions(app, *o, "text file", "ids file (default: stdout)");
                              return [o] { return RunEncode(*o); };
                            }});

SY_REGISTER_COMMAND(Command{
    "tokenizer", "decode", "Token ids to text, one line to one line", [](CLI::App& app) -> Action {
      auto o = std::make_shared<CodecOptions>();
      AddCodecOptions(app, *o, "file of ids separated by spaces", "text file (default: stdout)");
      return [o] { return RunDecode(*o); };
    }});

}  // namespace
}  // namespace switchyard::cli
