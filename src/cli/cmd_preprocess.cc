// `switchyard preprocess`: text (.txt, one document per line; .jsonl with --json-key) through a
// tokenizer into a Megatron indexed dataset PREFIX.bin + PREFIX.idx (docs/data.md,
// "Preprocessing"). Prints a progress line while it works and the throughput at the end.
#include <fmt/format.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "cli/command.h"
#include "switchyard/core/error.h"
#include "switchyard/core/file_util.h"
#include "switchyard/train/dataset/preprocess.h"
#include "switchyard/train/dataset/tokenizer.h"

namespace switchyard::cli {
namespace {

namespace ds = train::dataset;

struct PreprocessFlags {
  std::vector<std::string> inputs;
  std::string tokenizer;
  std::string out;
  std::string json_key = "text";
  bool append_eod = false;
  int workers = 1;
  bool quiet = false;
};

// "[#######.............]  35%  12.3 MB / 35.1 MB  41,203 docs  9.1M tok  2.1M tok/s"
void PrintProgress(const ds::PreprocessProgress& p) {
  const double fraction =
      p.bytes_total > 0 ? std::min(1.0, static_cast<double>(p.bytes_read) / p.bytes_total) : 1.0;
  constexpr int kWidth = 24;
  const int filled = static_cast<int>(fraction * kWidth);
  std::fprintf(
      stderr, "\rpreprocess: [%s%s] %3.0f%%  %.1f / %.1f MB  %lld docs  %lld tokens  %.0f tokens/s",
      std::string(static_cast<size_t>(filled), '#').c_str(),
      std::string(static_cast<size_t>(kWidth - filled), '.').c_str(), 100 * fraction,
      static_cast<double>(p.bytes_read) / 1e6, static_cast<double>(p.bytes_total) / 1e6,
      static_cast<long long>(p.documents), static_cast<long long>(p.tokens),
      p.seconds > 0 ? static_cast<double>(p.tokens) / p.seconds : 0.0);
  std::fflush(stderr);
}

int RunPreprocess(const PreprocessFlags& f) {
  CheckOutputPath(f.out + ".bin");
  CheckOutputPath(f.out + ".idx");
  const auto tokenizer = ds::LoadTokenizer(f.tokenizer);
  ds::PreprocessOptions options;
  options.inputs = f.inputs;
  options.json_key = f.json_key;
  options.append_eod = f.append_eod;
  options.workers = f.workers;
  if (!f.quiet) options.progress = PrintProgress;
  const ds::PreprocessResult r = ds::Preprocess(*tokenizer, options, f.out);
  if (!f.quiet) std::fputc('\n', stderr);
  fmt::print(
      "preprocess: {} documents ({} empty lines skipped), {} tokens, {} bytes of text "
      "({:.2f} bytes/token) in {:.2f} s: {:.0f} tokens/s, {:.1f} MB/s with {} worker{} -> {} {}\n",
      r.documents, r.empty_skipped, r.tokens, r.text_bytes,
      static_cast<double>(r.text_bytes) /
          static_cast<double>(r.tokens - (f.append_eod ? r.documents : 0)),
      r.seconds, static_cast<double>(r.tokens) / r.seconds,
      static_cast<double>(r.text_bytes) / 1e6 / r.seconds, f.workers, f.workers == 1 ? "" : "s",
      r.bin_path, r.idx_path);
  return 0;
}

SY_REGISTER_COMMAND(Command{
    "", "preprocess", "Tokenize text into a Megatron indexed dataset (PREFIX.bin + PREFIX.idx)",
    [](CLI::App& app) -> Action {
      auto f = std::make_shared<PreprocessFlags>();
      app.add_option("--input", f->inputs,
                     "text files: .txt (one document per line) or .jsonl (one JSON object per "
                     "line, text under --json-key)")
          ->required()
          ->type_name("PATH");
      app.add_option("--tokenizer", f->tokenizer, "SentencePiece .model file, or 'bytes'")
          ->required()
          ->type_name("PATH");
      app.add_option("--out", f->out, "output prefix: writes PREFIX.bin and PREFIX.idx")
          ->required()
          ->type_name("PATH");
      app.add_option("--json-key", f->json_key, "key of the text in .jsonl objects");
      app.add_flag("--append-eod", f->append_eod,
                   "end every document with the tokenizer's end-of-document id");
      app.add_option("--workers", f->workers, "encoding threads")->check(CLI::Range(1, 256));
      app.add_flag("--quiet", f->quiet, "no progress line");
      return [f] { return RunPreprocess(*f); };
    }});

}  // namespace
}  // namespace switchyard::cli
