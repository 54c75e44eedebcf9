// `switchyard tokenizer train|encode|decode` and `switchyard preprocess` end to end (runs the
// binary): outputs, round trips and bad flags (exit 2) or files (exit 1) with clear messages.
#include "cli/run_switchyard.h"
#include "core/temp_dir.h"
#include "data/dataset_io.h"
#include "switchyard/core/file_util.h"
#include "switchyard/train/dataset/token_source.h"
#include "switchyard/train/dataset/tokenizer.h"

namespace switchyard::train::dataset {
namespace {

using switchyard::testing::RunSwitchyard;
using switchyard::testing::TempDir;

std::string Corpus() {
  std::string text;
  for (int i = 0; i < 300; ++i) {
    text += fmt::format("line {} of the corpus: experts route tokens across ranks {}\n", i, i % 7);
  }
  return text;
}

TEST(CliTokenizer, TrainEncodeDecodeRoundTrip) {
  TempDir dir;
  WriteTextFileAtomic(dir.File("c.txt"), Corpus());
  auto r =
      RunSwitchyard(fmt::format("tokenizer train --input {} --vocab-size 80 --model-type "
                                "unigram --out {}",
                                dir.File("c.txt"), dir.File("tok")));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("unigram model of 80 pieces"), std::string::npos) << r.out;
  WriteTextFileAtomic(dir.File("in.txt"), "experts route tokens\r\n\nline 3 of the corpus\n");
  r = RunSwitchyard(fmt::format("tokenizer encode --model {} --input {} --out {}",
                                dir.File("tok.model"), dir.File("in.txt"), dir.File("ids.txt")));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string ids = ReadTextFile(dir.File("ids.txt"));
  const SentencePieceTokenizer sp(dir.File("tok.model"));
  std::string expected;
  for (const char* line : {"experts route tokens", "", "line 3 of the corpus"}) {
    std::string row;
    for (int32_t id : sp.Encode(line)) row += (row.empty() ? "" : " ") + std::to_string(id);
    expected += row + "\n";
  }
  EXPECT_EQ(ids, expected);
  r = RunSwitchyard(fmt::format("tokenizer decode --model {} --input {}", dir.File("tok.model"),
                                dir.File("ids.txt")));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "experts route tokens\n\nline 3 of the corpus\n");
  // The byte tokenizer needs no model file.
  r = RunSwitchyard(fmt::format("tokenizer encode --model bytes --input {}", dir.File("in.txt")));
  std::string bytes_line;  // the "\r" of the first line's end is not part of it
  for (unsigned char c : std::string("experts route tokens")) {
    bytes_line += (bytes_line.empty() ? "" : " ") + std::to_string(c);
  }
  EXPECT_EQ(r.out.substr(0, r.out.find('\n')), bytes_line);
}

TEST(CliTokenizer, BadFlagsAndFilesAreClearErrors) {
  TempDir dir;
  WriteTextFileAtomic(dir.File("c.txt"), Corpus());
  auto r =
      RunSwitchyard(fmt::format("tokenizer train --input {} --vocab-size 100 --model-type "
                                "wordpiece --out {}",
                                dir.File("c.txt"), dir.File("t")));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--model-type"), std::string::npos) << r.err;
  r = RunSwitchyard(fmt::format("tokenizer train --input {} --vocab-size 3 --out {}",
                                dir.File("c.txt"), dir.File("t")));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--vocab-size"), std::string::npos) << r.err;
  r = RunSwitchyard(fmt::format("tokenizer encode --model {} --input {}", dir.File("nope.model"),
                                dir.File("c.txt")));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("tokenizer model '" + dir.File("nope.model") + "' does not exist"),
            std::string::npos)
      << r.err;
  WriteTextFileAtomic(dir.File("ids.txt"), "1 2 x3\n");
  r = RunSwitchyard(fmt::format("tokenizer decode --model bytes --input {}", dir.File("ids.txt")));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("ids.txt:1: 'x3' is not a token id"), std::string::npos) << r.err;
  r = RunSwitchyard(fmt::format("tokenizer encode --model bytes --input {} --out {}",
                                dir.File("c.txt"), dir.File("c.txt")));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("names the same file"), std::string::npos) << r.err;
  EXPECT_EQ(ReadTextFile(dir.File("c.txt")), Corpus());
  r = RunSwitchyard("tokenizer");
  EXPECT_EQ(r.exit_code, 2);
}

TEST(CliPreprocess, WritesAMegatronDatasetWithThroughput) {
  TempDir dir;
  WriteTextFileAtomic(dir.File("c.txt"), Corpus());
  auto r = RunSwitchyard(fmt::format("tokenizer train --input {} --vocab-size 150 --out {}",
                                     dir.File("c.txt"), dir.File("tok")));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r =
      RunSwitchyard(fmt::format("preprocess --input {} --tokenizer {} --out {} --append-eod "
                                "--workers 2",
                                dir.File("c.txt"), dir.File("tok.model"), dir.File("ds")));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("preprocess: 300 documents"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("tokens/s"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("100%"), std::string::npos) << r.err;  // the progress line
  const auto source = OpenTokenSource(dir.File("ds"), {.vocab_size = 150});
  ASSERT_EQ(source->num_documents(), 300);
  const SentencePieceTokenizer sp(dir.File("tok.model"));
  auto ids = sp.Encode("line 0 of the corpus: experts route tokens across ranks 0");
  ids.push_back(*sp.eod_id());
  EXPECT_EQ(source->Document(0), ids);
  // Bad flags and files.
  r = RunSwitchyard(fmt::format("preprocess --input {} --tokenizer bytes --out {} --append-eod",
                                dir.File("c.txt"), dir.File("b")));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--append-eod"), std::string::npos) << r.err;
  r = RunSwitchyard(fmt::format("preprocess --input {} --tokenizer bytes --out {} --workers 0",
                                dir.File("c.txt"), dir.File("b")));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--workers"), std::string::npos) << r.err;
  r = RunSwitchyard(fmt::format("preprocess --input {} --tokenizer bytes --out {}",
                                dir.File("none.txt"), dir.File("b")));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--input '" + dir.File("none.txt") + "' does not exist"), std::string::npos)
      << r.err;
  EXPECT_FALSE(std::filesystem::exists(dir.File("b.bin")));
}

}  // namespace
}  // namespace switchyard::train::dataset
